"""A run's config.yaml is read back through the schema by the doctor and the report: typed values
with the schema's own defaults, and an old run directory (a key that no longer exists, a value that
no longer validates) is still read, with a note naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from lmforge.config.recorded import read_recorded_config, recorded_config_from
from lmforge.config.schema import TrainConfig
from lmforge.monitor.diagnosis import diagnose_run
from lmforge.monitor.doctor import doctor_report
from lmforge.report import load_run, write_report

OLD_CONFIG = {
    "run": {"name": "old-run", "output_dir": "runs"},
    "model": {"preset": "llama-tiny"},
    "data": {"train": [{"path": "train.jsonl", "shuffle_buffer": 10}], "packing": True},
    "train": {"stage": "sft", "lr": 1e-3, "learning_rate_warmup": 50, "micro_batch_size": "eight"},
    "logging": {"tensorboard": True},
}


def test_old_keys_are_left_out_with_a_note_and_the_rest_is_typed() -> None:
    recorded = recorded_config_from(OLD_CONFIG)
    assert recorded.train.lr == 1e-3 and recorded.train.stage == "sft"
    # The value that no longer validates takes the schema's default, not a hand-copied one.
    assert recorded.train.micro_batch_size == TrainConfig().micro_batch_size
    assert recorded.model is not None and recorded.model.preset == "llama-tiny"
    assert (
        recorded.data is not None and recorded.data.packing and recorded.data.train[0].path == "train.jsonl"
    )
    notes = "\n".join(recorded.notes)
    assert "train.learning_rate_warmup is not a key of lmforge's config" in notes
    assert "data.train.0.shuffle_buffer is not a key" in notes
    assert "section 'logging' is not part of lmforge's config" in notes
    assert "train.micro_batch_size='eight' no longer validates; the default is used" in notes
    assert recorded.sections == {"run", "model", "data", "train"}


def test_a_missing_or_broken_file_gives_the_defaults_with_a_note(tmp_path: Path) -> None:
    missing = read_recorded_config(tmp_path / "config.yaml")
    assert not missing.found and missing.train == TrainConfig() and "not found" in missing.notes[0]
    (tmp_path / "config.yaml").write_text("train: [unclosed")
    broken = read_recorded_config(tmp_path / "config.yaml")
    assert not broken.found and "not valid YAML" in broken.notes[0]


def _old_run(tmp_path: Path) -> Path:
    run = tmp_path / "old-run"
    (run / "events").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(OLD_CONFIG))
    (run / "manifest.json").write_text(json.dumps({"created": "2026-11-01T10:00:00+0000", "hardware": {}}))
    records = [{"step": s, "loss": 3.0 - 0.01 * s, "lr": 1e-3, "grad_norm": 1.0} for s in range(1, 31)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "events" / "events.jsonl").write_text(
        json.dumps({"time": 1.0, "step": 12, "kind": "oom_backoff", "message": "halved"}) + "\n"
    )
    return run


def test_doctor_reads_an_old_run_and_says_what_it_left_out(tmp_path: Path) -> None:
    run = _old_run(tmp_path)
    oom = next(f for f in diagnose_run(run) if f.id == "oom_backoff")
    # micro-batch: the schema's default (8) stands in for the unreadable value; accumulation: default 1.
    assert oom.changes[:2] == ["train.micro_batch_size=4", "train.grad_accum=2"]
    notes = doctor_report(run)["run"]["config_notes"]
    assert any("train.learning_rate_warmup" in note for note in notes)


def test_report_reads_an_old_run_and_shows_the_notes(tmp_path: Path) -> None:
    run = _old_run(tmp_path)
    summary = load_run(run)
    assert summary.name == "old-run" and summary.stage == "sft"
    assert any("train.learning_rate_warmup" in problem for problem in summary.problems)
    page = write_report(run).read_text()
    assert "learning_rate_warmup is not a key of lmforge&#x27;s config" in page
    assert "train.jsonl" in page and "sft / full" in page


def test_report_names_the_engine_the_manifest_recorded(tmp_path: Path) -> None:
    run = _old_run(tmp_path)
    manifest = {"created": "2026-11-01T10:00:00+0000", "hardware": {"cpu_count": 2, "gpus": []}}
    manifest["distributed"] = {"engine": "none", "world_size": 1, "zero_stage": None}
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert "single process on CPU (2 cores)" in write_report(run).read_text()
    manifest["distributed"] = {"engine": "deepspeed", "world_size": 2, "zero_stage": 3}
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert "deepspeed ZeRO-3 x 2 processes on CPU (2 cores)" in write_report(run).read_text()
