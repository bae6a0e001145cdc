"""Places a new user was misled, reproduced: what a run records and measures must match what it
did (the user-path issue's smaller mismatches)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from lmforge.train.precision import resolve_precision
from tests.test_guardrails import config, train

pytestmark = pytest.mark.slow


def test_config_records_the_resolved_precision_and_held_out_data_is_measured_at_the_end(
    tmp_path: Path, corpus: Path
) -> None:
    """`precision: auto` is written as what it resolved to; `eval_fraction` without `eval_every`
    still measures the held-out data once, at the last step (it used to never evaluate)."""
    base = config(tmp_path, corpus, max_steps=4, precision="auto")
    base["data"]["eval_fraction"] = 0.1
    run_dir = train(base).run_dir
    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert recorded["train"]["precision"] == resolve_precision("auto", use_cuda=torch.cuda.is_available())
    assert recorded["train"]["precision"] != "auto"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4] and evals[0]["eval_ppl"] > 1


def _prepare_sft(tmp_path: Path, name: str, data: Path, **settings: object) -> tuple[Path, dict]:
    """`lmforge prepare` of alpaca rows for an SFT run named `name` (shared tokenizer and cache)."""
    from lmforge.config import load_config
    from lmforge.data.run_data import prepare_run_data

    cfg = load_config(
        None,
        base={
            "run": {"name": name, "output_dir": str(tmp_path / "runs")},
            "model": {"preset": "llama-tiny"},
            "tokenizer": {"path": str(tmp_path / "tokenizer")},
            "data": {
                "train": [{"path": str(data), "format": "alpaca"}],
                "cache_dir": str(tmp_path / "cache"),
                **settings,
            },
            "train": {"stage": "sft", "micro_batch_size": 2},
        },
    )
    report, _, prepared = prepare_run_data(cfg)
    return report.parent, prepared.report


def _alpaca_rows(tmp_path: Path, rows: list[dict], tail: str = "") -> Path:
    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.tokenizer import train_tokenizer

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    tokenizer = train_tokenizer([json.dumps(r) for r in rows] * 3, TokenizerTrainConfig(vocab_size=300))
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    return data


def test_a_run_reusing_prepared_data_gets_the_quarantined_rows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With on_bad_row: skip, the second run over the same data reuses the cache and its report
    counts the bad rows: its run directory holds them too (bad_rows.jsonl), as the first one's does."""
    rows = [{"instruction": f"add {i} and {i}", "output": str(2 * i)} for i in range(40)]
    data = _alpaca_rows(tmp_path, rows, tail='{"instruction": "broken\n')
    policy = {"on_bad_row": "skip", "max_bad_fraction": 0.1}
    first_dir, first = _prepare_sft(tmp_path, "first", data, **policy)
    with caplog.at_level(logging.INFO, logger="lmforge.data.prep"):
        second_dir, second = _prepare_sft(tmp_path, "second", data, **policy)
    assert "prepared data: reusing cache" in caplog.text  # nothing was read again
    assert second["rows"]["rows_bad"] == first["rows"]["rows_bad"] == 1
    quarantined = (second_dir / "bad_rows.jsonl").read_text()
    assert quarantined == (first_dir / "bad_rows.jsonl").read_text()
    assert json.loads(quarantined)["line"] == 41


def test_truncated_samples_are_counted(tmp_path: Path) -> None:
    """over_length: truncate keeps long samples cut to max_length; the report says how many."""
    rows = [{"instruction": "repeat", "output": "word " * (200 if i % 4 == 0 else 3)} for i in range(40)]
    _, report = _prepare_sft(
        tmp_path, "cut", _alpaca_rows(tmp_path, rows), max_length=48, over_length="truncate", eval_fraction=0
    )
    assert report["truncated"] == {"train": 10} and report["dropped"] == {}
    assert report["train"]["samples"] == 40


def test_resume_with_changed_maths_stops_with_the_diff_and_history_is_kept(
    tmp_path: Path, corpus: Path
) -> None:
    """A stopped run re-run with another max_length and accumulation would mix two trainings:
    it stops naming both changes and the ways forward, touching nothing; with
    train.resume_changed=allow it continues, records a config_changed event and keeps the first
    launch's config.yaml and manifest.json in history/. A log-cadence change needs no flag."""
    from tests.conftest import run_cli
    from tests.test_run_reliability import config_for, events_of, steps_of

    config = config_for(tmp_path, corpus, max_steps=6)
    run_dir = tmp_path / "runs" / "base"
    assert run_cli("train", str(config), "debug.crash_at_step=3").returncode != 0
    recorded = (run_dir / "config.yaml").read_text()

    changed = ("data.max_length=32", "train.grad_accum=2")
    refused = run_cli("train", str(config), *changed)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    for line in ("data.max_length: 64 -> 32", "train.grad_accum: 1 -> 2", "data_fingerprint:"):
        assert line in refused.stderr, refused.stderr[-2000:]
    assert "train.resume_changed=allow" in refused.stderr and "run.name=" in refused.stderr
    assert (run_dir / "config.yaml").read_text() == recorded and not (run_dir / "history").exists()

    allowed = run_cli("train", str(config), *changed, "train.resume_changed=allow", "train.log_every=2")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "missing keys" not in allowed.stderr  # the tied head is not in a checkpoint, by design
    (event,) = [e for e in events_of(run_dir) if e["kind"] == "config_changed"]
    assert "data.max_length: 64 -> 32" in event["message"] and "train.log_every: 1 -> 2" in event["message"]
    first = yaml.safe_load((run_dir / "history" / "launch-1" / "config.yaml").read_text())
    assert (
        first["data"]["max_length"] == 64 and (run_dir / "history" / "launch-1" / "manifest.json").is_file()
    )
    now = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert now["data"]["max_length"] == 32 and now["train"]["grad_accum"] == 2
    assert steps_of(run_dir)[-1] == 6

    harmless = run_cli("train", str(config), "train.max_steps=8", *changed, "train.log_every=1")
    assert harmless.returncode == 0, harmless.stderr[-3000:]  # only the cadence and length changed now
    assert sorted(p.name for p in (run_dir / "history").iterdir()) == ["launch-1", "launch-2"]


def test_engine_start_up_says_what_it_compiles_and_for_how_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """DeepSpeed's JIT builds left 1-4.5 silent minutes before step 1: while torch holds a build's
    lock file, the heartbeat names the op and the elapsed time; a start without builds says so."""
    import time

    from lmforge.distributed.startup_progress import StartupHeartbeat

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    building = tmp_path / "py311_cpu" / "deepspeed_shm_comm"
    building.mkdir(parents=True)
    (building / "lock").write_text("")
    caplog.set_level(logging.INFO, logger="lmforge.distributed.startup_progress")
    heartbeat = StartupHeartbeat("deepspeed ZeRO-2", first_notice_s=0.05, interval_s=0.05).start()
    time.sleep(0.3)
    (building / "lock").unlink()  # built: the next notice no longer names it
    time.sleep(0.2)
    heartbeat.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(
        f"deepspeed ZeRO-2 is starting: compiling its op(s) deepspeed_shm_comm (once per machine; cached in {tmp_path}), "
    )
    assert any("setting up the engine and its process group" in line for line in lines[1:])
    assert lines[-1].startswith("deepspeed ZeRO-2 started in ")
    quiet = StartupHeartbeat("ddp", first_notice_s=5).start()
    quiet.stop()  # a start faster than the first notice prints nothing
    assert quiet.notices == 0
