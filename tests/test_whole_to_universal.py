"""Whole states (one process, DDP) written as DeepSpeed's universal checkpoint, file by file, and where
that conversion goes. The resume itself (2 ZeRO processes continuing a single-process curve) is in
tests/test_reshard_resume.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lmforge.ckpt.universal import convert_to_universal, universal_dir
from lmforge.ckpt.whole_to_universal import write_universal_from_whole
from lmforge.distributed.reshard import resume_path
from lmforge.errors import UserInputError
from lmforge.run_layout import RunPaths
from lmforge.train.run_setup import clear_partial_writes

NAMES = [["body.weight"], ["body.bias"]]  # HF's groups: decay, then no decay


def whole_checkpoint(
    path: Path, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW
) -> torch.nn.Module:
    """What HF Trainer saves in one process after 2 steps of a 2-group optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.body = torch.nn.Linear(3, 2)
    kwargs = {"momentum": 0.9} if optimizer is torch.optim.SGD else {}
    opt = optimizer([{"params": [model.body.weight]}, {"params": [model.body.bias]}], lr=0.1, **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / 10)
    for _ in range(2):
        model.body(torch.randn(4, 3)).square().sum().backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors")
    torch.save(opt.state_dict(), path / "optimizer.pt")
    torch.save(scheduler.state_dict(), path / "scheduler.pt")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    return model


@pytest.mark.parametrize(("stage", "model_states"), [(2, "mp_rank_00_model_states.pt"), (3, "zero_pp_rank_0_mp_rank_00_model_states.pt")])  # fmt: skip
def test_whole_states_become_deepspeeds_universal_files(
    tmp_path: Path, stage: int, model_states: str
) -> None:
    model = whole_checkpoint(tmp_path / "step-2")
    saved = torch.load(tmp_path / "step-2" / "optimizer.pt", weights_only=True)
    write_universal_from_whole(tmp_path / "step-2", tmp_path / "u", group_names=NAMES, zero_stage=stage)

    assert (tmp_path / "u" / "latest_universal").read_text() == "global_step2"  # the tag HF's load reads
    zero = tmp_path / "u" / "global_step2" / "zero"
    for position, name in enumerate(("body.weight", "body.bias")):
        files = {f.stem: torch.load(f, weights_only=True) for f in (zero / name).iterdir()}
        assert sorted(files) == ["exp_avg", "exp_avg_sq", "fp32", "step"]
        assert torch.equal(files["fp32"]["param"], model.state_dict()[name])
        for moment in ("exp_avg", "exp_avg_sq"):  # optimizer.pt's position `position` is this name's
            assert torch.equal(files[moment]["param"], saved["state"][position][moment])
        assert files["step"] == 2
    optimizer_state = torch.load(zero / "optimizer_state.pt", weights_only=True)
    assert [g["initial_lr"] for g in optimizer_state["param_groups"]] == [0.1, 0.1]
    assert optimizer_state["param_groups"][0]["lr"] == pytest.approx(0.08)
    if stage == 3:
        assert optimizer_state["optimizer_state_dict"]["state"][0]["step"] == 2
    engine = torch.load(tmp_path / "u" / "global_step2" / model_states, weights_only=True)
    assert engine["global_steps"] == 2 and engine["lr_scheduler"]["last_epoch"] == 2


def test_a_whole_checkpoint_of_another_optimizer_is_refused_with_the_way_forward(tmp_path: Path) -> None:
    whole_checkpoint(tmp_path / "step-2", torch.optim.SGD)
    with pytest.raises(UserInputError) as refused:
        convert_to_universal(tmp_path / "step-2", tmp_path / "u", whole_groups=NAMES, zero_stage=2)
    message = str(refused.value)
    assert (
        f"{tmp_path / 'step-2'}/optimizer.pt holds no Adam state (exp_avg, exp_avg_sq, step) for body.weight"
        in message
    )
    assert "distributed.strategy=fsdp or ddp" in message
    with pytest.raises(
        UserInputError, match=r"parameter groups of \[1, 1\] parameters and this run's AdamW \[2\]"
    ):
        convert_to_universal(tmp_path / "step-2", tmp_path / "u", whole_groups=[["body.weight", "body.bias"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]  # nothing half-written left


def test_the_universal_form_goes_into_the_run_being_trained_and_its_cleanup(tmp_path: Path) -> None:
    """Resuming another run's checkpoint wrote step-N.universal/ into that run's checkpoints/; now it
    goes under this run's checkpoints/.staging, which the run removes with its partial writes."""
    other = tmp_path / "other" / "checkpoints" / "step-2"
    whole_checkpoint(other)
    paths = RunPaths(tmp_path / "this")
    paths.staging.mkdir(parents=True)
    target = convert_to_universal(
        other, universal_dir(other, paths.staging), whole_groups=NAMES, zero_stage=2
    )
    assert target == paths.checkpoints / ".staging" / "step-2.universal"
    assert (target / "global_step2" / "zero" / "body.weight" / "fp32.pt").is_file()
    assert (target / "trainer_state.json").is_file()  # HF's files travel with it
    assert sorted(p.name for p in other.parent.iterdir()) == ["step-2"]  # the other run is untouched
    clear_partial_writes(paths)  # what a later launch does after a crash left it behind
    assert not target.exists()


def test_a_single_process_lora_checkpoint_is_refused_under_deepspeed_with_the_way_forward(
    tmp_path: Path,
) -> None:
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    now = {"engine": "deepspeed", "world_size": 2, "zero_stage": 2}
    with pytest.raises(UserInputError) as refused:
        resume_path(tmp_path, {"engine": "none", "world_size": 1}, now)
    assert f"{tmp_path} holds a LoRA adapter (adapter_model.safetensors)" in str(refused.value)
    assert "distributed.strategy=ddp" in str(refused.value)
    assert resume_path(tmp_path, None, {"engine": "ddp", "world_size": 2}).kind == "whole"
