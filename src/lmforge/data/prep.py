"""The one order every kind of training data is prepared in, and the cache it ends in.

Pretraining text (`data.text`), SFT conversations (`data.sft`) and preference / KTO rows
(`data.preference`) each supply a `DataKind`: their fingerprint, how one split is read,
validated and tokenized, how rows are held out, saved, reported and loaded. This module
owns when each part runs:

    fingerprint -> reuse the cache when it is there and loads -> read, validate and tokenize
    the train (and eval) sources -> the bad-row verdict -> hold out eval rows -> save ->
    the data report -> meta.json and the atomic rename (`data.cache`) -> load what was written

Reading, validating and tokenizing are one streamed pass per split in every kind (rows
flow through all three), so they are one part here. What a split is stays the kind's
choice: blocks already written to an `.npy` file for text, rows in memory for the others.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from lmforge.config.schema import DataConfig, SourceConfig
from lmforge.data.bad_rows import BadRowPolicy
from lmforge.data.cache import build_atomically, read_meta
from lmforge.errors import UserInputError

logger = logging.getLogger(__name__)
QUARANTINE_NAME = "bad_rows.jsonl"  # the quarantined rows, kept with the cache they were dropped from

Split = TypeVar("Split")  # one split as the kind builds it: a file on disk, or rows in memory
Loaded = TypeVar("Loaded")  # the prepared data as the kind loads it from the cache
Loaded_co = TypeVar("Loaded_co", covariant=True)


class DataKind(Protocol[Split, Loaded_co]):
    """The parts of data preparation that differ between kinds of data; `prepare` runs them."""

    unit: str  # what one item of a split is, in messages: "block", "sample", "row"
    meta: dict[str, Any]  # extra meta.json entries (like a code version)
    timings: dict[str, float]  # seconds per step the kind measures itself, filled while building
    bad_rows: BadRowPolicy | None  # the policy `read_split` filters rows through, if any

    def fingerprint(self) -> str:
        """sha256 over everything that decides the prepared data."""
        ...

    def cache_name(self, fingerprint: str) -> str:
        """The cache directory's name under the cache dir."""
        ...

    def load(self, path: Path, report: dict[str, Any]) -> Loaded_co | None:
        """The data cached at `path` (its report given), or None when it is not a usable cache."""
        ...

    def read_split(self, sources: Sequence[SourceConfig], split: str, workdir: Path) -> Split:
        """Read, validate and tokenize `sources` ("train" or "eval"), streamed."""
        ...

    def size(self, data: Split) -> int:
        """Items in a split."""
        ...

    def hold_out(self, train: Split, eval_fraction: float, seed: int, workdir: Path) -> tuple[Split, Split]:
        """(train, eval): a seeded share of `train` moved to eval (rows from `split_holdout`)."""
        ...

    def save(self, train: Split, evaluation: Split | None, workdir: Path) -> None:
        """Write the splits into `workdir` (nothing left to do for data streamed there)."""
        ...

    def report(self, train: Split, evaluation: Split | None) -> dict[str, Any]:
        """The data report (what data_report.json and meta.json hold, less the fingerprint)."""
        ...


@dataclass
class Prepared(Generic[Loaded]):
    """What `prepare` gives back: the loaded data and how it came about."""

    data: Loaded
    fingerprint: str
    cache_path: Path
    from_cache: bool
    report: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step; empty when cached


def prepare(
    kind: DataKind[Split, Loaded], cfg: DataConfig, *, seed: int, cache_dir: Path
) -> Prepared[Loaded]:
    """The data of `kind` for `cfg`: from the cache under `cache_dir` when it holds a usable
    copy, else built in the order of the module docstring and cached atomically."""
    started = time.perf_counter()
    fingerprint = kind.fingerprint()
    final = cache_dir / kind.cache_name(fingerprint)
    if final.exists():
        cached = _load(kind, final, fingerprint, from_cache=True)
        if cached is not None:
            logger.info("prepared data: reusing cache %s", final)
            _restore_quarantine(kind.bad_rows, final)
            return cached
        logger.warning("prepared data: %s is not a complete cache; rebuilding it", final)
        shutil.rmtree(final, ignore_errors=True)
    build_atomically(final, fingerprint, lambda workdir: _build(kind, cfg, seed, workdir), **kind.meta)
    built = _load(kind, final, fingerprint, from_cache=False)
    if built is None:
        raise RuntimeError(f"prepared data cache {final} is unreadable right after writing it")
    built.timings = {**kind.timings, "total_s": time.perf_counter() - started}
    return built


def _build(kind: DataKind[Split, Any], cfg: DataConfig, seed: int, workdir: Path) -> dict[str, Any]:
    """Write the splits into `workdir`; returns the data report."""
    train = kind.read_split(cfg.train, "train", workdir)
    evaluation = kind.read_split(cfg.eval, "eval", workdir) if cfg.eval else None
    if kind.bad_rows is not None:
        kind.bad_rows.finish()  # raises when too many rows were bad, across both splits
        _keep_quarantine(kind.bad_rows, workdir)
    if evaluation is None and cfg.eval_fraction > 0:
        train, evaluation = kind.hold_out(train, cfg.eval_fraction, seed, workdir)
    if kind.size(train) == 0:
        raise UserInputError(
            f"data.train: no training {kind.unit} is left after the length policy; see the data report"
        )
    kind.save(train, evaluation, workdir)
    return kind.report(train, evaluation)


def _load(
    kind: DataKind[Any, Loaded], final: Path, fingerprint: str, *, from_cache: bool
) -> Prepared[Loaded] | None:
    """The cache at `final`, or None when it is not a complete cache of this fingerprint."""
    try:
        meta = read_meta(final)
        if meta.get("fingerprint") != fingerprint:
            return None
        data = kind.load(final, meta["report"])
    except (OSError, ValueError, KeyError):
        return None
    if data is None:
        return None
    return Prepared(data, fingerprint, final, from_cache, meta["report"])


def _keep_quarantine(policy: BadRowPolicy, workdir: Path) -> None:
    """The quarantined rows go into the cache too: a later run that reuses it still gets them."""
    if policy.quarantine_path is not None and policy.quarantine_path.is_file():
        shutil.copyfile(policy.quarantine_path, workdir / QUARANTINE_NAME)


def _restore_quarantine(policy: BadRowPolicy | None, cache: Path) -> None:
    """A run reusing the cache gets the rows that were dropped building it, where its report
    says they are (the counts in the report come from the cache)."""
    kept = cache / QUARANTINE_NAME
    if policy is not None and policy.quarantine_path is not None and kept.is_file():
        policy.quarantine_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(kept, policy.quarantine_path)


def split_holdout(
    n_items: int, eval_fraction: float, seed: int, *, too_few: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted indices (train, eval): round(eval_fraction * n_items) eval items, at least 1 and
    at most n_items - 1, chosen by a permutation seeded with `seed`. Fewer than 2 items raise
    UserInputError with `too_few` (the kind's words for it)."""
    if n_items < 2:
        raise UserInputError(
            too_few or f"data.eval_fraction={eval_fraction}: holding out eval rows needs at least 2 items"
        )
    n_eval = min(max(1, round(eval_fraction * n_items)), n_items - 1)
    order = np.random.default_rng(seed).permutation(n_items)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])
