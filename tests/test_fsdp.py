"""FSDP2 through the HF Trainer on CPU (gloo), via lmforge.distributed.fsdp.DataShard.

Runs tests/dist_scripts/fsdp_trainer.py on 2 ranks three times: a 6-step run that saves sharded
(torch DCP) checkpoints at steps 3 and 6 plus a final full HF model, a run resumed from
checkpoint-3, and a run with the plain Trainer (accelerate alone: DDP on CPU) as the reference.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.conftest import ROOT
from tests.forked_cli import FORK_SERVER

SCRIPT = ROOT / "tests" / "dist_scripts" / "fsdp_trainer.py"
pytestmark = (
    pytest.mark.integration
)  # the mechanism under a plain HF Trainer; tests/test_distributed.py runs FSDP through lmforge in CI


def _free_port() -> int:
    # `--master_port 0` makes the c10d rendezvous hang; ask the OS for a free port instead.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _torchrun(out: Path, *extra: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    command = [
        FORK_SERVER.interpreter(), "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(_free_port()), str(SCRIPT), str(out), *extra,
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def _ranks(out: Path, prefix: str = "") -> list[dict[str, Any]]:
    return [json.loads((out / f"{prefix}rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Sequential on purpose: the resume needs checkpoint-3, and 2 cores run one 2-rank job well.
    root = tmp_path_factory.mktemp("fsdp")
    _torchrun(root)
    _torchrun(root, "--resume")
    _torchrun(root, "--plain")
    return root


def test_each_rank_holds_half_of_the_parameters(out: Path) -> None:
    for rank, result in enumerate(_ranks(out)):
        assert result["rank"] == rank and result["world_size"] == 2
        assert result["distributed_type"] == "DistributedType.FSDP"
        assert 0.45 <= result["local_numel"] / result["total_params"] <= 0.55, result
    # Without the mixin accelerate falls back to DDP on CPU: every rank holds everything.
    for result in _ranks(out, "plain_"):
        assert result["distributed_type"] == "DistributedType.MULTI_CPU"
        assert result["local_numel"] == result["total_params"]


def test_losses_finite_decreasing_and_equal_to_ddp(out: Path) -> None:
    fsdp, plain = _ranks(out), _ranks(out, "plain_")
    losses = [fsdp[0]["losses"][str(step)] for step in range(1, 7)]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[3:]) < sum(losses[:3])
    assert fsdp[1]["losses"] == fsdp[0]["losses"]  # the logged loss is averaged over ranks
    # Same data, same seed: sharding must not change the math (only float summation order).
    for step, loss in plain[0]["losses"].items():
        assert fsdp[0]["losses"][step] == pytest.approx(loss, abs=1e-4)


def test_checkpoints_are_sharded_dcp(out: Path) -> None:
    checkpoint = out / "checkpoint-3"
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert (checkpoint / name / ".metadata").is_file()
        assert sorted(p.name for p in (checkpoint / name).glob("*.distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    assert not (checkpoint / "model.safetensors").exists()  # no full gather at checkpoint time
    assert {"rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"} <= {
        p.name for p in checkpoint.iterdir()
    }


def test_resume_from_sharded_checkpoint_reproduces_the_run(out: Path) -> None:
    full = _ranks(out)
    for rank, resumed in enumerate(_ranks(out, "resume_")):
        assert resumed["distributed_type"] == "DistributedType.FSDP"
        assert sorted(resumed["losses"], key=int) == ["4", "5", "6"]
        for step, loss in resumed["losses"].items():
            assert loss == pytest.approx(full[rank]["losses"][step], abs=1e-5)


def test_save_model_writes_the_full_trained_model(out: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    final = out / "final"
    saved = load_file(str(final / "model.safetensors"))
    dcp_to_torch_save(out / "checkpoint-6" / "pytorch_model_fsdp_0", tmp_path / "step6.pt")
    trained = torch.load(tmp_path / "step6.pt", weights_only=True)["model"]
    assert set(saved) == set(trained)
    for key, tensor in saved.items():
        assert tensor.shape == trained[key].shape  # full, not one rank's shard
        torch.testing.assert_close(tensor, trained[key], rtol=0, atol=0)
    model = AutoModelForCausalLM.from_pretrained(str(final))
    assert sum(p.numel() for p in model.parameters()) == _ranks(out)[0]["total_params"]
