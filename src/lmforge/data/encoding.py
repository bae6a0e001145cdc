"""Token ids of documents with numpy and the `tokenizers` library alone: what the cached path, the
streams and the token store's tasks share. A store task imports this, not transformers or torch, so
a pool of tasks starts in well under a second per task."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tokenizers import Tokenizer

# Token ids of a batch of texts, one list per text.
BatchEncoder = Callable[[list[str]], list[list[int]]]


def untruncated(backend: Tokenizer) -> Tokenizer:
    """`backend` with truncation and padding off: some tokenizer.json files ship with truncation on,
    which would silently cut documents. A copy when either was on, so the caller's is left as it was."""
    if not (backend.truncation or backend.padding):
        return backend
    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


def rust_encoder(backend: Tokenizer) -> BatchEncoder:
    """Token ids of a batch of texts by the Rust backend (which releases the GIL): no special tokens,
    never truncated or padded."""
    backend = untruncated(backend)
    # encode_batch_fast (tokenizers >= 0.20) skips offset tracking, which packing never needs.
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return lambda texts: [encoding.ids for encoding in encode(texts, add_special_tokens=False)]


def encode_documents(encode: BatchEncoder, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `texts` as (all ids concatenated, int32; per-text lengths, int64)."""
    id_lists = encode(texts)
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    # One array per document and one concatenation in C: no token-level Python work.
    flat = np.concatenate([np.asarray(ids, dtype=np.int32) for ids in id_lists] or [np.empty(0, np.int32)])
    return flat, lengths


def join_with_eos(flat_ids: np.ndarray, lengths: np.ndarray, eos_id: int) -> np.ndarray:
    """Insert `eos_id` after each document of `flat_ids` (documents given by `lengths`)."""
    return np.insert(flat_ids, np.cumsum(lengths), np.int32(eos_id))
