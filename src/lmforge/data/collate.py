"""Collators: lists of tokenized samples -> model-ready batches of torch tensors.

Labels are in transformers' convention: unshifted, IGNORE_INDEX (-100) where no loss; the
model shifts them internally (logits at t predict labels at t + 1).

- `PaddedCollator`: one sample per row, right-padded to the longest in the batch.
- `PackedCollator`: several samples per row (see `lmforge.data.packing`), kept apart by a 4-D
  block-diagonal causal mask, which is what isolates them under sdpa / eager attention. Under
  flex_attention the rows carry restarting position ids and no mask: transformers finds the
  samples from the position ids and builds FlexAttention's block mask itself, which skips the
  blocks between samples; it does so only in a forward without a KV cache, which is how the HF
  Trainer runs its forwards (`TrainingArguments.use_cache`, off, train/arguments.py). A forward
  that keeps a cache (a plain model call) sees one sequence per row: under sdpa / eager, position
  ids alone then do NOT isolate the samples (see the isolation test in tests/test_packing.py).
- `PaddingFreeCollator`: the whole batch as one row with restarting position ids and no mask,
  for flash-attention varlen (GPU); under sdpa / eager the samples would attend to each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import DataCollatorWithFlattening

IGNORE_INDEX = -100
Features = Mapping[str, Any]


def _as_array(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


class PaddedCollator:
    """Pad each sample to the longest in the batch: input_ids (pad id), attention_mask, labels (-100)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Sequence[Features]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(features), longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), longest), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(features), longest), dtype=torch.long)
        for row, feature in enumerate(features):
            n = len(feature["input_ids"])
            input_ids[row, :n] = torch.from_numpy(_as_array(feature["input_ids"]))
            labels[row, :n] = torch.from_numpy(_as_array(feature["labels"]))
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class PackedCollator:
    """Batch packed rows: input_ids, labels, restarting position_ids and a 4-D block-diagonal mask.

    A feature is a packed row ({input_ids, labels, seq_lengths}, as `pack_samples` makes), a
    list of samples ({input_ids, labels}) to concatenate, or {input_ids, labels} holding one
    list per sample. Each sample's first label is set to
    -100, so the model's internal shift never makes one sample predict the next one's first token.

    The mask is [batch, 1, L, L]: boolean (True = attend) for sdpa, additive float (0 / dtype
    min) for eager, whose attention adds the mask to the scores (transformers passes a 4-D mask
    through untouched, see `masking_utils._preprocess_mask_arguments`). Padding attends only to
    itself so no softmax row is empty (an all-masked row gives NaN).
    """

    MASKED_IMPLEMENTATIONS = ("sdpa", "eager")
    POSITIONED_IMPLEMENTATIONS = ("flex_attention",)  # samples found from the position ids

    def __init__(
        self,
        pad_token_id: int,
        *,
        attn_implementation: str = "sdpa",
        dtype: torch.dtype = torch.float32,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        if attn_implementation not in (*self.MASKED_IMPLEMENTATIONS, *self.POSITIONED_IMPLEMENTATIONS):
            raise ValueError(
                f"PackedCollator supports attn_implementation sdpa, eager or flex_attention, not "
                f"{attn_implementation!r}; use PaddingFreeCollator with flash attention"
            )
        self.pad_token_id = pad_token_id
        self.attn_implementation = attn_implementation
        self.dtype = dtype
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Sequence[Features | Sequence[Features]]) -> dict[str, torch.Tensor]:
        rows = [_packed_row(f) for f in features]
        longest = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = len(rows)
        input_ids = torch.full((batch, longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, longest), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros((batch, longest), dtype=torch.long)
        segments = torch.empty((batch, longest), dtype=torch.long)
        for b, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[b, :n] = torch.from_numpy(_as_array(row["input_ids"]))
            labels[b, :n] = torch.from_numpy(_boundary_safe_labels(row["labels"], row["seq_lengths"]))
            position_ids[b, :n] = torch.from_numpy(_restarting_positions(row["seq_lengths"]))
            segments[b, :n] = torch.from_numpy(
                np.repeat(np.arange(len(row["seq_lengths"])), row["seq_lengths"])
            )
            # Each pad position is a segment of its own: it sees itself and nothing else.
            segments[b, n:] = -torch.arange(1, longest - n + 1)
        collated = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        if self.attn_implementation in self.MASKED_IMPLEMENTATIONS:
            collated["attention_mask"] = self._model_mask(block_causal_mask(segments))
        return collated

    def _model_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        if self.attn_implementation == "sdpa":
            return allowed
        return additive_mask(allowed, self.dtype)


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[batch, 1, L, L] boolean mask from per-token segment ids: attend within the segment, causally."""
    length = segments.shape[1]
    same_segment = segments.unsqueeze(2) == segments.unsqueeze(1)
    causal = torch.ones((length, length), dtype=torch.bool).tril()
    return (same_segment & causal).unsqueeze(1)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as eager attention adds it to the scores: 0 where allowed, dtype min elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _packed_row(feature: Features | Sequence[Features]) -> dict[str, np.ndarray]:
    """A row in one layout: concatenated ids with seq_lengths, from any of the accepted layouts."""
    if isinstance(feature, Mapping) and _holds_pieces(feature["input_ids"]):
        # {"input_ids": [[...], [...]], "labels": [[...], [...]]}: one list per sample.
        pieces = zip(feature["input_ids"], feature["labels"], strict=True)
        feature = [{"input_ids": ids, "labels": labels} for ids, labels in pieces]
    if isinstance(feature, Mapping):
        lengths = feature.get("seq_lengths")
        if lengths is None:  # a lone sample is a row of one
            lengths = [len(feature["input_ids"])]
        return {
            "input_ids": _as_array(feature["input_ids"]),
            "labels": _as_array(feature["labels"]),
            "seq_lengths": _as_array(lengths),
        }
    return {
        "input_ids": np.concatenate([_as_array(s["input_ids"]) for s in feature]),
        "labels": np.concatenate([_as_array(s["labels"]) for s in feature]),
        "seq_lengths": _as_array([len(s["input_ids"]) for s in feature]),
    }


def _holds_pieces(input_ids: Any) -> bool:
    return len(input_ids) > 0 and isinstance(input_ids[0], (list, tuple, np.ndarray, torch.Tensor))


def _boundary_safe_labels(labels: np.ndarray, seq_lengths: np.ndarray) -> np.ndarray:
    """Labels with each sample's first position set to -100 (no target crosses a boundary)."""
    safe = np.array(labels, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(seq_lengths)[:-1]]).astype(np.int64)
    safe[starts] = IGNORE_INDEX
    return safe


def _restarting_positions(seq_lengths: np.ndarray) -> np.ndarray:
    """0, 1, ..., n_k - 1 for each sample k, concatenated."""
    total = int(np.sum(seq_lengths))
    starts = np.repeat(np.cumsum(seq_lengths) - seq_lengths, seq_lengths)
    return np.arange(total, dtype=np.int64) - starts


class PaddingFreeCollator:
    """The whole batch as one row with restarting position_ids and no attention mask.

    Wraps transformers' `DataCollatorWithFlattening` (labels get -100 at each sample's first
    token; flash-attention varlen kwargs cu_seq_lens / max_length included). Only flash
    attention keeps samples apart in this layout; sdpa / eager would let them attend across.
    """

    def __init__(self, *, return_flash_attn_kwargs: bool = True) -> None:
        self._flatten = DataCollatorWithFlattening(
            return_position_ids=True, return_flash_attn_kwargs=return_flash_attn_kwargs, return_tensors="pt"
        )

    def __call__(self, features: Sequence[Features]) -> dict[str, Any]:
        plain = [{"input_ids": _as_array(f["input_ids"]), "labels": _as_array(f["labels"])} for f in features]
        return dict(self._flatten(plain))
