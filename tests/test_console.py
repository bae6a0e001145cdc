"""The training console: formatted lines, the upstream-notice filter, and --verbose.

The quiet default on a whole pipeline is checked by the quickstart test (tests/test_train_e2e.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmforge.train.console_progress import format_eval_line, format_step_line
from lmforge.verbosity import FILE_ONLY, QUIET_CONSOLE, VERBOSE_ENV
from tests.conftest import run_cli
from tests.test_bad_input import write_config


def _record(name: str, level: int, message: str, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord(name, level, __file__, 1, message, (), None)
    record.__dict__.update(extra)
    return record


def test_console_filter_keeps_lmforge_and_actionable_upstream_warnings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    passes = QUIET_CONSOLE.filter
    assert passes(_record("lmforge.train.runner", logging.INFO, "model: llama"))
    assert passes(_record("DeepSpeed", logging.WARNING, "zero_optimization.stage 3 needs ..."))
    assert not passes(_record("onnxscript.optimizer", logging.INFO, "Skipping constant folding"))
    assert not passes(_record("DeepSpeed", logging.WARNING, "[WARNING] Setting accelerator to CPU. If you"))
    deprecation = "/x/modeling_utils.py:3303: FutureWarning: `is_gradient_checkpointing` is deprecated"
    assert not passes(_record("py.warnings", logging.WARNING, deprecation))
    tied = "/x/tuners_utils.py:1463: UserWarning: Model has `tie_word_embeddings=True` and a tied layer is part of the adapter"
    assert not passes(_record("py.warnings", logging.WARNING, tied))
    assert passes(
        _record("py.warnings", logging.WARNING, "/x/data.py:10: UserWarning: the tokenizer has no pad")
    )
    assert not passes(_record("hf_trainer.logs", logging.INFO, "step 1: {'loss': 1.0}", **{FILE_ONLY: True}))
    monkeypatch.setenv(VERBOSE_ENV, "1")  # --verbose: everything but the file-only copies
    assert passes(_record("onnxscript.optimizer", logging.INFO, "Skipping constant folding"))
    assert passes(_record("py.warnings", logging.WARNING, deprecation))
    assert not passes(_record("hf_trainer.logs", logging.INFO, "step 1: {'loss': 1.0}", **{FILE_ONLY: True}))


def test_step_and_eval_lines_show_numbers_as_numbers() -> None:
    record = {"loss": 8.36213, "lr": 0.002, "grad_norm": 2.6931, "tokens_per_s": 3210.4, "mfu": 0.2143}
    assert format_step_line(record, 40, 200, 51.2) == (
        "step  40/200  loss 8.3621  lr 2.00e-03  grad 2.69  tok/s 3,210  MFU 21.4%  ETA 0:00:51"
    )
    assert format_step_line({"loss": float("nan")}, 3, 9, None) == "step 3/9  loss nan"
    evaluated = {"eval_loss": 6.0291, "eval_ppl": 415.24, "eval_runtime": 1.1, "eval_bleu": 12.5}
    assert format_eval_line(evaluated, 100) == "eval at step 100:  loss 6.029  ppl 415.2  bleu 12.5"


def test_verbose_restores_hf_trainers_raw_output(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text("some text to read for a tiny model\n" * 200)
    config = write_config(tmp_path, tmp_path / "corpus.txt", max_steps=2, log_every=1)
    result = run_cli("train", str(config), "--verbose", "run.name=verbose")
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr
    assert "{'loss'" in printed  # HF's own log dicts
    assert "step 1/2  loss" not in printed  # and not lmforge's lines on top of them
    assert "hf_trainer.logs: step 2: {'loss'" in (tmp_path / "runs" / "verbose" / "train.log").read_text()
