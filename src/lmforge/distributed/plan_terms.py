"""What `lmforge estimate`'s layout planner (distributed/planner.py) tells each parallel dimension,
and what a dimension answers: the `Workload` of one device, and the `MemorySplit` by which the
dimension, at a degree, divides that device's memory (its `planner_split` hook).

Below the dimensions and the planner, and free of torch, so the dimensions' planner terms are read
without the training stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

__all__ = ["MemorySplit", "Workload", "combined_split"]


@dataclass(frozen=True)
class Workload:
    """What one device computes per micro-batch, the same under every layout."""

    micro_batch: int
    seq_len: int
    pipeline_microbatches: int | None  # chunks each micro-batch is cut into (None: one per stage)
    mixed: bool
    optimizer_bytes: float  # the optimizer's state per parameter (AdamW: 8)
    checkpointing: bool
    sdpa: bool
    interleaved: bool = False  # interleaved 1F1B: two virtual stages per rank
    gpipe: bool = False  # GPipe runs every chunk's forward before any backward
    chunked_loss: bool = False  # train.chunked_cross_entropy
    checkpoint_every: int = 1  # train.checkpoint_every: selective checkpointing
    activation_offload: bool = False  # train.activation_offload: one layer's activations on the device


@dataclass(frozen=True)
class MemorySplit:
    """How one dimension of a planned layout divides a device's memory; 1 (or 0.0) leaves that part
    whole. The planner multiplies the dimensions' splits together (`combined_split`)."""

    layers: int = 1  # ranks holding different layers (pipeline stages)
    within_layer: int = 1  # ranks splitting each layer's weights and activations (tensor)
    experts: int = 1  # ranks holding different experts of a layer
    states: int = 1  # ranks FSDP2 shards weights, gradients and optimizer states over (data, context)
    tokens: int = 1  # ranks holding different tokens of one sequence (context)
    chunks: int = 1  # pieces each micro-batch is cut into (pipeline micro-batches)
    chunks_held: int = 1  # of those pieces, how many a rank keeps activations for at once
    bubble: float = 0.0  # the share of a step a rank waits idle


def combined_split(splits: list[MemorySplit]) -> MemorySplit:
    """The layout's split: the dimensions' divisors multiplied (each divides its own ranks), the
    longest idle share."""
    return MemorySplit(
        layers=prod(s.layers for s in splits),
        within_layer=prod(s.within_layer for s in splits),
        experts=prod(s.experts for s in splits),
        states=prod(s.states for s in splits),
        tokens=prod(s.tokens for s in splits),
        chunks=prod(s.chunks for s in splits),
        chunks_held=prod(s.chunks_held for s in splits),
        bubble=max((s.bubble for s in splits), default=0.0),
    )
