"""Length statistics for data reports."""

from __future__ import annotations

from typing import Any

import numpy as np

_MAX_POWER = 40  # 2**40 tokens: no sample is longer


class LengthHistogram:
    """Token lengths in power-of-two bins [1, 2), [2, 4), [4, 8), ...: fixed edges, so it can be
    filled batch by batch while data streams through."""

    def __init__(self) -> None:
        self.counts = np.zeros(_MAX_POWER + 1, dtype=np.int64)

    def add(self, lengths: np.ndarray) -> None:
        lengths = np.asarray(lengths)
        if lengths.size:
            bins = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
            np.add.at(self.counts, np.minimum(bins, _MAX_POWER), 1)

    def to_json(self) -> dict[str, Any]:
        """{"edges": [1, 2, 4, ...], "counts": [...]} up to the longest length seen."""
        used = np.flatnonzero(self.counts)
        last = int(used[-1]) if used.size else 0
        return {"edges": [2**i for i in range(last + 2)], "counts": self.counts[: last + 1].tolist()}


def length_histogram(lengths: np.ndarray) -> dict[str, Any]:
    histogram = LengthHistogram()
    histogram.add(lengths)
    return histogram.to_json()
