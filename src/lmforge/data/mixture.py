"""What `weight` and `max_tokens` mean for pretraining sources, for streams and the token store alike.

A source of weight w contributes w times its own size to the training mix: w=1 all of it once,
w=2.5 two and a half passes (its epochs are reported), w=0.5 half of it. `max_tokens` caps
that contribution. So with every weight at 1 the mix is the data as it is, in its natural
proportions, and a weight says how much more or less of one source than that.

The token store knows each source's size in blocks, so its mix is exact (`planned_blocks`,
`block_of_source`); the training sampler shuffles it, seeded from `run.seed`. A stream does
not know its sizes in tokens, so it estimates each source's share from its size in bytes and
interleaves block by block, each next block from the source furthest behind its share
(`MixtureDealer`), a source that ends starting over (its next epoch): the same proportions,
dealt in a fixed order that needs no random draw, on every rank and worker alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def planned_blocks(
    block_counts: Sequence[int], weights: Sequence[float], budgets: Sequence[int | None]
) -> list[int]:
    """Blocks each source contributes to the mix: round(weight x its blocks), at most its budget
    (`max_tokens` in blocks) and at least 1 while it has a block, so no source vanishes by rounding."""
    planned = []
    for count, weight, budget in zip(block_counts, weights, budgets, strict=True):
        blocks = max(1, round(weight * count)) if count else 0
        planned.append(blocks if budget is None else min(blocks, budget))
    return planned


def block_of_source(k: int, count: int, planned: int, seed: int) -> int:
    """Which of a source's `count` blocks is its k-th in the mix. A source taken whole (or whole
    several times) is read in order, pass after pass; a final partial pass takes a seeded
    spread of blocks (an affine permutation of 0..count-1), not the first ones, so half a source
    is not only its first half."""
    whole_passes = planned // count
    if k < whole_passes * count:
        return k % count
    step, offset = _affine_permutation(count, seed)
    return (step * (k % count) + offset) % count


def _affine_permutation(count: int, seed: int) -> tuple[int, int]:
    """(a, b) with gcd(a, count) = 1, so i -> (a*i + b) mod count is a permutation of 0..count-1."""
    rng = np.random.default_rng(seed)
    step = int(rng.integers(1, max(count, 2)))
    while math.gcd(step, count) != 1:
        step += 1
    return step, int(rng.integers(0, count))


class MixtureDealer:
    """The source of each next block of a stream: the one furthest behind its share of the blocks
    dealt so far, among those not out of budget (ties go to the lower index). Its state (blocks
    dealt per source) saves and loads with the stream's, so a resumed stream deals the same order."""

    def __init__(self, shares: Sequence[float], budgets: Sequence[int | None]) -> None:
        total = float(sum(shares))
        if total <= 0:
            raise ValueError("a mixture needs at least one source with a positive share")
        self.shares = [share / total for share in shares]
        self.budgets = list(budgets)
        self.dealt = [0] * len(shares)

    def next_source(self) -> int | None:
        """The source of the next block, or None when every source has spent its budget."""
        after = sum(self.dealt) + 1
        best, best_deficit = None, -math.inf
        for index, share in enumerate(self.shares):
            budget = self.budgets[index]
            if share <= 0 or (budget is not None and self.dealt[index] >= budget):
                continue
            deficit = share * after - self.dealt[index]
            if deficit > best_deficit:
                best, best_deficit = index, deficit
        if best is not None:
            self.dealt[best] += 1
        return best

    def state_dict(self) -> dict[str, Any]:
        return {"dealt": list(self.dealt)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        dealt = [int(n) for n in state["dealt"]]
        if len(dealt) != len(self.shares):
            raise ValueError(f"saved mixture has {len(dealt)} sources, this config {len(self.shares)}")
        self.dealt = dealt


def stream_shares(weights: Sequence[float], sizes_in_bytes: Sequence[int]) -> list[float]:
    """A stream's target share of each source: weight x size, sizes in bytes (known before reading)."""
    return [weight * max(size, 1) for weight, size in zip(weights, sizes_in_bytes, strict=True)]
