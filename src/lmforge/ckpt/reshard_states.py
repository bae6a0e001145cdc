"""Whole states and torch DCP shards loaded into a model and optimizer of another world size, and
the RNG file a rank continues from: the reads a resharding resume makes
(`distributed/reshard.py` decides which applies).

- torch DCP (an FSDP2 checkpoint) into a plain model and optimizer (`load_dcp_model`,
  `load_dcp_optimizer`), and the flattened optimizer format pipeline stages write
  (`save_flat_dcp_optimizer`, `dcp_optimizer_is_flat`);
- whole states (one process, DDP) into sharded FSDP2 parameters (`load_whole_model`,
  `load_whole_optimizer`);
- RNG states of another world size (`rng_stand_in`, `restore_rng`).

Pure functions of a checkpoint directory and the objects they fill; every read runs inside
`ckpt/safe_load.py:no_code_from_checkpoints` (weights-only loads, DCP metadata under an allow-list).
"""

from __future__ import annotations

import random
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.ckpt.whole_to_universal import whole_weights
from lmforge.errors import UserInputError

# accelerate's FSDP checkpoint directories (FSDP_MODEL_NAME / OPTIMIZER_NAME, index 0), torch DCP each.
DCP_MODEL_DIR = "pytorch_model_fsdp_0"
DCP_OPTIMIZER_DIR = "optimizer_0"
_RNG_FILE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")


# ---- torch DCP (FSDP2) into a plain model and optimizer ----


def is_dcp_checkpoint(checkpoint: Path) -> bool:
    return (checkpoint / DCP_MODEL_DIR / ".metadata").is_file()


def load_dcp_model(model: torch.nn.Module, checkpoint: Path) -> None:
    """The FSDP2 checkpoint's model state into a plain (unsharded) `model`: DCP reads each whole
    tensor from the shards its metadata locates."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    # accelerate saved {"model": <state dict by parameter name>}; the template says what to read.
    state = {"model": get_model_state_dict(model)}
    _load_in_this_process(state, checkpoint / DCP_MODEL_DIR)
    set_model_state_dict(model, state["model"])


def load_dcp_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path, *, collective: bool = False
) -> None:
    """The FSDP2 checkpoint's optimizer state (moments, step counts, group settings) into the
    `optimizer` of `model`: the plain one of a single process or DDP replica, or (`collective`,
    every rank calls it) this rank's shard. DCP keys each state by parameter name, not position,
    so it lands on the same parameter whatever order this optimizer holds them in; a flattened
    checkpoint (`save_flat_dcp_optimizer`) keys the group settings by parameter name too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    directory = checkpoint / DCP_OPTIMIZER_DIR
    options = StateDictOptions(flatten_optimizer_state_dict=dcp_optimizer_is_flat(directory))
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    # The template creates the empty moments to fill.
    state = {"optimizer": get_optimizer_state_dict(model, inner, options=options)}
    if collective:
        dcp.load(state, checkpoint_id=str(directory))
    else:
        _load_in_this_process(state, directory)
    set_optimizer_state_dict(model, inner, state["optimizer"], options=options)


def save_flat_dcp_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path
) -> None:
    """The optimizer as a torch DCP checkpoint where the group settings (lr, betas, ...) are keyed
    by parameter name like the moments. accelerate's format keeps one list of groups, which DCP
    takes from a single rank: right when every rank holds a shard of every parameter (FSDP2), but
    ranks that hold different parameters (pipeline stages) would each lose theirs (measured: a
    resume failed with KeyError 'betas'). A collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {"optimizer": get_optimizer_state_dict(model, inner, options=options)}
    dcp.save(state, checkpoint_id=str(checkpoint / DCP_OPTIMIZER_DIR))


def dcp_optimizer_is_flat(directory: Path) -> bool:
    """Whether a DCP optimizer checkpoint keys its group settings by parameter name (flattened)
    rather than by group position ("optimizer.param_groups.0.lr")."""
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    prefix = "optimizer.param_groups."
    return any(key.startswith(prefix) and not key[len(prefix) :].split(".")[0].isdigit() for key in keys)


def _load_in_this_process(state: dict[str, Any], directory: Path) -> None:
    import torch.distributed.checkpoint as dcp

    # Each process reads the whole state (one process, or each DDP replica): no collective, even
    # where a process group exists. DCP warns about that intent where there is none.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)


# ---- whole states (one process, DDP) into sharded parameters (FSDP2, FSDP2 + TP) ----

_WHOLE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def has_whole_states(checkpoint: Path) -> bool:
    """Whether `checkpoint` holds a whole model and optimizer as HF writes them in one process or
    a DDP replica (model.safetensors, optimizer.pt), rather than torch DCP shards."""
    return not is_dcp_checkpoint(checkpoint) and any((checkpoint / name).is_file() for name in _WHOLE_WEIGHTS)


def load_whole_model(model: torch.nn.Module, checkpoint: Path) -> None:
    """A whole model's weights into `model`, whose parameters are sharded DTensors (FSDP2, on a 1-D
    or a 2-D tensor-parallel mesh): every rank reads the file and keeps its own shard (torch's
    `set_model_state_dict` with full state dicts distributes each tensor to the parameter's mesh and
    placements). A tied output head is absent from the file; it is the embedding's parameter."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    weights = whole_weights(checkpoint)
    expected = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    missing = sorted({name for name, _ in model.named_parameters()} - set(weights))
    if missing:
        raise UserInputError(
            f"train.resume: {checkpoint} holds no weights for {', '.join(missing[:5])}: it was written for "
            "another model; resume it with the model config that wrote it"
        )
    state: dict[str, Any] = {key: value for key, value in weights.items() if key in expected}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def load_whole_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """A whole optimizer state (HF's optimizer.pt of one process: moments keyed by position in the
    parameter groups) into the `optimizer` of the sharded `model`. Both optimizers were built the
    same way from the same model (HF's decay / no-decay groups in parameter order), so position i
    of group g is the same parameter; torch's `set_optimizer_state_dict` then keys by parameter name
    and keeps each rank's shard of every moment."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    saved = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
    names = {id(param): name for name, param in model.named_parameters()}
    shapes = [len(group["params"]) for group in saved["param_groups"]]
    if shapes != [len(group["params"]) for group in inner.param_groups]:
        raise UserInputError(
            f"train.resume: {checkpoint}/optimizer.pt holds parameter groups of {shapes} parameters and this "
            f"run's optimizer {[len(g['params']) for g in inner.param_groups]}: another model or optimizer "
            "wrote it; resume it with the config that wrote it"
        )
    state: dict[str, Any] = {}
    groups = []
    for theirs, ours in zip(saved["param_groups"], inner.param_groups, strict=True):
        fqns = [names[id(param)] for param in ours["params"]]
        for index, fqn in zip(theirs["params"], fqns, strict=True):
            if index in saved["state"]:
                state[fqn] = saved["state"][index]
        groups.append({**theirs, "params": fqns})
    set_optimizer_state_dict(
        model, inner, {"state": state, "param_groups": groups}, options=StateDictOptions(full_state_dict=True)
    )


# ---- RNG states of another world size ----


def rng_stand_in(checkpoint: Path, *, rank: int, world_size: int) -> Path | None:
    """The RNG file this rank continues from when the checkpoint has none under the name HF looks
    for (another world size wrote it): rank r takes writer rank r mod N's. None when HF finds its
    own file, or there is none at all."""
    own = "rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth"
    if (checkpoint / own).is_file():
        return None
    found = {}
    for path in checkpoint.glob("rng_state*.pth"):
        match = _RNG_FILE.match(path.name)
        if match:
            found[int(match.group(1) or 0)] = path
    if not found:
        return None
    ranks = sorted(found)
    return found[ranks[rank % len(ranks)]]


def restore_rng(path: Path, *, distributed: bool) -> None:
    """Python, numpy, torch CPU (and CUDA) RNG states from an HF `rng_state*.pth`, as HF restores them."""
    from transformers.trainer_pt_utils import safe_globals, set_rng_state_for_device

    with safe_globals():  # HF's allow-list for numpy's RNG state
        state = torch.load(path, weights_only=True)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        set_rng_state_for_device("CUDA", torch.cuda, state, distributed)
