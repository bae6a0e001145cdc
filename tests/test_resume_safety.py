"""Resuming FSDP and DeepSpeed checkpoints runs no code from them (reliability issue, item 1).

A pickle whose `__reduce__` calls `os.system` is planted in each slot that upstream readers
unpickle in full (torch DCP's `.metadata` of the FSDP model and optimizer, DeepSpeed's model
and optimizer states, HF's optimizer and scheduler files), and the hash manifest is recomputed so
the checkpoint looks sealed. `lmforge launch` on 2 CPU processes must resume without running it:
the poisoned checkpoints are skipped, naming the file, and the run resumes from the clean one.
Those launches share the 2-process runs of tests/test_distributed.py (DDP, FSDP and ZeRO-3 in
test_two_processes_match_one_and_resume_from_their_own_checkpoint, ZeRO-2 in
test_a_zero2_run_resumes_past_planted_pickles_and_never_runs_them); `plant` below is theirs. Here:
the upstream entry points themselves (DCP's FileSystemReader, DeepSpeed's checkpoint engine,
torch.load with weights_only=False) called directly under lmforge's guard must refuse, and an
explicit `train.resume` of a poisoned checkpoint stops naming the file.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import yaml

from lmforge.ckpt.atomic import commit_checkpoint
from lmforge.ckpt.safe_load import UnsafeCheckpoint, no_code_from_checkpoints


class _Exploit:
    """Unpickling this runs `touch <marker>`: proof that code from the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, marker: Path) -> None:
    """Replace `path` by a malicious pickle of the same kind (raw pickle or torch zip)."""
    if path.name == ".metadata":
        path.write_bytes(pickle.dumps(_Exploit(marker)))
    else:
        torch.save({"module": _Exploit(marker)}, path)


def test_upstream_readers_refuse_pickles_under_the_guard(tmp_path: Path) -> None:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "PWNED"
    states = tmp_path / "mp_rank_00_model_states.pt"
    plant(states, marker)
    dcp = tmp_path / "pytorch_model_fsdp_0"
    dcp.mkdir()
    plant(dcp / ".metadata", marker)
    with no_code_from_checkpoints():
        with pytest.raises(UnsafeCheckpoint, match="posix.system") as refused:
            TorchCheckpointEngine().load(str(states), map_location="cpu")
        assert str(states) in str(refused.value) and "weights_only=False" not in str(refused.value)
        with pytest.raises(UnsafeCheckpoint, match=r"\.metadata.*posix.system"):
            FileSystemReader(str(dcp)).read_metadata()
        with pytest.raises(UnsafeCheckpoint):
            torch.load(states, weights_only=False)
        # Plain data still loads: tensors, containers, DeepSpeed's stage enum.
        from deepspeed.runtime.zero.config import ZeroStageEnum

        torch.save({"w": torch.ones(2), "zero_stage": ZeroStageEnum(2)}, tmp_path / "ok.pt")
        loaded = torch.load(tmp_path / "ok.pt", weights_only=False)
        assert torch.equal(loaded["w"], torch.ones(2)) and loaded["zero_stage"] == 2
    assert not marker.exists()
    assert torch.load.__module__ == "torch.serialization"  # the guard is gone after the block


def test_explicit_resume_of_a_poisoned_checkpoint_exits_2_naming_the_file(tmp_path: Path) -> None:
    """`train.resume: PATH` does not fall back: it names the file and refuses, before any training."""
    from tests.conftest import run_cli

    checkpoint = tmp_path / "step-1"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text('{"global_step": 1}')
    (checkpoint / "model.safetensors").write_bytes(b"")
    from safetensors.torch import save_file

    save_file({"w": torch.ones(1)}, str(checkpoint / "model.safetensors"))
    plant(checkpoint / "optimizer.pt", tmp_path / "PWNED")
    staging = tmp_path / ".staging"
    checkpoint.rename(staging)
    commit_checkpoint(staging, checkpoint, step=1)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"output_dir": str(tmp_path / "runs")},
                "model": {"preset": "llama-tiny"},
                "tokenizer": {"train": {"vocab_size": 300}},
                "data": {"train": [{"path": "builtin:python-stdlib", "max_documents": 5}]},
                "train": {"resume": str(checkpoint), "max_steps": 2},
            }
        )
    )
    result = run_cli("train", str(config))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "optimizer.pt holds the global posix.system" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "PWNED").exists()
