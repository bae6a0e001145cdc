"""Fine-tuning data: conversations -> token ids with loss masks -> cached ragged arrays -> rows.

Flow: read every source's rows (bad rows go through the bad-row policy), render each
conversation with the chat template into input ids and labels, drop what the length policy
drops (counted), split eval rows off by fraction when no eval source is given, and store
the result as flat int32 arrays with offsets (a ragged array) under a fingerprint. Eval
samples are never packed together with train samples: packing happens per split.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import multiprocessing as mp
import os
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import DataConfig
from lmforge.data.bad_rows import BadRowPolicy
from lmforge.data.cache import build_atomically, is_built, read_meta
from lmforge.data.chat import (
    Dropped,
    TokenizedSample,
    adopt_template,
    tokenize_conversations,
)
from lmforge.data.examples import Conversation
from lmforge.data.formats import valid_examples
from lmforge.data.packing import best_fit_pack, packing_stats
from lmforge.data.sources import sources_fingerprint
from lmforge.data.stats import length_histogram
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.errors import UserInputError

logger = logging.getLogger(__name__)

CODE_VERSION = "sft-v1"
IGNORE_INDEX = -100


@dataclass
class RaggedSamples:
    """Variable-length samples stored flat: sample i is ids[offsets[i]:offsets[i+1]]."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, index: int) -> dict[str, np.ndarray]:
        start, end = self.offsets[index], self.offsets[index + 1]
        return {"input_ids": self.input_ids[start:end], "labels": self.labels[start:end]}

    def save(self, directory: Path, split: str) -> None:
        for name in ("input_ids", "labels", "offsets"):
            np.save(directory / f"{split}.{name}.npy", getattr(self, name), allow_pickle=False)

    @classmethod
    def load(cls, directory: Path, split: str) -> RaggedSamples:
        arrays = {
            name: np.load(directory / f"{split}.{name}.npy", mmap_mode="r", allow_pickle=False)
            for name in ("input_ids", "labels", "offsets")
        }
        return cls(**arrays)


@dataclass
class PreparedSFT:
    train: RaggedSamples
    eval: RaggedSamples | None
    fingerprint: str
    cache_path: Path
    from_cache: bool
    report: dict[str, Any] = field(default_factory=dict)


class SampleDataset(torch.utils.data.Dataset):
    """One tokenized sample per item (padded or padding-free batches)."""

    def __init__(self, samples: RaggedSamples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        sample = self.samples.sample(index)
        return {"input_ids": sample["input_ids"].tolist(), "labels": sample["labels"].tolist()}


class PackedDataset(torch.utils.data.Dataset):
    """One packed row per item: the samples of one best-fit bin, kept as separate pieces."""

    def __init__(self, samples: RaggedSamples, capacity: int) -> None:
        self.samples = samples
        self.bins = best_fit_pack(samples.lengths(), capacity)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, list[list[int]]]:
        pieces = [self.samples.sample(i) for i in self.bins[index]]
        return {
            "input_ids": [p["input_ids"].tolist() for p in pieces],
            "labels": [p["labels"].tolist() for p in pieces],
        }


def sft_fingerprint(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, template: str, seed: int) -> str:
    parts = {
        "code": CODE_VERSION,
        "train": sources_fingerprint(cfg.train),
        "eval": sources_fingerprint(cfg.eval, "eval") if cfg.eval else None,
        "sources": [s.model_dump(mode="json") for s in [*cfg.train, *cfg.eval]],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "template": template,
        "settings": cfg.model_dump(
            mode="json",
            include={
                "max_length",
                "train_on",
                "over_length",
                "on_bad_row",
                "max_bad_fraction",
                "eval_fraction",
            },
        ),
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def prepare_sft_data(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, *, seed: int, cache_dir: Path, quarantine_path: Path
) -> PreparedSFT:
    """Read, validate, render and tokenize the SFT sources; cached under a fingerprint."""
    template = adopt_template(tokenizer, cfg.chat_template)
    fingerprint = sft_fingerprint(cfg, tokenizer, template, seed)
    final = cache_dir / f"sft-{fingerprint}"
    if is_built(final):
        logger.info("prepared data: reusing cache %s", final)
        return _load(final, fingerprint)
    build_atomically(
        final, fingerprint, lambda workdir: _build(cfg, tokenizer, template, seed, workdir, quarantine_path)
    )
    return _load(final, fingerprint, from_cache=False)


def _load(path: Path, fingerprint: str, from_cache: bool = True) -> PreparedSFT:
    report = read_meta(path)["report"]
    evaluation = RaggedSamples.load(path, "eval") if report["eval"]["samples"] else None
    return PreparedSFT(RaggedSamples.load(path, "train"), evaluation, fingerprint, path, from_cache, report)


def _build(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    seed: int,
    workdir: Path,
    quarantine_path: Path,
) -> dict[str, Any]:
    policy = BadRowPolicy(cfg.on_bad_row, cfg.max_bad_fraction, quarantine_path)
    tokenize = _Tokenizer(cfg, tokenizer, template)
    train = tokenize.all(
        valid_examples(cfg.train, policy, memory_budget_mb=cfg.memory_budget_mb, seed=seed), "train"
    )
    evaluation = (
        tokenize.all(
            valid_examples(cfg.eval, policy, memory_budget_mb=cfg.memory_budget_mb, seed=seed), "eval"
        )
        if cfg.eval
        else None
    )
    policy.finish()
    if evaluation is None and cfg.eval_fraction > 0:
        train, evaluation = _hold_out(train, cfg.eval_fraction, seed)
    if len(train) == 0:
        raise UserInputError(
            "data.train: no training sample is left after the length policy; see the data report"
        )
    train.save(workdir, "train")
    if evaluation is not None:
        evaluation.save(workdir, "eval")
    return {
        "rows": policy.counts(),
        "dropped": dict(tokenize.dropped),
        "train": _split_report(train, cfg.max_length),
        "eval": _split_report(evaluation, cfg.max_length) if evaluation is not None else {"samples": 0},
        **_duplicate_counts(train, evaluation),
        "chat_template": cfg.chat_template or "tokenizer",
        "train_on": cfg.train_on,
    }


class _Tokenizer:
    def __init__(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, template: str) -> None:
        self.cfg, self.tokenizer, self.template = cfg, tokenizer, template
        self.dropped: Counter[str] = Counter()

    def all(self, examples: Iterable[Any], split: str) -> RaggedSamples:
        ids: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        settings = {
            "template": self.template,
            "train_on": self.cfg.train_on,
            "max_length": self.cfg.max_length,
            "over_length": self.cfg.over_length,
        }
        chunks = (list(map(_conversation, chunk)) for chunk in _chunks(examples, _TOKENIZE_CHUNK))
        with tqdm(desc=f"tokenize {split}", unit="row") as bar:
            for chunk in _tokenized_chunks(chunks, self.tokenizer, settings, _worker_count()):
                for reason in chunk.dropped:
                    self.dropped[f"{split}: {reason}"] += 1
                ids.append(chunk.input_ids)
                labels.append(chunk.labels)
                lengths.append(chunk.lengths)
                bar.update(chunk.rows)
        return _ragged_from_chunks(ids, labels, lengths)


@dataclass
class _TokenizedChunk:
    """One chunk's samples as flat arrays (what a worker sends back: three arrays pickle far
    cheaper than a TokenizedSample per row) and the reasons of the rows it dropped, in order."""

    input_ids: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    dropped: list[str]
    rows: int


def _pack(results: list[TokenizedSample | Dropped]) -> _TokenizedChunk:
    kept = [r for r in results if isinstance(r, TokenizedSample)]
    empty = np.zeros(0, dtype=np.int32)
    return _TokenizedChunk(
        np.concatenate([r.input_ids for r in kept]) if kept else empty,
        np.concatenate([r.labels for r in kept]) if kept else empty,
        np.fromiter((len(r.input_ids) for r in kept), dtype=np.int64, count=len(kept)),
        [r.reason for r in results if isinstance(r, Dropped)],
        len(results),
    )


def _worker_count() -> int:
    """Tokenizer processes: one per core (at most 8); rendering chat templates is Python-bound."""
    return max(
        1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8)
    )


def _tokenized_chunks(
    chunks: Iterator[list[Conversation]],
    tokenizer: PreTrainedTokenizerBase,
    settings: dict[str, Any],
    workers: int,
) -> Iterator[_TokenizedChunk]:
    """Tokenize chunks in order; with several workers, in a process pool with a bounded number
    of chunks in flight, so memory stays flat however large the input is."""
    first = next(chunks, None)
    if first is None:
        return
    second = next(chunks, None)
    if workers == 1 or second is None or "fork" not in mp.get_all_start_methods():
        # One chunk (or one core): a pool's start-up would cost more than it saves.
        for chunk in itertools.chain([first], [second] if second else [], chunks):
            yield _pack(tokenize_conversations(chunk, tokenizer, **settings))
        return
    # fork: workers inherit the tokenizer without pickling it or re-importing transformers.
    with mp.get_context("fork").Pool(
        workers, initializer=_init_worker, initargs=(tokenizer, settings)
    ) as pool:
        pending: deque[Any] = deque()
        for chunk in itertools.chain([first, second], chunks):
            pending.append(pool.apply_async(_tokenize_in_worker, (chunk,)))
            if len(pending) > 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: PreTrainedTokenizerBase, settings: dict[str, Any]) -> None:
    _WORKER["tokenizer"], _WORKER["settings"] = tokenizer, settings


def _tokenize_in_worker(chunk: list[Conversation]) -> _TokenizedChunk:
    return _pack(tokenize_conversations(chunk, _WORKER["tokenizer"], **_WORKER["settings"]))


# Conversations per batched tokenizer call: enough to keep the Rust backend's threads busy,
# few enough that one chunk's Python objects stay small.
_TOKENIZE_CHUNK = 512


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _conversation(example: Any) -> Conversation:
    if not isinstance(example, Conversation):
        raise UserInputError(
            f"{example.origin.file}:{example.origin.line}: a {type(example).__name__} row in an SFT "
            "dataset; preference and KTO data need train.stage dpo / kto"
        )
    return example


def _ragged(ids: list[np.ndarray], labels: list[np.ndarray]) -> RaggedSamples:
    lengths = np.fromiter((len(a) for a in ids), dtype=np.int64, count=len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    empty = np.zeros(0, dtype=np.int32)
    return RaggedSamples(
        np.concatenate(ids) if ids else empty, np.concatenate(labels) if labels else empty, offsets
    )


def _ragged_from_chunks(
    ids: list[np.ndarray], labels: list[np.ndarray], lengths: list[np.ndarray]
) -> RaggedSamples:
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    offsets = np.zeros(len(all_lengths) + 1, dtype=np.int64)
    np.cumsum(all_lengths, out=offsets[1:])
    empty = np.zeros(0, dtype=np.int32)
    return RaggedSamples(
        np.concatenate(ids) if ids else empty, np.concatenate(labels) if labels else empty, offsets
    )


def _subset(samples: RaggedSamples, rows: np.ndarray) -> RaggedSamples:
    pieces = [samples.sample(int(i)) for i in rows]
    return _ragged([p["input_ids"] for p in pieces], [p["labels"] for p in pieces])


def _hold_out(train: RaggedSamples, fraction: float, seed: int) -> tuple[RaggedSamples, RaggedSamples]:
    if len(train) < 2:
        raise UserInputError(f"data.eval_fraction={fraction}: holding out eval rows needs at least 2 samples")
    n_eval = min(max(1, round(fraction * len(train))), len(train) - 1)
    order = np.random.default_rng(seed).permutation(len(train))
    return _subset(train, np.sort(order[n_eval:])), _subset(train, np.sort(order[:n_eval]))


def _split_report(samples: RaggedSamples, capacity: int) -> dict[str, Any]:
    lengths = samples.lengths()
    supervised = int((np.asarray(samples.labels) != IGNORE_INDEX).sum())
    bins = best_fit_pack(lengths, capacity)
    return {
        "samples": len(samples),
        "tokens": int(lengths.sum()),
        "supervised_tokens": supervised,
        "length_p50": float(np.percentile(lengths, 50)) if len(lengths) else 0,
        "length_p90": float(np.percentile(lengths, 90)) if len(lengths) else 0,
        "length_max": int(lengths.max()) if len(lengths) else 0,
        "length_histogram": length_histogram(lengths),
        "packing": packing_stats(bins, lengths, capacity),
        "padded_to_longest_pad_fraction": _pad_fraction_padded(lengths),
    }


def _pad_fraction_padded(lengths: np.ndarray, batch: int = 8) -> float:
    """Pad share if batches of `batch` random samples were padded to their longest (for comparison)."""
    if len(lengths) == 0:
        return 0.0
    shuffled = np.random.default_rng(0).permutation(lengths)
    usable = len(shuffled) // batch * batch or len(shuffled)
    groups = shuffled[:usable].reshape(-1, min(batch, usable))
    padded = groups.max(axis=1).sum() * groups.shape[1]
    return float(1 - groups.sum() / padded)


def _hashes(samples: RaggedSamples) -> list[bytes]:
    return [
        hashlib.blake2b(samples.sample(i)["input_ids"].tobytes(), digest_size=16).digest()
        for i in range(len(samples))
    ]


def _duplicate_counts(train: RaggedSamples, evaluation: RaggedSamples | None) -> dict[str, int]:
    """Exact duplicates within train, and eval samples that also occur in train (contamination)."""
    train_hashes = _hashes(train)
    seen = set(train_hashes)
    overlap = sum(h in seen for h in _hashes(evaluation)) if evaluation is not None else 0
    return {"exact_duplicates_in_train": len(train_hashes) - len(seen), "eval_samples_also_in_train": overlap}
