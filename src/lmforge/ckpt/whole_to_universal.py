"""A single-process (or DDP) checkpoint as a DeepSpeed universal checkpoint, so ZeRO resumes it.

DeepSpeed's engine loads only its own checkpoints; with `checkpoint.load_universal` it loads the
universal layout that `ds_to_universal` writes, whatever world size it then runs on. That layout
holds whole, unpartitioned states per parameter name, which is what a single process saved too
(model.safetensors, HF's optimizer.pt), so lmforge writes it from those directly:

    <target>/latest_universal                     the tag ("global_stepN") HF's load looks up
    <target>/global_stepN/zero/<name>/fp32.pt     {"param": fp32 weight}
                                  .../exp_avg.pt  {"param": Adam first moment}
                                  .../exp_avg_sq.pt
                                  .../step.pt     Adam's step count (a tensor, as torch keeps it)
    <target>/global_stepN/zero/optimizer_state.pt group settings (lr, betas, ...) and ds_version
    <target>/global_stepN/<model states file>     what the engine reads besides: scheduler, counters

The readers: `load_hp_checkpoint_state_from_checkpoint_dir` (ZeRO-1/2, deepspeed/runtime/
base_optimizer.py), `load_hp_checkpoint_state_from_checkpoint_dir_stage3` (ZeRO-3) and the engine's
`_load_checkpoint` (deepspeed/runtime/engine.py), DeepSpeed 0.19.8. Only tensors, numbers and
strings are written: the weights-only loads of `no_code_from_checkpoints` read them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import UserInputError

# Adam's per-parameter states, as torch's Adam/AdamW and DeepSpeed's universal files name them.
_MOMENTS = ("exp_avg", "exp_avg_sq")


def whole_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every weight of a whole-state checkpoint: model.safetensors, or the shards its index names."""
    from safetensors.torch import load_file

    index = checkpoint / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(checkpoint / "model.safetensors")
    files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    return {key: value for name in files for key, value in load_file(checkpoint / name).items()}


def write_universal_from_whole(
    checkpoint: Path, target: Path, *, group_names: list[list[str]], zero_stage: int
) -> None:
    """Write the universal form of the whole-state `checkpoint` under `target`. `group_names` are the
    parameter names of this run's optimizer groups in order (`optimizer_group_names`): HF's
    optimizer.pt keys its states by position in those groups, DeepSpeed's files by name."""
    step = _trainer_step(checkpoint)
    tag = f"global_step{step}"
    zero = target / tag / "zero"
    weights = whole_weights(checkpoint)
    saved = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
    by_name = _states_by_name(checkpoint, saved, group_names)
    adam_step = next(iter(by_name.values()))["step"]
    for name, state in by_name.items():
        if name not in weights:
            raise UserInputError(
                f"train.resume: {checkpoint} holds no weights for {name}: another model wrote it; resume it "
                "with the model config that wrote it"
            )
        folder = zero / name
        folder.mkdir(parents=True)
        # fp32 whatever the training precision: ZeRO's master weights are fp32, and a single process
        # in bf16/fp16 mixed precision saved its fp32 weights too.
        torch.save({"param": weights[name].float()}, folder / "fp32.pt")
        for moment in _MOMENTS:
            torch.save({"param": state[moment].float()}, folder / f"{moment}.pt")
        torch.save(state["step"], folder / "step.pt")
    groups = [
        {key: value for key, value in group.items() if key != "params"} for group in saved["param_groups"]
    ]
    torch.save(_optimizer_state(groups, adam_step, zero_stage), zero / "optimizer_state.pt")
    torch.save(_model_states(checkpoint, step), target / tag / _model_states_name(zero_stage))
    (target / "latest_universal").write_text(tag, encoding="utf-8")


def optimizer_group_names(trainer: Any) -> list[list[str]]:
    """The parameter names of each optimizer group as HF's `create_optimizer` builds them (decay,
    then no decay; trainable parameters in `named_parameters` order): the order in which a single
    process's optimizer.pt numbers its states. Under DeepSpeed the optimizer is built later, inside
    the engine's setup, so the names are worked out the same way from the model."""
    model = trainer.model
    decay = set(trainer.get_decay_parameter_names(model))
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    return [
        [name for name, _ in trainable if name in decay],
        [name for name, _ in trainable if name not in decay],
    ]


def _trainer_step(checkpoint: Path) -> int:
    state = checkpoint / "trainer_state.json"
    if not state.is_file():
        raise UserInputError(
            f"train.resume: {checkpoint} has no trainer_state.json: it is no HF Trainer checkpoint"
        )
    return int(json.loads(state.read_text(encoding="utf-8"))["global_step"])


def _states_by_name(checkpoint: Path, saved: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """Adam's state of every parameter, by name: position i of group g in optimizer.pt is name i of
    group g here (HF keeps an empty group too, so the groups pair up as they are)."""
    ours = group_names
    sizes = [len(group["params"]) for group in saved["param_groups"]]
    if sizes != [len(names) for names in ours]:
        raise UserInputError(
            f"train.resume: {checkpoint}/optimizer.pt holds parameter groups of {sizes} parameters and this run's "
            f"AdamW {[len(n) for n in ours]}: another model or optimizer wrote it. DeepSpeed resumes a "
            "single-process checkpoint of HF's AdamW only; resume it with distributed.strategy=fsdp or ddp"
        )
    by_name: dict[str, Any] = {}
    for group, names in zip(saved["param_groups"], ours, strict=True):
        for index, name in zip(group["params"], names, strict=True):
            state = saved["state"].get(index)
            if state is None or any(key not in state for key in (*_MOMENTS, "step")):
                # No state: the parameter never had a gradient (torch creates it at the first step).
                # Other keys: not Adam (Muon, Lion, ...), which DeepSpeed's universal load does not read.
                raise UserInputError(
                    f"train.resume: {checkpoint}/optimizer.pt holds no Adam state (exp_avg, exp_avg_sq, step) for "
                    f"{name}; DeepSpeed resumes a single-process checkpoint of AdamW only. Resume it with "
                    "distributed.strategy=fsdp or ddp"
                )
            by_name[name] = state
    return by_name


def _optimizer_state(
    groups: list[dict[str, Any]], adam_step: torch.Tensor, zero_stage: int
) -> dict[str, Any]:
    from deepspeed import __version__

    # ZeRO-1/2 copy each group's settings (lr, betas, eps, weight_decay, initial_lr, ...) by position and
    # require ds_version; the loss scaler and clipping keep this run's values where absent.
    state: dict[str, Any] = {"param_groups": groups, "ds_version": __version__}
    if zero_stage == 3:
        # ZeRO-3 reads Adam's step from state 0 and the settings from group 0 (for every group, as it
        # does for a checkpoint of its own).
        state["optimizer_state_dict"] = {"state": {0: {"step": adam_step}}, "param_groups": groups}
    return state


def _model_states(checkpoint: Path, step: int) -> dict[str, Any]:
    """The engine's own file: the scheduler it restores (HF's scheduler.pt, which HF restores again
    from the checkpoint directory) and its counters. The weights come from zero/ in a universal
    load, so no `module`."""
    from deepspeed import __version__

    scheduler = checkpoint / "scheduler.pt"
    return {
        "module": None,
        "lr_scheduler": torch.load(scheduler, weights_only=True) if scheduler.is_file() else None,
        "global_steps": step,
        "skipped_steps": 0,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_version": __version__,
    }


def _model_states_name(zero_stage: int) -> str:
    # The names `DeepSpeedEngine._get_ckpt_name` globs in a universal load: ZeRO-3 keeps per-rank files.
    return "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero_stage == 3 else "mp_rank_00_model_states.pt"
