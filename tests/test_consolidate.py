"""`lmforge ckpt consolidate` on checkpoints written by real 2-process CPU runs (torchrun, gloo).

DeepSpeed ZeRO-2 (tied embeddings) and ZeRO-3 (untied head) through HF Trainer, and FSDP2
(`fully_shard`) saved with `dcp.save`, each written once per session by a script under
tests/dist_scripts/. The consolidated weights must equal DeepSpeed's own zero_to_fp32 result
bit for bit, and the model must give the logits the trained model gave.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lmforge.ckpt.zero_checkpoint import load_rank_file
from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.export.consolidate import consolidate
from lmforge.export.inspect import inspect_checkpoint
from lmforge.models.build import build_model
from tests.conftest import ROOT, SMALL_ARCH, run_cli
from tests.forked_cli import FORK_SERVER

SCRIPTS = ROOT / "tests" / "dist_scripts"
RUNS = {  # name: (script, extra args, tied embeddings)
    "zero1": ("write_zero_checkpoint.py", ["1"], False),
    "zero2": ("write_zero_checkpoint.py", ["2"], True),
    "zero3": ("write_zero_checkpoint.py", ["3"], False),
    "fsdp": ("write_fsdp_checkpoint.py", [], True),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _save_base(out: Path, tied: bool) -> Path:
    tokenizer = train_tokenizer(
        ["the cat sat on the mat\n", "one two three\n"] * 50, TokenizerTrainConfig(vocab_size=300)
    )
    torch.manual_seed(0)
    config = {**SMALL_ARCH, "tie_word_embeddings": tied}
    model = build_model(ModelConfig(preset="llama-tiny", config=config), tokenizer, max_length=64)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The four training runs, started together (each is mostly process start-up) and awaited."""
    root = tmp_path_factory.mktemp("consolidate")
    bases = {tied: _save_base(root / f"base-{'tied' if tied else 'untied'}", tied) for tied in (True, False)}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    started = {}
    for name, (script, extra, tied) in RUNS.items():
        command = [
            FORK_SERVER.interpreter(), "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(_free_port()), str(SCRIPTS / script), str(bases[tied]), str(root / name), *extra,
        ]  # fmt: skip
        log = (root / f"{name}.log").open("w")
        started[name] = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    for name, process in started.items():
        assert process.wait(timeout=600) == 0, (root / f"{name}.log").read_text()[-3000:]
    return {name: root / name for name in RUNS}


def zero_checkpoint(runs: dict[str, Path], name: str) -> Path:
    return runs[name] / "checkpoint-3"


def deepspeed_fp32(checkpoint: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))


def written(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def logits_of(model_dir: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert model.dtype == torch.float32
    inputs = (torch.arange(2 * 16).reshape(2, 16) * 7) % model.config.vocab_size  # the script's batch
    with torch.no_grad():
        return model(inputs).logits


@pytest.mark.parametrize(("name", "stage"), [("zero1", 1), ("zero2", 2), ("zero3", 3)])
def test_zero_equals_deepspeed_zero_to_fp32(
    runs: dict[str, Path], tmp_path: Path, name: str, stage: int
) -> None:
    checkpoint = zero_checkpoint(runs, name)
    report = consolidate(checkpoint, tmp_path / "out")
    assert (report.zero_stage, report.world_size, report.step) == (stage, 2, 3)
    expected, ours = deepspeed_fp32(checkpoint), written(tmp_path / "out")
    tied = RUNS[name][2]
    # zero_to_fp32 repeats the tied head under its own name; the HF layout stores it once.
    assert set(ours) == set(expected) - ({"lm_head.weight"} if tied else set())
    for key, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[key]), key
    # The model is what training left: same logits as the trained engine's gathered parameters.
    reference = load_file(str(runs[name] / "reference.safetensors"))["logits"]
    torch.testing.assert_close(logits_of(tmp_path / "out"), reference)
    assert (tmp_path / "out" / "tokenizer.json").is_file() and report.tokenizer


def test_global_step_dir_and_shards_and_dtype(runs: dict[str, Path], tmp_path: Path) -> None:
    tag_dir = zero_checkpoint(runs, "zero3") / "global_step3"
    consolidate(tag_dir, tmp_path / "bf16", max_shard_size="100KB", dtype="bf16")
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    expected = deepspeed_fp32(zero_checkpoint(runs, "zero3"))
    for key, tensor in written(tmp_path / "bf16").items():
        assert torch.equal(tensor, expected[key].to(torch.bfloat16)), key
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_fsdp2_dcp_equals_unsharded_weights(runs: dict[str, Path], tmp_path: Path) -> None:
    shards = json.loads((runs["fsdp"] / "shards.json").read_text())
    # FSDP really sharded: each rank held half of the parameters (NOTES.md: HF's fsdp on CPU may not).
    assert sum(shards["held"]) == shards["total"] and max(shards["held"]) <= shards["total"] // 2 + 64
    report = consolidate(runs["fsdp"] / "dcp", tmp_path / "out")
    assert (report.format, report.world_size) == ("torch-dcp", 2)
    assert report.skipped and all(key.startswith("optim.") for key in report.skipped)
    reference = load_file(str(runs["fsdp"] / "reference.safetensors"))
    ours = written(tmp_path / "out")
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied: stored once
    for key, tensor in ours.items():
        assert torch.equal(tensor, reference[key]), key
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert torch.equal(model.lm_head.weight, reference["lm_head.weight"])
    # The layout HF Trainer / accelerate write for FSDP: checkpoint-N/pytorch_model_fsdp_0/ + config.
    trainer_like = tmp_path / "checkpoint-1"
    shutil.copytree(runs["fsdp"] / "dcp", trainer_like / "pytorch_model_fsdp_0")
    shutil.copy(runs["fsdp"] / "config.json", trainer_like)
    consolidate(trainer_like, tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (
        tmp_path / "out" / "model.safetensors"
    ).read_bytes()
    assert not (tmp_path / "again" / "tokenizer.json").exists()  # none there: weights and config only


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_app_state_layout(runs: dict[str, Path], tmp_path: Path) -> None:
    """torch's DCP recipe nests the model under an app-state entry, next to the optimizer."""
    import torch.distributed.checkpoint as dcp

    reference = load_file(str(runs["fsdp"] / "reference.safetensors"))
    state = {
        "app": {
            "model": dict(reference),
            "optim": {"state": {"model.norm.weight": {"exp_avg": torch.ones(64)}}},
        }
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    report = consolidate(tmp_path / "dcp", tmp_path / "out", config_dir=runs["fsdp"])
    assert report.skipped == ["app.optim.state.model.norm.weight.exp_avg"]
    ours = written(tmp_path / "out")
    assert set(ours) == set(reference) - {"lm_head.weight"}
    assert all(torch.equal(tensor, reference[key]) for key, tensor in ours.items())


def test_missing_rank_file_is_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    damaged = tmp_path / "checkpoint-3"
    shutil.copytree(zero_checkpoint(runs, "zero3"), damaged)
    (damaged / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(
        UserInputError, match=r"incomplete ZeRO-3 .*world size 2: missing zero_pp_rank_1_mp_rank_00_optim"
    ):
        consolidate(damaged, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    info = inspect_checkpoint(damaged)
    assert info["complete"] is False and info["missing_files"] == [
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    ]
    # A rank file of a larger, older save left in the directory: zero_to_fp32 refuses it too.
    leftover = tmp_path / "leftover"
    shutil.copytree(zero_checkpoint(runs, "zero2"), leftover)
    rank0 = leftover / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shutil.copy(rank0, rank0.with_name("zero_pp_rank_2_mp_rank_00_optim_states.pt"))
    with pytest.raises(UserInputError, match="more ranks than the world size 2: zero_pp_rank_2"):
        consolidate(leftover, tmp_path / "out")
    assert inspect_checkpoint(leftover)["complete"] is False
    # The output directory is replaced as a whole, so it may not hold the checkpoint.
    with pytest.raises(UserInputError, match="overlaps the checkpoint"):
        consolidate(leftover / "global_step3", leftover)
    assert rank0.is_file()
    dcp_copy = tmp_path / "dcp"
    shutil.copytree(runs["fsdp"] / "dcp", dcp_copy)
    (dcp_copy / "__1_0.distcp").unlink()
    with pytest.raises(UserInputError, match=r"incomplete DCP checkpoint of 2 ranks: missing __1_0.distcp"):
        consolidate(dcp_copy, tmp_path / "out")
    assert inspect_checkpoint(dcp_copy)["missing_shards"] == ["__1_0.distcp"]


def test_inspect_reports_stage_and_world_size(runs: dict[str, Path]) -> None:
    for name, stage in (("zero1", 1), ("zero2", 2), ("zero3", 3)):
        info = inspect_checkpoint(zero_checkpoint(runs, name))
        assert info["format"] == "deepspeed-zero" and info["complete"] is True
        assert (info["zero_stage"], info["world_size"], info["global_step"]) == (stage, 2, 3)
    assert inspect_checkpoint(runs["fsdp"] / "dcp") == {
        "path": str(runs["fsdp"] / "dcp"),
        "format": "torch-dcp",
        "world_size": 2,
    }


def test_cli(runs: dict[str, Path], tmp_path: Path) -> None:
    result = run_cli(
        "ckpt", "consolidate", str(zero_checkpoint(runs, "zero2")), "--out", str(tmp_path / "out")
    )
    assert result.returncode == 0, result.stderr
    assert "ZeRO-2 checkpoint of 2 ranks" in result.stdout
    assert (tmp_path / "out" / "model.safetensors").is_file()
    # No config.json anywhere near: refused with the fix.
    bare = tmp_path / "bare" / "dcp"
    shutil.copytree(runs["fsdp"] / "dcp", bare)
    bad = run_cli("ckpt", "consolidate", str(bare), "--out", str(tmp_path / "o2"))
    assert bad.returncode == 2 and "no config.json" in bad.stderr and "--config" in bad.stderr
    good = run_cli(
        "ckpt", "consolidate", str(bare), "--out", str(tmp_path / "o2"), "--config", str(runs["fsdp"])
    )
    assert good.returncode == 0, good.stderr


class _Payload:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("echo pwned",))


def test_foreign_pickles_are_refused(runs: dict[str, Path], tmp_path: Path) -> None:
    rank_file = zero_checkpoint(runs, "zero3") / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = load_rank_file(rank_file)["optimizer_state_dict"]
    assert int(state["zero_stage"]) == 3  # DeepSpeed's enum, read through an inert stand-in
    evil = tmp_path / "global_step1"
    evil.mkdir()
    torch.save({"optimizer_state_dict": _Payload()}, evil / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(UserInputError, match="does not unpickle"):
        load_rank_file(evil / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    dcp_copy = tmp_path / "dcp"
    shutil.copytree(runs["fsdp"] / "dcp", dcp_copy)
    (dcp_copy / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(UserInputError, match="not DCP metadata"):
        consolidate(dcp_copy, tmp_path / "out", config_dir=runs["fsdp"])
