"""Regional compile (`train.compile: layers`): torch.compile each decoder layer, the repeated
block, in place, and leave the embedding, the final norm, the head and the loss eager.

Why per layer: the layers are identical, so dynamo traces one layer and every layer reuses its
compiled graph (the whole-model compile traces every layer into one graph); and the loss stays
outside the graphs, so lmforge's chunked cross-entropy (which swaps the head around each training
forward) and Liger's fused linear cross-entropy (which dynamo fails to trace: config/cross_checks.py)
run beside them.

Why in place (`nn.Module.compile`, not `torch.compile(module)`): the layer stays the same module
object, with no `_orig_mod.` wrapper in its parameter names, so checkpoints, resumes, final/ and
the exports see the state_dict keys of an eager run.

When: the Trainer applies Liger's kernels and activation checkpointing to these same layer objects
in `train()`, and FSDP2 shards them in place after that; torch.compile traces lazily, at the first
forward, so all of them are in the compiled layer (FSDP2's hooks are dynamo-disabled: they run
eagerly around it).
"""

from __future__ import annotations

from torch import nn

from lmforge.errors import UserInputError
from lmforge.train.memory_savers import causal_lm


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of `model` (a transformers model, also inside a PEFT wrapper), in
    model order: the modules whose class the model lists in `_no_split_modules` (the blocks FSDP
    wraps too; one nested in another is left to the outer one), else the children of the ModuleList
    of identical modules that holds the most parameters. UserInputError, naming the model's class,
    when neither finds any."""
    lm = causal_lm(model)
    names = set(getattr(lm, "_no_split_modules", None) or [])
    layers = _outermost([m for m in lm.modules() if type(m).__name__ in names])
    if not layers:
        layers = _largest_uniform_list(lm)
    if not layers:
        raise UserInputError(
            f"train.compile: layers: found no decoder layers in {type(lm).__name__} (no module of its "
            "_no_split_modules classes, and no ModuleList of identical layers); use train.compile: model"
        )
    return layers


def compile_layers(model: nn.Module, mode: str) -> str:
    """Compile each decoder layer of `model` in place (`nn.Module.compile`, torch.compile's `mode`:
    train.compile_mode); the rest stays eager. Returns the line that says what was compiled, for the
    run's log."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(mode=mode)
    classes = ", ".join(sorted({type(layer).__name__ for layer in layers}))
    return f"compile: {len(layers)} decoder layers ({classes}) compiled in place, mode {mode}; the loss runs eager"


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    """`modules` without those inside another of them (a listed class nested in a listed block)."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def _largest_uniform_list(model: nn.Module) -> list[nn.Module]:
    """The children of the ModuleList whose children all share one class and which holds the most
    parameters (the layers, rather than an MoE layer's list of experts inside each of them)."""
    candidates = [
        list(m)
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(child) for child in m}) == 1
    ]
    if not candidates:
        return []
    return max(candidates, key=lambda children: sum(p.numel() for c in children for p in c.parameters()))
