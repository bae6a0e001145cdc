"""Context parallelism through the HF Trainer: each sequence split over ranks, attention as a ring.

The engines are torch's `context_parallel` (torch.distributed.tensor.experimental) and accelerate's
context-parallel attention hooks. For each micro-batch, torch's context manager cuts the sequence
buffers (input ids, the already-shifted labels, position ids) into 2 x cp chunks and gives each rank
a head chunk and a tail chunk (its load balancing: causal attention costs the same on every rank),
and while the forward and backward run it turns every `F.scaled_dot_product_attention` into its
ring attention: the ranks pass key/value blocks around and merge the partial results by their
log-sum-exp. accelerate's hooks make each attention layer drop its mask and run `is_causal`, the
only mask the ring knows. No attention maths lives here.

Around the engines, the path tensor parallelism takes (distributed/tensor_parallel.py): one device
mesh (dp_shard, cp[, tp]); FSDP2 shards the weights over the data and context ranks together
(torchtitan's `dp_shard_cp`), so the context ranks of one sequence, which hold different tokens of
it, have their gradients summed by FSDP2's reduce-scatter like data ranks; accelerate's data loader
gives the ranks of one context group the same batch. The HF Trainer runs context parallelism itself
when accelerate has a ParallelismConfig with cp_size > 1: `training_step` wraps forward and backward
in `_prepare_context_parallel_inputs`'s context, the token count is divided by `get_cp_size()`, and
the loss is scaled by the processes that read different tokens. accelerate refuses a ParallelismConfig
on CPU and cannot build FSDP2 x TP with these versions (distributed/tensor_parallel.py says why), so
the `ContextParallel` dimension answers those two hooks from lmforge's mesh (the Trainer adapter,
train/hf_trainer.py, asks it), and the rest is the Trainer's own.

The loss: each rank's cross-entropy sums over its tokens and divides by the step's token count,
which the Trainer counted before the cut, then scales by the data x context ranks; FSDP2 averages
over the same ranks, so the update is the one-process update (measured in
tests/test_context_parallel.py). Evaluation runs sharded too (a long sequence's logits are what
fill memory) and averages each context group's loss before the Trainer gathers one per group.

On CPU: torch's ring attention knows the CUDA kernels (flash, memory-efficient, cuDNN). The CPU
flash kernel returns the same (output, log-sum-exp) pair, so `enable_cpu_ring_attention` hands it
to the same ring (torch's `_templated_ring_attention` and its backward), the way torch registers its
own kernels; that is what lets gloo processes test the whole path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmforge.distributed.layout import Layout, divisors
from lmforge.distributed.parallel_state import DimensionHooks, ParallelState
from lmforge.distributed.plan_terms import MemorySplit
from lmforge.distributed.tensor_parallel import CONTEXT_DIM, build_mesh

if TYPE_CHECKING:
    # Annotations only (the imports a run needs are in its functions): `plan_layout` and the
    # planner read this dimension's checks before the training stack loads.
    import torch
    from torch import nn

    from lmforge.config.schema import DistributedConfig
    from lmforge.distributed.estimate import ModelShape
    from lmforge.distributed.plan_terms import Workload

log = logging.getLogger(__name__)

__all__ = [
    "CONTEXT",
    "ContextParallel",
    "context_mesh",
    "enable_cpu_ring_attention",
    "prepare_context_parallel",
    "sequence_buffers",
]


def prepare_context_parallel(model: Any, layout: Layout, *, on_gpu: bool, mesh: Any = None) -> Any:
    """Make the model's attention layers causal-only; the mesh with a context dimension (`mesh`,
    tensor parallelism's, which it then shares, else a new one), or None.

    A no-op unless `layout.context > 1`. Called right after the model is built, after tensor
    parallelism."""
    if layout.context == 1:
        return mesh
    from accelerate.big_modeling import _attach_context_parallel_hooks

    if mesh is None:
        mesh = build_mesh(layout, on_gpu=on_gpu)
    _attach_context_parallel_hooks(model)
    if not on_gpu:
        enable_cpu_ring_attention()
    log.info(
        "context parallel: each sequence split over %d ranks (ring attention, head-tail load balancing)",
        layout.context,
    )
    return mesh


def context_mesh(mesh: Any) -> Any:
    """The context dimension of the run's `mesh`, or None when the model is not context parallel."""
    if mesh is None or CONTEXT_DIM not in (mesh.mesh_dim_names or ()):
        return None
    return mesh[CONTEXT_DIM]


def sequence_buffers(inputs: dict[str, Any], ranks: int) -> dict[str, Any]:
    """The batch as context parallelism cuts it: labels shifted before the cut (the boundary token
    of a chunk predicts the next chunk's first), explicit position ids, right-padded to a multiple
    of 2 x ranks (the load balancer's chunks), and no attention mask (the ring runs causal attention;
    lmforge's collators pad on the right, so no real token ever attends to padding)."""
    import torch
    import torch.nn.functional as F

    from lmforge.data.collate import IGNORE_INDEX

    ids = inputs["input_ids"]
    length = ids.shape[1]
    padded = -(-length // (2 * ranks)) * (2 * ranks)
    out = {key: value for key, value in inputs.items() if key != "attention_mask"}
    labels = inputs.get("labels")
    if labels is not None and "shift_labels" not in inputs:
        out["shift_labels"] = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    if "position_ids" not in inputs:
        out["position_ids"] = torch.arange(length, device=ids.device).expand(ids.shape[0], -1)
    fill = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "input_ids": 0, "position_ids": 0}
    for key, value in fill.items():
        if key in out and padded > length:
            out[key] = F.pad(out[key], (0, padded - length), value=value)
    return out


class ContextParallel(DimensionHooks):
    """Context parallelism as a parallel dimension: the HF Trainer's own context-parallel step, on
    lmforge's mesh (the adapter asks `batch_ranks` for `get_cp_size`, `split_batch` for
    `_prepare_context_parallel_inputs`, `eval_loss` in `prediction_step`)."""

    name = "context"

    def problems(self, settings: DistributedConfig, model_config: Any, world_size: int) -> list[str]:
        cp = settings.context_parallel
        if cp == 1:
            return []
        # Ring attention runs plain causal attention over the whole sequence: a layer that looks at a
        # window only would silently be trained with full attention (accelerate refuses it too).
        layer_types = getattr(model_config, "layer_types", None) or []
        windowed = sorted({kind for kind in layer_types if kind != "full_attention"})
        if (
            not layer_types
            and getattr(model_config, "sliding_window", None)
            and getattr(model_config, "use_sliding_window", True)
        ):
            windowed = ["sliding_attention"]
        if windowed:
            return [
                f"context_parallel: {cp}: {getattr(model_config, 'model_type', '?')!r} has {', '.join(windowed)} layers; ring "
                "attention runs full causal attention only, so those layers would train with the wrong mask; use a "
                "full-attention model (or set its sliding_window: null), or set context_parallel: 1"
            ]
        return []

    def planner_degrees(
        self, shape: ModelShape, *, world: int, gpus_per_node: int, seq_len: int
    ) -> list[int]:
        # the load-balanced ring cuts each sequence into 2 x degree chunks
        return [c for c in divisors(world) if c == 1 or seq_len % (2 * c) == 0]

    def planner_split(self, degree: int, work: Workload) -> MemorySplit:
        # FSDP2 shards over the data and context ranks together; each holds seq / degree tokens
        return MemorySplit(states=degree, tokens=degree)

    def used_by(self, layout: Layout) -> bool:
        return layout.context > 1

    def apply(self, model: nn.Module, state: ParallelState) -> None:
        assert state.layout is not None
        state.mesh = prepare_context_parallel(model, state.layout, on_gpu=state.on_gpu, mesh=state.mesh)

    def batch_ranks(self, state: ParallelState) -> int | None:
        mesh = context_mesh(state.mesh)
        return mesh.size() if mesh is not None else None

    def split_batch(
        self, state: ParallelState, inputs: dict[str, Any]
    ) -> tuple[Callable[..., Any], dict[str, Any]] | None:
        mesh = context_mesh(state.mesh)
        if mesh is None or not isinstance(inputs, dict):
            return None
        from torch.distributed.tensor.experimental import context_parallel

        inputs = sequence_buffers(inputs, mesh.size())
        buffers = [
            inputs[key] for key in ("input_ids", "labels", "shift_labels", "position_ids") if key in inputs
        ]
        enter = functools.partial(
            context_parallel,
            mesh,
            buffers=buffers,
            buffer_seq_dims=[1] * len(buffers),
            no_restore_buffers=set(buffers),
        )
        return enter, inputs

    def eval_loss(
        self, state: ParallelState, loss: torch.Tensor, *, losses_only: bool
    ) -> torch.Tensor | None:
        import torch.distributed as dist

        mesh = context_mesh(state.mesh)
        if mesh is None:
            return None
        if not losses_only:
            raise NotImplementedError(
                "evaluation under context parallelism returns losses only: each rank holds a slice of the logits"
            )
        # Each rank scored its chunks of the batch; the group's mean is the batch's loss, which the
        # eval gather then takes once per context group (tensor_parallel.gather_once_per_batch_group).
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.get_group())
        return total / mesh.size()


CONTEXT = ContextParallel()


# -- the CPU kernel in torch's ring ----------------------------------------------------------------


def enable_cpu_ring_attention() -> None:
    """Let torch's ring attention run the CPU flash kernel (forward and backward). Idempotent.

    torch dispatches a sharded (DTensor) attention call to a handler per kernel: the table lists the
    CUDA kernels only, and a CPU call would fail with "CP only supports flash attention and memory
    efficient attention". The CPU kernel's signature differs from the CUDA flash kernel's, so it gets
    adapters of its own; the ring (rotation, causal load balancing, log-sum-exp merge) is torch's."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    aten = torch.ops.aten
    forward = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    ring.custom_ops[forward] = _cpu_ring_handler
    ring.custom_ops[backward] = _cpu_ring_handler


def _cpu_ring_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A sharded CPU attention call -> torch's ring on the local chunks -> sharded results."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    mesh = info.compute_mesh
    local_args: Any = info.local_args  # this rank's chunks, and the kernel's other arguments
    local_kwargs: Any = info.local_kwargs
    group, seq_dim = mesh.get_group(), 2
    if local_kwargs.get("attn_mask") is not None:
        raise NotImplementedError("context parallelism runs causal attention only, without a mask")
    aten = torch.ops.aten
    if op_call == aten._scaled_dot_product_flash_attention_for_cpu.default:
        query, key, value, *rest = local_args
        dropout_p = rest[0] if rest else local_kwargs.get("dropout_p", 0.0)
        is_causal = rest[1] if len(rest) > 1 else local_kwargs.get("is_causal", False)
        results = ring._templated_ring_attention(
            group, seq_dim, aten._scaled_dot_product_flash_attention_for_cpu, query=query, key=key,
            value=value, is_causal=is_causal, dropout_p=dropout_p, scale=local_kwargs.get("scale"),
        )  # fmt: skip
    else:
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = local_args
        results = ring._templated_ring_attention_backward(
            group, seq_dim, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad_out, grad_out_name="grad_out", query=query, key=key, value=value, out=out,
            logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=local_kwargs.get("scale"),
        )  # fmt: skip
    return tuple(DTensor.from_local(t, mesh, [Shard(seq_dim)], run_check=False) for t in results)
