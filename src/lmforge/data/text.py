"""Pretraining data: documents -> token ids -> EOS-joined stream -> fixed-length blocks, cached.

The hot path never touches single tokens in Python: documents are tokenized in large
batches by the Rust backend; joining, EOS insertion and cutting into blocks are NumPy
operations. The token stream is appended straight to the cache's `.npy` file, whose
header is rewritten in place at the end (numpy reserves room for that), so memory holds
one batch of documents, and no pass copies the data again (except a hold-out split).
The cache lives in `<cache_dir>/<fingerprint>/` (train.npy, eval.npy, meta.json) and
appears by an atomic rename, so a crash never leaves a half-written cache. The order of the
steps is `data.prep`'s; this module supplies the text kind's parts (`_TextKind`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import DataConfig, SourceConfig
from lmforge.data.bad_rows import BadRowPolicy
from lmforge.data.block_files import move_rows, set_rows, write_header
from lmforge.data.encoding import BatchEncoder, encode_documents, join_with_eos
from lmforge.data.prep import prepare, split_holdout
from lmforge.data.shuffle import PretrainingBlocks
from lmforge.data.sources import SourceStats, iter_documents, sources_fingerprint
from lmforge.data.stats import LengthHistogram
from lmforge.data.tokenizer import batch_encoder, tokenizer_fingerprint
from lmforge.errors import UserInputError
from lmforge.verbosity import progress_bar

# Bump when the packing rules or the cache layout change: old caches then stop matching.
CODE_VERSION = "text-v1"
# Characters per tokenizer call: enough documents for the Rust backend to keep every core
# busy, while the batch's Encoding objects (~80 bytes per token) stay in the tens of MB.
_BATCH_CHARS = 2_000_000
_IN_FLIGHT = 2  # batches being encoded while one is written; memory grows with it


@dataclass
class PreparedText:
    """Packed pretraining data; the arrays are [N, max_length] int32, memory-mapped from the cache."""

    train_blocks: np.ndarray
    eval_blocks: np.ndarray | None
    fingerprint: str
    cache_path: Path
    from_cache: bool
    report: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step; empty when cached


class BlockDataset(PretrainingBlocks):
    """Causal-LM samples from an [N, L] block array: `input_ids` and `labels` (the same ids;
    the model shifts them). Blocks hold no padding, so no attention mask is needed."""

    def __init__(self, blocks: np.ndarray) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(np.asarray(self.blocks[index], dtype=np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


def data_fingerprint(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> str:
    """sha256 over everything that decides the prepared arrays: data, tokenizer, settings, code."""
    holdout = not cfg.eval and cfg.eval_fraction > 0
    parts = {
        "code": CODE_VERSION,
        "train": sources_fingerprint(cfg.train),
        "eval": sources_fingerprint(cfg.eval, "eval") if cfg.eval else None,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": cfg.max_length,
        # Fraction and seed only matter for a hold-out; leaving them out otherwise lets
        # runs with different seeds share one cache.
        "eval_fraction": cfg.eval_fraction if holdout else None,
        "seed": seed if holdout else None,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


@contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    timings[key] = timings.get(key, 0.0) + time.perf_counter() - started


def _document_batches(
    sources: Sequence[SourceConfig], stats: list[SourceStats], split: str
) -> Iterator[tuple[int, list[str]]]:
    """(source index, documents) batches of about _BATCH_CHARS characters, never spanning sources."""
    for index, source in enumerate(sources):
        batch: list[str] = []
        chars = 0
        for text in iter_documents(source, stats[index], key=f"data.{split}.{index}.path"):
            batch.append(text)
            chars += len(text)
            if chars >= _BATCH_CHARS:
                yield index, batch
                batch, chars = [], 0
        if batch:
            yield index, batch


@dataclass
class _Packer:
    """Tokenizes sources into an EOS-joined stream written as an .npy of blocks."""

    encode: BatchEncoder
    eos_id: int
    block_length: int
    timings: dict[str, float]

    def pack(self, sources: Sequence[SourceConfig], out: Path, split: str) -> dict[str, Any]:
        """Write `sources` as blocks to .npy file `out`; returns the split's report."""
        stats = [SourceStats(source.path) for source in sources]
        tokens = [0] * len(sources)
        batches = _document_batches(sources, stats, split)
        histogram = LengthHistogram()
        with (
            out.open("wb") as handle,
            progress_bar(desc=f"tokenize {split}", unit="tok", unit_scale=True) as bar,
        ):
            write_header(handle, 0, self.block_length)  # rows set when the stream ends
            for index, flat, lengths in self._encoded(batches):
                with _timed(self.timings, "pack_s"):
                    join_with_eos(flat, lengths, self.eos_id).tofile(handle)
                tokens[index] += int(flat.size)
                histogram.add(lengths)
                bar.update(flat.size + len(lengths))
                bar.set_postfix(docs=sum(s.documents for s in stats), refresh=False)
        documents = sum(s.documents for s in stats)
        stream = sum(tokens) + documents
        if stream < self.block_length:
            raise UserInputError(
                f"data.{split}: the data holds {stream} tokens (with EOS separators), fewer than one block "
                f"of data.max_length={self.block_length}. Fix: add data or lower data.max_length."
            )
        with _timed(self.timings, "pack_s"):
            set_rows(out, stream // self.block_length, self.block_length)
        return {
            "sources": [{**s.as_dict(), "tokens": n} for s, n in zip(stats, tokens, strict=True)],
            "documents": documents,
            "empty_documents_skipped": sum(s.empty_documents_skipped for s in stats),
            "tokens": sum(tokens),
            "eos_tokens": documents,
            "blocks": stream // self.block_length,
            "remainder_tokens_dropped": stream % self.block_length,
            "length_histogram": histogram.to_json(),  # document lengths in tokens
        }

    def _encoded(
        self, batches: Iterator[tuple[int, list[str]]]
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(source index, flat ids, lengths) per batch, in order. Two batches are encoded at once:
        the Rust backend releases the GIL, so one batch's encoding overlaps the Python work of
        reading the next and converting the last, and its cores stay busy at batch ends."""
        pending: deque[tuple[int, Future[tuple[np.ndarray, np.ndarray]]]] = deque()
        with ThreadPoolExecutor(max_workers=2) as pool:
            while True:
                with _timed(self.timings, "read_s"):
                    item = next(batches, None)
                if item is not None:
                    pending.append((item[0], pool.submit(encode_documents, self.encode, item[1])))
                if not pending:
                    return
                if item is None or len(pending) > _IN_FLIGHT:
                    index, future = pending.popleft()
                    with _timed(self.timings, "tokenize_s"):
                        flat, lengths = future.result()
                    yield index, flat, lengths


@dataclass
class _BlockFile:
    """One split as the text kind builds it: blocks already streamed into an .npy file."""

    path: Path
    rows: int
    report: dict[str, Any] | None  # what packing its sources gave; None for held-out eval blocks


class _TextKind:
    """Pretraining text as a `DataKind` of `data.prep`: splits are .npy block files."""

    unit: str = "block"
    bad_rows: BadRowPolicy | None = None  # documents are plain text: nothing to judge row by row

    def __init__(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
        self.cfg, self.tokenizer, self.seed = cfg, tokenizer, seed
        self.meta: dict[str, Any] = {"code_version": CODE_VERSION}
        self.timings: dict[str, float] = {"read_s": 0.0, "tokenize_s": 0.0, "pack_s": 0.0}
        self.packer = _Packer(batch_encoder(tokenizer), eos_id(tokenizer), cfg.max_length, self.timings)

    def fingerprint(self) -> str:
        return data_fingerprint(self.cfg, self.tokenizer, self.seed)

    def cache_name(self, fingerprint: str) -> str:
        return fingerprint

    def load(self, path: Path, report: dict[str, Any]) -> tuple[np.ndarray, np.ndarray | None] | None:
        train = np.load(path / "train.npy", mmap_mode="r", allow_pickle=False)
        has_eval = report["eval_blocks"] > 0
        evaluation = np.load(path / "eval.npy", mmap_mode="r", allow_pickle=False) if has_eval else None
        return (train, evaluation) if train.shape[0] == report["train_blocks"] else None

    def read_split(self, sources: Sequence[SourceConfig], split: str, workdir: Path) -> _BlockFile:
        report = self.packer.pack(sources, workdir / f"{split}.npy", split)
        return _BlockFile(workdir / f"{split}.npy", report["blocks"], report)

    def size(self, data: _BlockFile) -> int:
        return data.rows

    def hold_out(
        self, train: _BlockFile, eval_fraction: float, seed: int, workdir: Path
    ) -> tuple[_BlockFile, _BlockFile]:
        train_rows, eval_rows = split_holdout(
            train.rows,
            eval_fraction,
            seed,
            too_few=f"data.eval_fraction={eval_fraction}: the training data makes only {train.rows} "
            "block(s), and holding out eval blocks needs at least 2. Fix: add training data, lower "
            "data.max_length, set data.eval sources, or set data.eval_fraction: 0.",
        )
        with _timed(self.timings, "pack_s"):
            move_rows(train.path, workdir / "eval.npy", train_rows, eval_rows)
        return (
            _BlockFile(train.path, len(train_rows), train.report),
            _BlockFile(workdir / "eval.npy", len(eval_rows), None),
        )

    def save(self, train: _BlockFile, evaluation: _BlockFile | None, workdir: Path) -> None:
        pass  # the blocks were streamed into workdir as they were packed

    def report(self, train: _BlockFile, evaluation: _BlockFile | None) -> dict[str, Any]:
        n_eval = evaluation.rows if evaluation else 0
        return {
            "block_length": self.cfg.max_length,
            "eos_token_id": self.packer.eos_id,
            "train": train.report,
            "eval": evaluation.report if evaluation else None,
            "eval_from": "sources" if self.cfg.eval else ("held_out_train_blocks" if n_eval else "none"),
            "train_blocks": train.rows,
            "eval_blocks": n_eval,
        }


def eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise UserInputError(
            f"tokenizer {tokenizer.name_or_path!r} has no eos_token, which pretraining data needs to "
            "separate documents. Fix: use a tokenizer with an eos_token, or set tokenizer.train."
        )
    return int(tokenizer.eos_token_id)


def prepare_pretraining_data(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, *, seed: int, cache_dir: Path
) -> PreparedText:
    """Read, tokenize and pack `cfg.train` (and eval) into blocks of `cfg.max_length` tokens.

    Every document is followed by the EOS token; the stream is cut into blocks and the final
    partial block is dropped (counted in the report). Eval blocks come from `cfg.eval`, else
    from a seeded hold-out of `cfg.eval_fraction` of the training blocks. The result is cached
    under `cache_dir/<fingerprint>/` and reused while data, tokenizer and settings are unchanged.
    """
    prepared = prepare(_TextKind(cfg, tokenizer, seed), cfg, seed=seed, cache_dir=cache_dir)
    train, evaluation = prepared.data
    return PreparedText(
        train,
        evaluation,
        prepared.fingerprint,
        prepared.cache_path,
        prepared.from_cache,
        prepared.report,
        prepared.timings,
    )
