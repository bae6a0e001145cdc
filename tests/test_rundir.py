"""The run directory's manifest: provenance recorded, secrets never."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lmforge.config.redact import REDACTED
from lmforge.config.schema import TrainConfig
from lmforge.run_layout import RunPaths
from lmforge.train.run_start import decide_start
from lmforge.train.rundir import write_manifest


def test_manifest_records_provenance_and_redacts_secrets_from_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_topsecretvalue42")
    monkeypatch.setattr(sys, "argv", ["lmforge", "train", "cfg.yaml", "model.path=hf_topsecretvalue42"])
    paths = RunPaths(tmp_path)
    write_manifest(paths, data_fingerprint="d" * 64)
    text = paths.manifest.read_text()
    assert "hf_topsecretvalue42" not in text
    manifest = json.loads(text)
    assert REDACTED in manifest["command"]
    assert manifest["packages"]["transformers"].startswith("5.")
    assert manifest["hardware"]["cpu_count"] >= 1
    assert manifest["data_fingerprint"] == "d" * 64


def test_prepared_but_untrained_directory_can_be_claimed(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    paths.data_report.write_text("{}")  # what `lmforge prepare` leaves
    start = decide_start(TrainConfig(), paths, overwrite=False, act=True)
    assert start.resume is None and start.set_aside is None and start.finished is None
    assert paths.data_report.exists()
