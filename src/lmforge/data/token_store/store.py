"""`open_token_store`: a built store, checked, as the training and eval datasets of a run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import DataConfig, SourceConfig
from lmforge.data.mixture import planned_blocks
from lmforge.data.prep import split_holdout
from lmforge.data.token_store.dataset import SourceTokens, StoreBlocks
from lmforge.data.token_store.layout import input_files, store_fingerprint, store_location
from lmforge.data.token_store.manifest import Shard, check_against_run, checked_shards, read_manifest
from lmforge.data.token_store.shards import tokens_path
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.errors import UserInputError

_MAX_POWER = 41  # histogram bins: lmforge.data.stats.LengthHistogram's


@dataclass
class TokenStoreData:
    """A run's view of a token store: datasets, the store's fingerprint, the data report."""

    train: StoreBlocks
    eval: StoreBlocks | None
    fingerprint: str
    report: dict[str, Any]
    path: Path


def open_token_store(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, *, seed: int, cache_dir: Path
) -> TokenStoreData:
    """Check the store of `cfg`'s sources and open it memory-mapped as blocks of data.max_length.

    Refuses (UserInputError naming the file and the fix) a store not built, built with another
    tokenizer or from sources that changed since, a missing or truncated shard, or a manifest that
    does not match its shards. Train is the weighted mix of the train sources (data.mixture, seeded
    with `seed`); eval is data.eval's sources, else a seeded hold-out of the train blocks, drawn as
    the cached path draws it.
    """
    files = input_files(cfg)
    fingerprint = store_fingerprint(cfg, tokenizer, files)
    store = store_location(cfg, cache_dir, fingerprint)
    default_location = cfg.store is None or cfg.store.path is None
    manifest = read_manifest(store, default_location=default_location)
    tokenizer_fp = tokenizer_fingerprint(tokenizer)
    check_against_run(store, manifest, files, tokenizer_fp)
    shards = checked_shards(store, manifest, tokenizer_fp)
    length = cfg.max_length
    train_sources = [_source_tokens(s, length) for s in shards["train"]]
    kept_train, eval_data = _eval_split(cfg, shards, train_sources, seed)
    available = [
        s.blocks if kept is None else len(kept) for s, kept in zip(train_sources, kept_train, strict=True)
    ]
    budgets = [None if s.max_tokens is None else s.max_tokens // length for s in cfg.train]
    planned = planned_blocks(available, [s.weight for s in cfg.train], budgets)
    if sum(planned) == 0:
        raise UserInputError(
            f"data.train: the token store {store} holds fewer tokens per source than one block of "
            f"data.max_length={length}. Fix: add data or lower data.max_length."
        )
    train = StoreBlocks(train_sources, kept_train, planned, seed)
    report = _report(cfg, manifest, store, shards, train, eval_data)
    return TokenStoreData(train, eval_data, fingerprint, report, store)


def _source_tokens(shards: Sequence[Shard], block_length: int) -> SourceTokens:
    return SourceTokens([tokens_path(s.stem) for s in shards], [s.info.tokens for s in shards], block_length)


def _eval_split(
    cfg: DataConfig, shards: dict[str, list[list[Shard]]], train: list[SourceTokens], seed: int
) -> tuple[list[np.ndarray | None], StoreBlocks | None]:
    """(the train blocks each source keeps, the eval dataset). Eval sources are read whole, in
    order; a hold-out draws over all train blocks (sources one after another) with the cached
    path's `split_holdout`, so one source gives the cache's exact split."""
    if cfg.eval:
        sources = [_source_tokens(s, cfg.max_length) for s in shards["eval"]]
        return [None] * len(train), StoreBlocks(
            sources, [None] * len(sources), [s.blocks for s in sources], seed
        )
    if cfg.eval_fraction <= 0:
        return [None] * len(train), None
    total = sum(s.blocks for s in train)
    train_rows, eval_rows = split_holdout(
        total,
        cfg.eval_fraction,
        seed,
        too_few=f"data.eval_fraction={cfg.eval_fraction}: the training data makes only {total} block(s), and "
        "holding out eval blocks needs at least 2. Fix: add training data, lower data.max_length, set "
        "data.eval sources, or set data.eval_fraction: 0.",
    )
    starts = np.concatenate([[0], np.cumsum([s.blocks for s in train])])
    kept_train: list[np.ndarray | None] = [_within(train_rows, starts, i) for i in range(len(train))]
    kept_eval: list[np.ndarray | None] = [_within(eval_rows, starts, i) for i in range(len(train))]
    planned = [len(k) for k in kept_eval if k is not None]
    return kept_train, StoreBlocks(train, kept_eval, planned, seed)


def _within(rows: np.ndarray, starts: np.ndarray, source: int) -> np.ndarray:
    begin, end = int(starts[source]), int(starts[source + 1])
    return rows[(rows >= begin) & (rows < end)] - begin


def _report(
    cfg: DataConfig,
    manifest: dict[str, Any],
    store: Path,
    shards: dict[str, list[list[Shard]]],
    train: StoreBlocks,
    evaluation: StoreBlocks | None,
) -> dict[str, Any]:
    """The cached path's report keys where they apply, plus the mix per source and the store."""
    train_report = _split_report(cfg.train, shards["train"], cfg.max_length)
    for entry, source, index in zip(train_report["sources"], cfg.train, range(len(cfg.train)), strict=True):
        blocks = train.available(index)
        entry.update(
            weight=source.weight,
            max_tokens=source.max_tokens,
            blocks=blocks,
            planned_blocks=train.planned[index],
            epochs=round(train.planned[index] / blocks, 4) if blocks else 0.0,
        )
    n_eval = len(evaluation) if evaluation is not None else 0
    return {
        "block_length": cfg.max_length,
        "eos_token_id": manifest["eos_id"],
        "train": train_report,
        "eval": _split_report(cfg.eval, shards["eval"], cfg.max_length) if cfg.eval else None,
        "eval_from": "sources" if cfg.eval else ("held_out_train_blocks" if n_eval else "none"),
        "fingerprint": manifest["fingerprint"],
        "train_blocks": len(train),
        "eval_blocks": n_eval,
        "store": {
            "path": str(store),
            "fingerprint": manifest["fingerprint"],
            "code_version": manifest["code_version"],
            "tokenizer_fingerprint": manifest["tokenizer_fingerprint"],
            **manifest["totals"],
        },
    }


def _split_report(
    sources: Sequence[SourceConfig], shards: list[list[Shard]], block_length: int
) -> dict[str, Any]:
    per_source: list[dict[str, Any]] = []
    histogram = np.zeros(_MAX_POWER, dtype=np.int64)
    for source, own in zip(sources, shards, strict=True):
        documents = sum(s.info.documents for s in own)
        stream = sum(s.info.tokens for s in own)  # EOS included
        per_source.append(
            {
                "path": source.path,
                "files": len(own),
                "documents": documents,
                "empty_documents_skipped": sum(s.info.empty_documents_skipped for s in own),
                "tokens": stream - documents,
                "shards": len(own),
                "remainder_tokens_dropped": stream % block_length,
            }
        )
        for shard in own:
            counts = shard.info.length_histogram.get("counts", [])
            histogram[: len(counts)] += counts
    used = np.flatnonzero(histogram)
    last = int(used[-1]) if used.size else 0
    return {
        "sources": per_source,
        "documents": sum(s["documents"] for s in per_source),
        "empty_documents_skipped": sum(s["empty_documents_skipped"] for s in per_source),
        "tokens": sum(s["tokens"] for s in per_source),
        "eos_tokens": sum(s["documents"] for s in per_source),
        "blocks": sum((s["tokens"] + s["documents"]) // block_length for s in per_source),
        "remainder_tokens_dropped": sum(s["remainder_tokens_dropped"] for s in per_source),
        "length_histogram": {
            "edges": [2**i for i in range(last + 2)],
            "counts": histogram[: last + 1].tolist(),
        },
    }
