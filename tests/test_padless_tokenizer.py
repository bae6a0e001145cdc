"""Tokenizers without a pad token (Llama-2, Llama-3 and Mistral base tokenizers) train in every
batch shape: packed and padded SFT, DPO, KTO and reward-model rows. Batches pad with a stand-in id (EOS) that the
attention masks and labels ignore, said once at start; the saved tokenizer records it."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from lmforge.config import load_config
from lmforge.train.runner import run_training
from tests.conftest import ROOT, save_tiny_llama
from tests.test_convert_gguf import make_spm_tokenizer

pytestmark = pytest.mark.slow
DATA = ROOT / "examples" / "data"


@pytest.fixture(scope="module")
def padless_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama whose SentencePiece-style tokenizer has bos/eos/unk and no pad, as Llama 2's."""
    tokenizer = make_spm_tokenizer()
    assert tokenizer.pad_token_id is None
    return save_tiny_llama(tokenizer, tmp_path_factory.mktemp("padless") / "model")


def _train(tmp_path: Path, model: Path, name: str, file: str, **train: Any) -> Path:
    base = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"path": str(model)},
        "data": {
            "train": [{"path": str(DATA / file)}],
            "max_length": 96,
            "over_length": "truncate",
            **train.pop("data", {}),
        },
        "train": {"max_steps": 3, "micro_batch_size": 4, "lr": 1e-3, "precision": "fp32", **train},
    }
    return run_training(load_config(None, base=base)).run_dir


@pytest.mark.parametrize(
    "name,file,settings",
    [
        ("packed", "arithmetic_alpaca.jsonl", {"stage": "sft", "data": {"packing": True}}),
        ("padded", "arithmetic_alpaca.jsonl", {"stage": "sft"}),
        ("dpo", "arithmetic_preference.jsonl", {"stage": "dpo", "method": "lora"}),
        ("kto", "arithmetic_kto.jsonl", {"stage": "kto", "method": "lora"}),
        ("rm", "arithmetic_preference.jsonl", {"stage": "rm"}),
    ],
)
def test_padless_tokenizer_trains(
    padless_model: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    name: str,
    file: str,
    settings: dict,
) -> None:
    with caplog.at_level(logging.INFO):
        run_dir = _train(tmp_path, padless_model, name, file, **settings)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    notices = [r.getMessage() for r in caplog.records if "has no pad token" in r.getMessage()]
    assert notices == [
        "tokenizer: it has no pad token; batches pad with '</s>' (id 2), which attention masks and labels ignore"
    ]
    saved = AutoTokenizer.from_pretrained(run_dir / "final")
    assert saved.pad_token == "</s>"
