"""The SFT data stage and SFT training through the real CLI, on a tiny model this suite builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM

from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.models.build import build_model
from tests.conftest import ROOT, SMALL_ARCH, run_cli

pytestmark = pytest.mark.slow
CHAT = ROOT / "examples" / "data" / "chat_messages.jsonl"
ALPACA = ROOT / "examples" / "data" / "arithmetic_alpaca.jsonl"


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small untrained llama with a tokenizer trained on the example data (HF directory)."""
    out = tmp_path_factory.mktemp("base") / "model"
    texts = CHAT.read_text().splitlines() + ALPACA.read_text().splitlines()
    tokenizer = train_tokenizer(texts * 3, TokenizerTrainConfig(vocab_size=400, min_frequency=1))
    build_model(
        ModelConfig(preset="llama-tiny", config=SMALL_ARCH), tokenizer, max_length=256
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def sft_config(tmp_path: Path, base_model: Path, sources: list[dict], **data: object) -> Path:
    config = {
        "run": {"name": "sft", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"path": str(base_model)},
        "data": {"train": sources, "max_length": 256, "over_length": "truncate", **data},
        "train": {
            "stage": "sft",
            "max_steps": 30,
            "micro_batch_size": 4,
            "lr": 3e-3,
            "precision": "fp32",
            "log_every": 5,
            "save_every": None,
        },
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_prepare_reports_and_shows_supervised_spans(tmp_path: Path, base_model: Path) -> None:
    config = sft_config(
        tmp_path,
        base_model,
        [{"path": str(CHAT)}, {"path": str(ALPACA), "weight": 0.5}],
        packing=True,
        eval_fraction=0.1,
    )
    result = run_cli("prepare", str(config), "--show", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "runs" / "sft" / "data_report.json").read_text())
    assert report["rows"]["rows_read"] == 200 + 240 and report["rows"]["rows_bad"] == 0
    train, evaluation = report["train"], report["eval"]
    # Weight 0.5 keeps about half of the 240 alpaca rows.
    assert 200 + 90 < train["samples"] + evaluation["samples"] < 200 + 150
    assert 0 < train["supervised_tokens"] < train["tokens"]
    assert train["length_p50"] <= train["length_p90"] <= train["length_max"] <= 256
    assert train["packing"]["efficiency"] > 0.9 > 1 - train["padded_to_longest_pad_fraction"]
    assert report["eval_samples_also_in_train"] == 0
    assert "with loss" in result.stdout and "<|im_start|>assistant" in result.stdout

    again = run_cli("prepare", str(config))
    assert "reusing cache" in again.stderr
    changed = run_cli("prepare", str(config), "data.train_on=all")
    assert "reusing cache" not in changed.stderr
    assert json.loads((tmp_path / "runs" / "sft" / "data_report.json").read_text())["train_on"] == "all"


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_sft_trains_and_counts_every_real_token_once(tmp_path: Path, base_model: Path, packing: bool) -> None:
    config = sft_config(tmp_path, base_model, [{"path": str(CHAT)}], packing=packing)
    result = run_cli("train", str(config), "train.max_steps=null", "train.epochs=1")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "sft"
    report = json.loads((run_dir / "data_report.json").read_text())
    steps = records(run_dir)
    # One epoch sees every sample exactly once: the real-token count matches the data report exactly.
    assert steps[-1]["tokens_seen"] == report["train"]["tokens"]
    losses = [r["loss"] for r in steps if "loss" in r]
    assert losses[-1] < losses[0] - 1.0
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert model.config.model_type == "llama"


def test_bad_rows_quarantined_under_skip_and_fatal_beyond_the_fraction(
    tmp_path: Path, base_model: Path
) -> None:
    rows = CHAT.read_text().splitlines()
    rows[10] = '{"messages": [{"role": "assistant", "content": "hi"}'  # malformed JSON
    rows[20] = json.dumps(
        {"messages": [{"role": "user", "content": "   "}, {"role": "assistant", "content": "x"}]}
    )
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(rows) + "\n")
    config = sft_config(tmp_path, base_model, [{"path": str(data)}], on_bad_row="skip", max_bad_fraction=0.02)
    result = run_cli("prepare", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    quarantined = [
        json.loads(line) for line in (tmp_path / "runs" / "sft" / "bad_rows.jsonl").read_text().splitlines()
    ]
    assert [(q["line"], q["reason"]) for q in quarantined] == [(11, "malformed JSON"), (21, "empty turn")]
    report = json.loads((tmp_path / "runs" / "sft" / "data_report.json").read_text())
    assert report["rows"]["rows_bad"] == 2 and report["rows"]["rows_kept"] == 198

    strict = run_cli("prepare", str(config), "data.max_bad_fraction=0.005")
    assert strict.returncode == 2
    assert "2 of 200 rows are bad" in strict.stderr and "data.max_bad_fraction=0.005" in strict.stderr
    default = run_cli("prepare", str(config), "data.on_bad_row=error")
    assert default.returncode == 2
    assert f"{data}:11: malformed JSON" in default.stderr
