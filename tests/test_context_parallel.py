"""Context parallelism (torch's context_parallel: ring attention over a sequence split between ranks),
alone and with FSDP2 or tensor parallelism on one mesh, through the HF Trainer on CPU (gloo):
distributed/context_parallel.py.

The Trainer-level runs (tests/dist_scripts/tp_trainer.py --context) train one tiny Llama like the
tensor-parallel tests: one process (the reference), CP=2 on 2 processes (then resumed from its DCP
checkpoint), and data_shard 2 x context 2 and context 2 x tensor 2 on 4 processes (integration).
Each rank records the sequence length its first attention layer saw, its slice of every parameter
and the samples it read; the tests assert on those. Two `lmforge launch` runs train SFT with
padded batches of uneven length and gradient checkpointing, and resume on one process (integration).

Tolerance: the same as tensor parallelism's (tests/test_tensor_parallel.py:LOSS_RTOL, 5e-6
relative): the ring merges each rank's partial attention by log-sum-exp in float32 and FSDP2 sums
the context ranks' gradients, so only the order of float sums changes. Measured over 4 steps in
fp32: losses within 9e-8 relative of one process, grad norms within 3e-7, eval losses within 2e-7.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lmforge.distributed.context_parallel import sequence_buffers
from lmforge.errors import UserInputError
from tests.conftest import ROOT, run_cli
from tests.test_tensor_parallel import (
    LOSS_RTOL,
    _config,
    _ranks,
    config_with,
    curve,
    expected_local_shape,
    held_shares,
    launch,
    lmforge_config,
    load_script,
    plan_of,
    run_scripts,
    tokens_seen,
    write,
)

SEQ = load_script().SEQ


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """single/ (one process) and cp2/ (2 processes, then resumed from its step-2 checkpoint)."""
    root = tmp_path_factory.mktemp("cp")
    run_scripts((root / "single", 1, ("1", "--context", "1")), (root / "cp2", 2, ("1", "--context", "2")))
    run_scripts((root / "cp2", 2, ("1", "--context", "2", "--resume")))
    return root


def _assert_matches_one_process(result: dict[str, Any], reference: dict[str, Any]) -> None:
    for key in ("losses", "grad_norms", "eval_losses"):
        assert sorted(result[key]) == sorted(reference[key]), key
        for step, value in reference[key].items():
            assert math.isclose(result[key][step], value, rel_tol=LOSS_RTOL), (key, step)


def test_each_rank_attends_over_its_half_of_every_sequence(runs: Path) -> None:
    single = _ranks(runs / "single", 1)[0]
    assert set(single["lengths"]["train"]) == {SEQ}
    for result in _ranks(runs / "cp2", 2):
        # Training and evaluation alike: each rank's attention sees SEQ / 2 positions.
        assert set(result["lengths"]["train"]) == set(result["lengths"]["eval"]) == {SEQ // 2}
        assert result["batches"] == single["batches"]  # the context group reads one batch
        # FSDP2 shards the weights over the context ranks: half of every matrix per rank.
        for name, (full, local) in result["shapes"].items():
            assert local == expected_local_shape(name, full, data=2, tensor=1), (name, full, local)


def test_losses_grad_norms_and_eval_match_one_process(runs: Path) -> None:
    reference = _ranks(runs / "single", 1)[0]
    for result in _ranks(runs / "cp2", 2):
        _assert_matches_one_process(result, reference)


def test_a_context_parallel_checkpoint_resumes_the_same_curve(runs: Path) -> None:
    straight = _ranks(runs / "cp2", 2)
    for rank, resumed in enumerate(_ranks(runs / "cp2", 2, "resume_")):
        assert sorted(resumed["losses"]) == ["3", "4"]
        for step, loss in resumed["losses"].items():
            assert math.isclose(loss, straight[rank]["losses"][step], rel_tol=1e-7), step


def test_the_final_model_is_whole_and_is_the_trained_one(runs: Path) -> None:
    final = runs / "cp2" / "final"
    saved = load_file(str(final / "model.safetensors"))
    assert saved["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    reference = load_file(str(runs / "single" / "final" / "model.safetensors"))
    for name, tensor in reference.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5)
    AutoModelForCausalLM.from_pretrained(str(final))


@pytest.mark.integration
@pytest.mark.parametrize(("run", "tensor"), [("fsdp_cp", 1), ("cp_tp", 2)])
def test_context_parallel_composes_on_four_processes(runs: Path, run: str, tensor: int) -> None:
    """data_shard 2 x context 2, and context 2 x tensor 2 (a 3-D mesh with data_shard 1)."""
    run_scripts((runs / run, 4, (str(tensor), "--context", "2")))
    reference = _ranks(runs / "single", 1)[0]
    results = _ranks(runs / run, 4)
    for result in results:
        assert set(result["lengths"]["train"]) == {SEQ // 2}
        _assert_matches_one_process(result, reference)
        for name, (full, local) in result["shapes"].items():  # FSDP2 over data x context = 4 / tensor
            assert local == expected_local_shape(name, full, data=4 // tensor, tensor=tensor), (name, local)
    batches = [r["batches"] for r in results]
    if tensor == 1:  # ranks 0-1 and 2-3 are context groups: each reads one half of the global batch
        assert batches[0] == batches[1] and batches[2] == batches[3]
        assert [a + b for a, b in zip(batches[0], batches[2], strict=True)] == reference["batches"]
    else:  # one data rank: every rank reads the whole batch
        assert all(b == reference["batches"] for b in batches)


# -- the batch cut, the plan and the refusals: no processes ---------------------------------------


def test_the_batch_is_shifted_positioned_and_padded_before_the_cut() -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [1, 2, 3, 0, 0, 0]])
    mask = (ids > 0).long()
    labels = torch.where(mask.bool(), ids, torch.tensor(-100))
    cut = sequence_buffers({"input_ids": ids, "labels": labels, "attention_mask": mask}, ranks=2)
    assert "attention_mask" not in cut  # the ring runs causal attention; padding sits on the right
    assert cut["input_ids"].shape == (2, 8)  # 6 -> a multiple of 2 x 2 chunks
    assert cut["shift_labels"].tolist() == [
        [6, 7, 8, 9, -100, -100, -100, -100],
        [2, 3, -100, -100, -100, -100, -100, -100],
    ]
    assert cut["labels"][:, 6:].eq(-100).all() and cut["position_ids"][0, :6].tolist() == list(range(6))


def _cp_config(**sections: dict[str, Any]) -> Any:
    return config_with(
        {"preset": "llama-tiny", "config": {"num_attention_heads": 4, "num_key_value_heads": 2}},
        {"strategy": "fsdp", "context_parallel": 2},
        **sections,
    )


def test_the_plan_names_the_context_mesh() -> None:
    assert plan_of(_cp_config(), 2).describe_engine() == "cp (2-D mesh data_shard=1 x context=2)"
    assert plan_of(_cp_config(), 4).describe_engine() == "fsdp x cp (2-D mesh data_shard=2 x context=2)"
    both = _config(distributed={"strategy": "fsdp", "tensor_parallel": 2, "context_parallel": 2})
    plan = plan_of(both, 8)
    assert plan.describe_engine() == "fsdp x cp x tp (3-D mesh data_shard=2 x context=2 x tensor=2)"
    assert plan.summary()["layout"]["context"] == 2
    auto = plan_of(_cp_config(distributed={"strategy": "auto"}), 2)
    assert auto.engine == "fsdp"
    plan_of(_cp_config(train={"compile": True}), 2)  # measured: compile gives the same curve


def test_what_context_parallelism_cannot_run_is_refused_with_every_reason() -> None:
    with pytest.raises(UserInputError) as refused:
        plan_of(
            _cp_config(
                distributed={"strategy": "ddp"},
                model={"attn_implementation": "eager"},
                data={"packing": True},
            ),
            2,
        )
    message = str(refused.value)
    assert "distributed.strategy: ddp with context_parallel: 2" in message and "strategy: fsdp" in message
    assert "model.attn_implementation: eager with context_parallel: 2" in message and "sdpa" in message
    assert "data.packing: true with context_parallel: 2: ring attention runs one causal mask" in message
    for stage in ("dpo", "kto", "rm", "grpo"):
        with pytest.raises(UserInputError, match=f"train.stage: {stage} with context_parallel: 2"):
            plan_of(_cp_config(train={"stage": stage}), 2)
    with pytest.raises(UserInputError, match="data.padding_free: true with context_parallel: 2"):
        plan_of(_cp_config(data={"padding_free": True}), 2)


def test_a_sliding_window_model_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    config = {
        "run": {"name": "window", "output_dir": str(tmp_path)},
        "model": {"config": {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
                             "sliding_window": 16}},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": "builtin:python-stdlib"}]},
        "distributed": {"strategy": "fsdp", "context_parallel": 2},
    }  # fmt: skip
    result = run_cli("launch", str(write(tmp_path / "w.yaml", config)), "--nproc-per-node", "2", "--dry-run")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "'mistral' has sliding_attention layers; ring attention runs full causal attention only"
        in result.stderr
    )


# -- through `lmforge launch` -------------------------------------------------------------------


def _sft_config(out: Path, tokenizer: Path, name: str, steps: int, **distributed: Any) -> dict[str, Any]:
    return {
        "run": {"name": name, "output_dir": str(out), "seed": 0},
        "model": {"preset": "llama-tiny", "config": {"hidden_size": 64, "intermediate_size": 128,
                                                     "num_hidden_layers": 2, "num_attention_heads": 4,
                                                     "num_key_value_heads": 2}},
        "tokenizer": {"path": str(tokenizer)},
        "data": {"train": [{"path": str(ROOT / "examples" / "data" / "chat_messages.jsonl")}], "max_length": 128,
                 "over_length": "truncate", "eval_fraction": 0.1},
        "train": {"stage": "sft", "max_steps": steps, "micro_batch_size": 4, "lr": 3e-3, "schedule": "constant",
                  "warmup_steps": 0, "precision": "fp32", "log_every": 1, "eval_every": 3, "save_every": 3,
                  "gradient_checkpointing": True},
        "distributed": distributed,
        "monitor": {"loggers": [], "system_metrics_seconds": None},
    }  # fmt: skip


# In `make test-integration` (CI time, 31 s): the Trainer-level CP runs above keep context
# parallelism, its sharded eval and its DCP resume in CI; this one adds lmforge's runner, launch
# line, SFT batches of uneven length and the 2 -> 1 resume around the same engine.
@pytest.mark.integration
def test_lmforge_launch_sft_under_context_parallelism_matches_and_resumes_on_one_process(
    tmp_path: Path, corpus: Path
) -> None:
    """Padded conversations of uneven length (each batch padded to a multiple of 2 x 2 chunks),
    gradient checkpointing recomputing inside the ring, then the run extended by one process from
    the CP checkpoint (torch DCP reshards 2 -> 1)."""
    tokenizer = tmp_path / "tok"
    made = run_cli(
        "tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--out", str(tokenizer)
    )
    assert made.returncode == 0, made.stderr[-2000:]
    single = write(tmp_path / "one.yaml", _sft_config(tmp_path, tokenizer, "one", 8, strategy="none"))
    assert (done := run_cli("train", str(single))).returncode == 0, done.stderr[-3000:]
    config = write(
        tmp_path / "cp.yaml", _sft_config(tmp_path, tokenizer, "cp", 6, strategy="fsdp", context_parallel=2)
    )
    result = launch(config, 2)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "distributed: cp (2-D mesh data_shard=1 x context=2) on 2 process(es)" in result.stderr
    shares = held_shares(result.stderr)
    assert sorted(shares) == [0, 1] and all(0.49 < v < 0.52 for v in shares.values()), shares
    extended = run_cli(
        "train",
        str(config),
        "distributed.strategy=none",
        "distributed.context_parallel=1",
        "train.max_steps=8",
    )
    assert extended.returncode == 0, extended.stderr[-3000:]
    run_dir, reference = tmp_path / "cp", tmp_path / "one"
    for key in ("loss", "grad_norm", "eval_loss"):
        mine, expected = curve(run_dir, key), curve(reference, key)
        assert sorted(mine) == sorted(expected), key  # steps 1-8 (eval 0, 3, 6, 8) once each
        for step, value in expected.items():
            assert math.isclose(mine[step], value, rel_tol=LOSS_RTOL), (key, step, mine[step], value)
    for step in ("step-6", "step-8"):  # tokens counted once per context group, before the cut
        assert tokens_seen(run_dir / "checkpoints" / step) == tokens_seen(reference / "checkpoints" / step)
    writer = json.loads((run_dir / "checkpoints" / "step-6" / "lmforge_writer.json").read_text())
    assert writer["layout"]["context"] == 2


@pytest.mark.integration
def test_moe_under_context_parallelism_routes_the_same_tokens(tmp_path: Path, corpus: Path) -> None:
    """Qwen3-MoE, CP=2: the expert-load counts are those of one process at every step and so is the
    language-model loss (router aux loss off). With the aux loss on, each rank computes it over its
    own chunks, as data parallelism computes it per micro-batch: the curves then differ by ~4e-4."""
    runs = {}
    for name, distributed in (
        ("one", {"strategy": "none"}),
        ("cp", {"strategy": "fsdp", "context_parallel": 2}),
    ):
        config = {
            "run": {"name": name, "output_dir": str(tmp_path), "seed": 0},
            "model": {"preset": "qwen3-moe-tiny", "moe": {"router_aux_loss_coef": 0.0}},
            "tokenizer": {"train": {"vocab_size": 300}},
            "data": {"train": [{"path": str(corpus)}], "max_length": 64, "eval_fraction": 0.1},
            "train": {"max_steps": 4, "micro_batch_size": 4, "lr": 3e-3, "schedule": "constant",
                      "warmup_steps": 0, "precision": "fp32", "log_every": 1, "eval_every": 2, "save_every": None},
            "distributed": distributed,
            "monitor": {"loggers": [], "system_metrics_seconds": None},
        }  # fmt: skip
        path = write(tmp_path / f"{name}.yaml", config)
        result = launch(path, 2) if name == "cp" else run_cli("train", str(path))
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = [
            json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
    for mine, reference in zip(runs["cp"], runs["one"], strict=True):
        counts = {k: v for k, v in reference.items() if k.startswith("moe/") and k.endswith("_tokens")}
        assert {k: mine[k] for k in counts} == counts
        for key in ("loss", "eval_loss"):
            if key in reference:
                assert math.isclose(mine[key], reference[key], rel_tol=LOSS_RTOL), (key, mine["step"])


@pytest.mark.integration
def test_compile_under_context_parallelism_gives_the_eager_curve(tmp_path: Path, corpus: Path) -> None:
    """torch.compile traces the model while torch's ring swaps the attention function in each step
    (graph breaks there); the curve is one process's (measured: equal to 1e-7)."""
    one = write(
        tmp_path / "one.yaml", lmforge_config(tmp_path, corpus, "one", micro_batch=4, strategy="none")
    )
    assert (done := run_cli("train", str(one))).returncode == 0, done.stderr[-3000:]
    config = lmforge_config(tmp_path, corpus, "cp", micro_batch=4, strategy="fsdp", context_parallel=2)
    config["train"]["compile"] = True
    result = launch(write(tmp_path / "cp.yaml", config), 2)
    assert result.returncode == 0, result.stderr[-4000:]
    for key in ("loss", "grad_norm", "eval_loss"):
        mine, reference = curve(tmp_path / "cp", key), curve(tmp_path / "one", key)
        assert sorted(mine) == sorted(reference), key
        for step, value in reference.items():
            assert math.isclose(mine[step], value, rel_tol=LOSS_RTOL), (key, step)


def test_the_context_parallel_example_runs_its_launch_line_dry(tmp_path: Path) -> None:
    example = ROOT / "examples" / "distributed_cp.yaml"
    assert "lmforge launch examples/distributed_cp.yaml --nproc-per-node 2" in example.read_text()
    result = run_cli(
        "launch", str(example), "--nproc-per-node", "4", "distributed.tensor_parallel=2", "--dry-run"
    )
    assert result.returncode == 0, result.stderr
    assert "# device mesh: data_shard=1 x context=2 x tensor=2 (4 processes)" in result.stdout
    yaml.safe_load(example.read_text())
