"""The SFT prepare stage itself: the parallel tokenizer path gives exactly the serial result."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lmforge.config.schema import DataConfig, SourceConfig, TokenizerTrainConfig
from lmforge.data import sft
from lmforge.data.tokenizer import train_tokenizer
from tests.conftest import ROOT

CHAT = ROOT / "examples" / "data" / "chat_messages.jsonl"


def test_worker_pool_matches_single_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = train_tokenizer(
        CHAT.read_text().splitlines(), TokenizerTrainConfig(vocab_size=400, min_frequency=1)
    )
    # Weight 6 turns 200 rows into 1,200 samples: three chunks, so the pool really runs.
    cfg = DataConfig(train=[SourceConfig(path=str(CHAT), weight=6.0)], max_length=128, over_length="truncate")
    results = {}
    for workers in (1, 2):
        monkeypatch.setattr(sft, "_worker_count", lambda workers=workers: workers)
        prepared = sft.prepare_sft_data(
            cfg,
            tokenizer,
            seed=0,
            cache_dir=tmp_path / f"cache{workers}",
            quarantine_path=tmp_path / "bad.jsonl",
        )
        results[workers] = prepared.train
    assert len(results[1]) == len(results[2]) == 1200
    for name in ("input_ids", "labels", "offsets"):
        assert np.array_equal(getattr(results[1], name), getattr(results[2], name)), name
