"""The order of pretraining blocks: a seeded permutation computed per position (data/shuffle.py),
every block once per epoch, in memory that does not grow with the corpus, and what HF Trainer's
dataloader really yields through the adapter."""

from __future__ import annotations

import itertools
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from lmforge.data.shuffle import BlockPermutation
from lmforge.data.text import BlockDataset
from lmforge.train.hf_trainer import HFTrainerAdapter


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 16, 17, 1000, 65537])
def test_every_block_once_per_epoch(n: int) -> None:
    for seed, epoch in [(0, 0), (7, 3)]:
        order = list(BlockPermutation(n, seed, epoch))
        assert sorted(order) == list(range(n))
        # Random access agrees with iteration (what a resume or another rank computes).
        positions = np.arange(n, dtype=np.uint64)
        assert BlockPermutation(n, seed, epoch).at(positions).tolist() == order


def test_the_order_is_keyed_by_seed_and_epoch() -> None:
    order = list(BlockPermutation(1000, seed=1, epoch=0))
    assert list(BlockPermutation(1000, seed=1, epoch=0)) == order  # reproducible
    assert list(BlockPermutation(1000, seed=1, epoch=1)) != order  # a new order each epoch
    assert list(BlockPermutation(1000, seed=2, epoch=0)) != order
    assert order != sorted(order)
    # Shuffled, not shifted: neighbours in the order are not neighbours in the corpus.
    steps = np.abs(np.diff(order))
    assert np.mean(steps <= 2) < 0.05, np.mean(steps <= 2)
    # Which block comes first is spread evenly over the seeds (2,000 seeds x 20 blocks: 100 each).
    firsts = np.bincount([next(iter(BlockPermutation(20, seed))) for seed in range(2000)], minlength=20)
    assert firsts.min() > 55 and firsts.max() < 150, firsts


def test_memory_does_not_grow_with_the_corpus() -> None:
    """HF's RandomSampler holds randperm(n).tolist(): ~36 bytes a block. The permutation holds a
    chunk: walking 3 million positions of a 300-million-block corpus stays under 2 MB."""
    tracemalloc.start()
    try:
        walked = itertools.islice(BlockPermutation(300_000_000, seed=0), 3_000_000)
        assert all(0 <= index < 300_000_000 for index in walked)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20, f"{peak / 2**20:.1f} MB"


def test_the_trainer_visits_pretraining_blocks_in_the_permutation(tmp_path: Path) -> None:
    """Through the adapter and accelerate: the training dataloader yields each block once per epoch
    in the permutation of (run seed, epoch), and a new order after set_epoch."""
    blocks = np.arange(40 * 4, dtype=np.int32).reshape(40, 4)  # block i starts with token 4i
    config = LlamaConfig(
        vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    trainer = HFTrainerAdapter(
        model=LlamaForCausalLM(config),
        args=TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=8, use_cpu=True, seed=11, report_to=[]
        ),
        train_dataset=BlockDataset(blocks),
    )
    loader = trainer.get_train_dataloader()

    def visited() -> list[int]:
        return [int(first) // 4 for batch in loader for first in batch["input_ids"][:, 0]]

    assert visited() == list(BlockPermutation(40, seed=11, epoch=0))
    loader.set_epoch(1)
    second = visited()
    assert second == list(BlockPermutation(40, seed=11, epoch=1))
    assert sorted(second) == list(range(40))
    assert torch.equal(loader.dataset[3]["input_ids"], torch.arange(12, 16))
