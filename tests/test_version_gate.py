"""A library outside the versions lmforge's upstream couplings were tested on stops `lmforge train`
and `lmforge launch` before any work (exit code 2, naming the library, the installed version and
the tested range), unless LMFORGE_ALLOW_UNTESTED_VERSIONS=1 turns the stop into a warning."""

from __future__ import annotations

import logging
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lmforge import upstream
from lmforge.errors import UserInputError
from lmforge.train.preflight import require_tested_versions

UNTESTED = "6.0.0"


@pytest.fixture
def untested_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed-version lookup says transformers 6.0.0; the check itself is the real one."""
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: UNTESTED if name == "transformers" else real(name))
    monkeypatch.delenv(upstream.ALLOW_UNTESTED_ENV, raising=False)


def _config(tmp_path: Path) -> Path:
    config = {
        "run": {"name": "gate", "output_dir": str(tmp_path / "runs")},
        "model": {"preset": "llama-tiny"},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": str(tmp_path / "corpus.txt")}], "max_length": 32, "eval_fraction": 0},
        "train": {"max_steps": 1, "micro_batch_size": 2, "precision": "fp32"},
    }
    (tmp_path / "corpus.txt").write_text("some text to read\n" * 50)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _assert_names_library_range_and_opt_out(message: str) -> None:
    low, high = upstream.TESTED["transformers"]
    assert f"transformers {UNTESTED} is outside the tested range >={low},<{high}" in message
    assert f"{upstream.ALLOW_UNTESTED_ENV}=1" in message


def test_installed_versions_pass_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(upstream.ALLOW_UNTESTED_ENV, raising=False)
    require_tested_versions()


def test_train_stops_before_any_work_with_exit_code_2(
    untested_transformers: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmforge.cli.main import app, main

    config = _config(tmp_path)
    result = CliRunner().invoke(app, ["train", str(config)])
    assert isinstance(result.exception, UserInputError), result.output
    _assert_names_library_range_and_opt_out(str(result.exception))
    assert not (tmp_path / "runs" / "gate").exists()  # nothing was prepared

    monkeypatch.setattr(sys, "argv", ["lmforge", "train", str(config)])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 2


def test_launch_stops_before_any_worker_starts(
    untested_transformers: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmforge.cli import launch as launch_cli
    from lmforge.cli.main import app

    def no_workers(*args: object, **kwargs: object) -> int:
        raise AssertionError("workers started despite an untested library")

    monkeypatch.setattr(launch_cli, "_train_with_oom_ladder", no_workers)
    result = CliRunner().invoke(app, ["launch", str(_config(tmp_path)), "--nproc-per-node", "1"])
    assert result.exit_code == 2, result.output
    _assert_names_library_range_and_opt_out(result.output)


def test_the_opt_out_turns_the_stop_into_a_warning(
    untested_transformers: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(upstream.ALLOW_UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=upstream.__name__):
        require_tested_versions()
    assert any(f"transformers {UNTESTED} is outside" in record.getMessage() for record in caplog.records)
