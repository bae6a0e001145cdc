"""Fine-tuning data: conversations -> token ids with loss masks -> cached ragged arrays -> rows.

Flow: read every source's rows (bad rows go through the bad-row policy), render each
conversation with the chat template into input ids and labels, drop what the length policy
drops (counted), split eval rows off by fraction when no eval source is given, and store
the result as flat int32 arrays with offsets (a ragged array) under a fingerprint. Eval
samples are never packed together with train samples: packing happens per split. The order
of the steps is `data.prep`'s; this module supplies the SFT kind's parts (`_SftKind`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import DataConfig, SourceConfig
from lmforge.data.bad_rows import BadRowPolicy
from lmforge.data.chat import adopt_template
from lmforge.data.formats import valid_examples
from lmforge.data.packing import best_fit_pack, packing_stats
from lmforge.data.prep import prepare, split_holdout
from lmforge.data.ragged import RaggedSamples
from lmforge.data.sft_tokenize import SampleTokenizer
from lmforge.data.sources import sources_fingerprint
from lmforge.data.stats import length_histogram
from lmforge.data.tokenizer import tokenizer_fingerprint

if TYPE_CHECKING:
    from lmforge.data.vision_tokens import ImageTokens

CODE_VERSION = "sft-v4"  # v4: duplicates keyed with images too; v3: samples carry their images; v2: truncated counts, bad_rows.jsonl kept
IGNORE_INDEX = -100


@dataclass
class PreparedSFT:
    """Tokenized SFT samples per split, memory-mapped from the cache, with the data report."""

    train: RaggedSamples
    eval: RaggedSamples | None
    fingerprint: str
    cache_path: Path
    from_cache: bool
    report: dict[str, Any] = field(default_factory=dict)


def sft_fingerprint(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    seed: int,
    image_tokens: ImageTokens | None = None,
) -> str:
    parts = {
        # How images become tokens: the processor's settings (size, splitting, tokens per image).
        "images": image_tokens.fingerprint() if image_tokens is not None else None,
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
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    cache_dir: Path,
    quarantine_path: Path,
    image_tokens: ImageTokens | None = None,
) -> PreparedSFT:
    """Read, validate, render and tokenize the SFT sources; cached under a fingerprint. Rows with
    images need `image_tokens` (a vision-language model's processor)."""
    kind = _SftKind(cfg, tokenizer, seed, quarantine_path, image_tokens)
    prepared = prepare(kind, cfg, seed=seed, cache_dir=cache_dir)
    train, evaluation = prepared.data
    return PreparedSFT(
        train, evaluation, prepared.fingerprint, prepared.cache_path, prepared.from_cache, prepared.report
    )


def _worker_count() -> int:
    """Tokenizer processes: one per core (at most 8); rendering chat templates is Python-bound."""
    return max(
        1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8)
    )


class _SftKind:
    """SFT conversations as a `DataKind` of `data.prep`: splits are ragged samples in memory."""

    unit: str = "sample"

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        seed: int,
        quarantine_path: Path,
        image_tokens: ImageTokens | None = None,
    ) -> None:
        self.cfg, self.tokenizer, self.seed = cfg, tokenizer, seed
        self.template = adopt_template(tokenizer, cfg.chat_template)
        self.bad_rows: BadRowPolicy | None = BadRowPolicy(
            cfg.on_bad_row, cfg.max_bad_fraction, quarantine_path
        )
        self.image_tokens = image_tokens
        self.samples = SampleTokenizer(cfg, tokenizer, self.template, image_tokens)
        self.meta: dict[str, Any] = {}
        self.timings: dict[str, float] = {}

    def fingerprint(self) -> str:
        return sft_fingerprint(self.cfg, self.tokenizer, self.template, self.seed, self.image_tokens)

    def cache_name(self, fingerprint: str) -> str:
        return f"sft-{fingerprint}"

    def load(self, path: Path, report: dict[str, Any]) -> tuple[RaggedSamples, RaggedSamples | None]:
        evaluation = RaggedSamples.load(path, "eval") if report["eval"]["samples"] else None
        return RaggedSamples.load(path, "train"), evaluation

    def read_split(self, sources: Sequence[SourceConfig], split: str, workdir: Path) -> RaggedSamples:
        assert self.bad_rows is not None
        examples = valid_examples(
            sources, self.bad_rows, memory_budget_mb=self.cfg.memory_budget_mb, seed=self.seed
        )
        return self.samples.all(examples, split, workers=_worker_count())

    def size(self, data: RaggedSamples) -> int:
        return len(data)

    def hold_out(
        self, train: RaggedSamples, eval_fraction: float, seed: int, workdir: Path
    ) -> tuple[RaggedSamples, RaggedSamples]:
        too_few = f"data.eval_fraction={eval_fraction}: holding out eval rows needs at least 2 samples"
        train_rows, eval_rows = split_holdout(len(train), eval_fraction, seed, too_few=too_few)
        return train.subset(train_rows), train.subset(eval_rows)

    def save(self, train: RaggedSamples, evaluation: RaggedSamples | None, workdir: Path) -> None:
        train.save(workdir, "train")
        if evaluation is not None:
            evaluation.save(workdir, "eval")

    def report(self, train: RaggedSamples, evaluation: RaggedSamples | None) -> dict[str, Any]:
        assert self.bad_rows is not None
        capacity = self.cfg.max_length
        return {
            "rows": self.bad_rows.counts(),
            "dropped": dict(self.samples.dropped),
            # Kept, but cut to data.max_length (over_length: truncate): their ends never train.
            "truncated": dict(self.samples.truncated),
            "train": _split_report(train, capacity, self.image_tokens),
            "eval": _split_report(evaluation, capacity, self.image_tokens)
            if evaluation is not None
            else {"samples": 0},
            **_duplicate_counts(train, evaluation),
            "chat_template": self.cfg.chat_template or "tokenizer",
            "train_on": self.cfg.train_on,
        }


def _split_report(
    samples: RaggedSamples, capacity: int, image_tokens: ImageTokens | None = None
) -> dict[str, Any]:
    lengths = samples.lengths()
    supervised = int((np.asarray(samples.labels) != IGNORE_INDEX).sum())
    bins = best_fit_pack(lengths, capacity)
    return {
        **(_image_counts(samples, image_tokens) if image_tokens is not None else {}),
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


def _image_counts(samples: RaggedSamples, image_tokens: ImageTokens) -> dict[str, int]:
    """Images, samples with images, and the positions image features fill (the model's image
    token), in a split: what the vision tower costs."""
    per_sample = [len(images) for images in samples.images or []]
    return {
        "images": sum(per_sample),
        "samples_with_images": sum(1 for count in per_sample if count),
        "image_tokens": int((np.asarray(samples.input_ids) == image_tokens.image_token_id).sum()),
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
    """A content key per sample: its token ids and, for an image sample, its image files (the same
    question about another picture is another sample; the same file under two paths is not seen)."""
    keys = []
    for i in range(len(samples)):
        sample = samples.sample(i)
        key = hashlib.blake2b(sample["input_ids"].tobytes(), digest_size=16)
        for image in sample.get("images") or ():
            key.update(b"\0" + str(image).encode())
        keys.append(key.digest())
    return keys


def _duplicate_counts(train: RaggedSamples, evaluation: RaggedSamples | None) -> dict[str, int]:
    """Exact duplicates within train, and eval samples that also occur in train (contamination)."""
    train_hashes = _hashes(train)
    seen = set(train_hashes)
    overlap = sum(h in seen for h in _hashes(evaluation)) if evaluation is not None else 0
    return {"exact_duplicates_in_train": len(train_hashes) - len(seen), "eval_samples_also_in_train": overlap}
