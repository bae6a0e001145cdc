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
`ContextParallel` answers those two hooks from lmforge's mesh, and the rest is the Trainer's own.

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
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lmforge.data.collate import IGNORE_INDEX
from lmforge.distributed.layout import Layout
from lmforge.distributed.tensor_parallel import CONTEXT_DIM, MESH_ATTRIBUTE, build_mesh

log = logging.getLogger(__name__)

__all__ = [
    "ContextParallel",
    "context_mesh",
    "enable_cpu_ring_attention",
    "prepare_context_parallel",
    "sequence_buffers",
]


def prepare_context_parallel(model: Any, layout: Layout, *, on_gpu: bool) -> None:
    """Put the model on the mesh with a context dimension and make its attention layers causal-only.

    A no-op unless `layout.context > 1`. Called right after the model is built, after tensor
    parallelism (whose mesh, built with the context dimension, it then shares)."""
    if layout.context == 1:
        return
    from accelerate.big_modeling import _attach_context_parallel_hooks

    if getattr(model, MESH_ATTRIBUTE, None) is None:
        setattr(model, MESH_ATTRIBUTE, build_mesh(layout, on_gpu=on_gpu))
    _attach_context_parallel_hooks(model)
    if not on_gpu:
        enable_cpu_ring_attention()
    log.info(
        "context parallel: each sequence split over %d ranks (ring attention, head-tail load balancing)",
        layout.context,
    )


def context_mesh(model: Any) -> Any:
    """The mesh's context dimension, or None when the model is not context parallel."""
    mesh = getattr(model, MESH_ATTRIBUTE, None)
    if mesh is None or CONTEXT_DIM not in (mesh.mesh_dim_names or ()):
        return None
    return mesh[CONTEXT_DIM]


def sequence_buffers(inputs: dict[str, Any], ranks: int) -> dict[str, Any]:
    """The batch as context parallelism cuts it: labels shifted before the cut (the boundary token
    of a chunk predicts the next chunk's first), explicit position ids, right-padded to a multiple
    of 2 x ranks (the load balancer's chunks), and no attention mask (the ring runs causal attention;
    lmforge's collators pad on the right, so no real token ever attends to padding)."""
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


class ContextParallel:
    """Trainer mixin: the HF Trainer's own context-parallel step, on lmforge's mesh.

    Use as `class MyTrainer(ContextParallel, Trainer)`; a no-op for a model without a context
    dimension (`prepare_context_parallel` was not called, or with context_parallel: 1)."""

    def get_cp_size(self) -> int:
        mesh = context_mesh(self.model)  # type: ignore[attr-defined]
        return mesh.size() if mesh is not None else super().get_cp_size()  # type: ignore[misc]

    def _prepare_context_parallel_inputs(self, model: Any, inputs: dict[str, Any]) -> Any:
        mesh = context_mesh(self.model)  # type: ignore[attr-defined]
        if mesh is None or not isinstance(inputs, dict):
            return super()._prepare_context_parallel_inputs(model, inputs)  # type: ignore[misc]
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

    def prediction_step(
        self,
        model: Any,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> Any:
        loss, logits, labels = super().prediction_step(  # type: ignore[misc]
            model, inputs, prediction_loss_only, ignore_keys=ignore_keys
        )
        mesh = context_mesh(self.model)  # type: ignore[attr-defined]
        if mesh is None or loss is None:
            return loss, logits, labels
        if not prediction_loss_only:
            raise NotImplementedError(
                "evaluation under context parallelism returns losses only: each rank holds a slice of the logits"
            )
        # Each rank scored its chunks of the batch; the group's mean is the batch's loss, which the
        # eval gather then takes once per context group (tensor_parallel.gather_once_per_batch_group).
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.get_group())
        return total / mesh.size(), None, None


# -- the CPU kernel in torch's ring ----------------------------------------------------------------


def enable_cpu_ring_attention() -> None:
    """Let torch's ring attention run the CPU flash kernel (forward and backward). Idempotent.

    torch dispatches a sharded (DTensor) attention call to a handler per kernel: the table lists the
    CUDA kernels only, and a CPU call would fail with "CP only supports flash attention and memory
    efficient attention". The CPU kernel's signature differs from the CUDA flash kernel's, so it gets
    adapters of its own; the ring (rotation, causal load balancing, log-sum-exp merge) is torch's."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    aten = torch.ops.aten
    forward = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    ring.custom_ops[forward] = _cpu_ring_handler
    ring.custom_ops[backward] = _cpu_ring_handler


def _cpu_ring_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A sharded CPU attention call -> torch's ring on the local chunks -> sharded results."""
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
