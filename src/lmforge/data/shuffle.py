"""The order in which a pretraining run visits its blocks: a seeded permutation computed on the fly.

HF's RandomSampler draws `torch.randperm(n).tolist()` at each epoch: a list of n Python ints, about
46 bytes per block, so a run's memory grew with its corpus (318 MB more at 10 GB of text than at
1 GB; bench/RESULTS.md). Here a keyed Feistel network permutes [0, 2^k) and cycle-walking maps it
onto [0, n): a bijection of the block indices computed per position from (seed, epoch) alone. It
holds a few integers whatever n is, every rank computes the same order without communicating, and
a resume replays positions without materialising them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

ROUNDS = 6  # Feistel rounds: 4 make a pseudo-random permutation of a good round function; 2 spare
CHUNK = 8192  # positions permuted per numpy call while iterating


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every bit of each uint64 element avalanches into every output bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class BlockPermutation:
    """A permutation of range(n) keyed by (seed, epoch); `at(positions)` gives the block visited at
    each position, `__iter__` every block once in that order."""

    def __init__(self, n: int, seed: int, epoch: int = 0) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs at least one index, got n={n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + bits % 2) // 2  # the network permutes [0, 4^half) >= n: at most 4n
        self.mask = np.uint64((1 << self.half) - 1)
        # numpy's own seeding: independent round keys from the two integers.
        self.keys = np.random.SeedSequence([seed, epoch]).generate_state(ROUNDS, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = x >> shift, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.mask)
        return (left << shift) | right

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The block index at each position (uint64 array of positions in [0, n))."""
        out = self._encrypt(positions.astype(np.uint64))
        # Cycle-walking: a value outside [0, n) is encrypted again until it lands inside. The
        # network is a bijection of [0, 4^half), so this is a bijection of [0, n) and, since the
        # domain is under 4n, takes fewer than 4 passes on average.
        outside = out >= self.n
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out

    def __iter__(self) -> Iterator[int]:
        for start in range(0, self.n, CHUNK):
            yield from self.at(np.arange(start, min(start + CHUNK, self.n), dtype=np.uint64)).tolist()


class PretrainingBlocks(torch.utils.data.Dataset):
    """A map-style dataset of fixed-length pretraining blocks (the cache's, the token store's): the
    Trainer adapter visits it in `ShuffledBlocks`' order."""

    def __len__(self) -> int:
        raise NotImplementedError


class ShuffledBlocks(torch.utils.data.Sampler[int]):
    """The training sampler of pretraining blocks (the cache, the token store): a new permutation
    each epoch (`set_epoch`, called by HF Trainer through accelerate), in O(1) memory."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(BlockPermutation(self.n, self.seed, self.epoch))
