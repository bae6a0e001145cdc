"""`lmforge doctor`: the environment report, and the troubleshooting table applied to synthetic runs:
each sick run gets its finding with the config change to try; a healthy run gets none."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from lmforge.cli.doctor import doctor
from lmforge.errors import UserInputError
from lmforge.monitor.diagnosis import diagnose_run
from lmforge.monitor.doctor import environment_report

CONFIG = {
    "run": {"name": "synthetic"},
    "train": {
        "stage": "sft",
        "lr": 3e-4,
        "micro_batch_size": 8,
        "grad_accum": 2,
        "precision": "fp16",
        "max_grad_norm": 1.0,
        "warmup_steps": 0,
        "max_steps": 200,
        "dataloader_workers": 0,
        "gradient_checkpointing": False,
    },
    "data": {"packing": False},
    "monitor": {"guard": {"nonfinite": "skip", "spike": "skip"}},
}


def _healthy(steps: int = 200, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    records = []
    for step in range(1, steps + 1):
        record: dict[str, Any] = {
            "step": step,
            "loss": (1.0 + 3.0 * math.exp(-step / 40)) * (1 + rng.uniform(-0.01, 0.01)),
            "lr": 3e-4,
            "grad_norm": 1.0 + rng.uniform(-0.1, 0.1),
            "tokens_per_s": 2800 * (1 + rng.uniform(-0.02, 0.02)),
            "step_time_s": 0.7,
            "data_wait_share": 0.03,
        }
        if step % 50 == 0:
            record["eval_loss"] = 1.1 + 3.0 * math.exp(-step / 40)
            record["eval_ppl"] = math.exp(record["eval_loss"])
        records.append(record)
    return records


def _run_dir(
    tmp_path: Path,
    records: list[dict[str, Any]],
    events: list[dict[str, Any]] = (),
    config: dict[str, Any] | None = None,
) -> Path:  # type: ignore[assignment]
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "events" / "events.jsonl").write_text(
        "".join(json.dumps({"time": 0.0, "message": "", **e}) + "\n" for e in events)
    )
    (run / "config.yaml").write_text(yaml.safe_dump(config or CONFIG))
    return run


def _by_id(run: Path) -> dict[str, Any]:
    return {f.id: f for f in diagnose_run(run)}


def test_environment_report_has_the_keys(tmp_path: Path) -> None:
    env = environment_report(tmp_path / "not-yet")
    for key in (
        "python",
        "platform",
        "packages",
        "cuda_available",
        "cuda_version",
        "devices",
        "nccl_version",
        "bf16_supported",
        "cpu_count",
        "cpu_usable",
        "ram_total_gb",
        "ram_available_gb",
        "disks",
    ):
        assert key in env, key
    assert set(env["packages"]) >= {"torch", "transformers", "peft", "trl", "deepspeed"}
    assert env["packages"]["torch"] and env["cpu_count"] >= 1 and env["ram_total_gb"] > 0
    assert [d["path"] for d in env["disks"]] == [str(Path.cwd()), str(tmp_path / "not-yet")]
    assert all(
        d["writable"] and d["free_gb"] > 0 for d in env["disks"]
    )  # checked on the nearest existing parent


def test_healthy_run_has_no_findings(tmp_path: Path) -> None:
    assert diagnose_run(_run_dir(tmp_path, _healthy())) == []


def test_flat_loss(tmp_path: Path) -> None:
    records = [{**r, "loss": 5.0 + 0.02 * math.sin(r["step"])} for r in _healthy()]
    found = _by_id(_run_dir(tmp_path, records))
    assert set(found) == {"loss_flat"}
    assert found["loss_flat"].changes == ["train.lr=0.0009"]


def test_rising_loss(tmp_path: Path) -> None:
    records = [{**r, "loss": 2.0 + r["step"] / 50} for r in _healthy()]
    found = _by_id(_run_dir(tmp_path, records))
    assert "loss_rising" in found and "train.lr=3e-5" in found["loss_rising"].changes


def test_spiky_loss(tmp_path: Path) -> None:
    records = _healthy()
    for step in (80, 120, 160):
        records[step - 1]["loss"] *= 3
    found = _by_id(_run_dir(tmp_path, records))
    assert set(found) == {"loss_unstable"}
    unstable = found["loss_unstable"]
    assert "80, 120, 160" in unstable.evidence
    assert unstable.changes[:2] == ["train.lr=0.0001", "train.warmup_steps=10"]


def test_oscillating_loss(tmp_path: Path) -> None:
    records = [{**r, "loss": r["loss"] * (1.3 if r["step"] % 2 else 0.7)} for r in _healthy()]
    found = _by_id(_run_dir(tmp_path, records))
    assert "loss_unstable" in found and "noise" in found["loss_unstable"].evidence


def test_nonfinite_events(tmp_path: Path) -> None:
    records = _healthy()
    records[99]["loss"] = "nan"  # how metrics.jsonl keeps a NaN
    events = [{"step": s, "kind": "nonfinite"} for s in (100, 101, 102)]
    found = _by_id(_run_dir(tmp_path, records, events))
    assert set(found) == {"nonfinite"}
    nonfinite = found["nonfinite"]
    assert nonfinite.severity == "error" and "100, 101, 102" in nonfinite.evidence
    assert nonfinite.changes == [
        "train.precision=bf16",
        "train.lr=0.0001",
        "monitor.guard.nonfinite=rollback",
    ]


def test_data_bound_and_oom(tmp_path: Path) -> None:
    records = [{**r, "data_wait_share": 0.45} for r in _healthy()]
    events = [{"step": 30, "kind": "oom_backoff"}]
    found = _by_id(_run_dir(tmp_path, records, events))
    assert set(found) == {"data_bound", "oom_backoff"}
    workers = found["data_bound"].changes[0]
    assert workers.startswith("train.dataloader_workers=") and int(workers.split("=")[1]) >= 1
    assert "data.packing=true" in found["data_bound"].changes and "45%" in found["data_bound"].evidence
    assert found["oom_backoff"].changes == [
        "train.micro_batch_size=4",
        "train.grad_accum=4",
        "train.gradient_checkpointing=true",
    ]


def test_stall_overfit_slowdown_and_failure(tmp_path: Path) -> None:
    records = _healthy()
    for r, bump in zip([r for r in records if "eval_loss" in r], (0.0, 0.3, 0.6, 0.9), strict=True):
        r["eval_loss"] = 1.5 + bump  # best at step 50, then rising
    for r in records[150:]:
        r["tokens_per_s"] = 900.0
    events = [
        {"step": 120, "kind": "stall", "message": "no step for 900 s"},
        {"step": 170, "kind": "failed", "message": "RuntimeError"},
    ]
    found = _by_id(_run_dir(tmp_path, records, events))
    assert set(found) == {"stall", "overfitting", "throughput_dropped", "run_failed"}
    assert found["overfitting"].changes[:2] == ["train.max_steps=50", "train.best_metric=eval_loss"]
    assert "monitor.guard.stall_seconds=1800" in found["stall"].changes
    assert list(diagnose_run(tmp_path / "run"))[0].severity == "error"  # worst first


def test_cli_text_json_and_errors(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command()(doctor)
    runner = CliRunner()
    run = _run_dir(tmp_path, _healthy(), [{"step": 30, "kind": "oom_backoff"}])

    text = runner.invoke(app, [str(run)])
    assert text.exit_code == 0, text.output
    assert "environment" in text.output and "torch" in text.output
    assert "train.micro_batch_size=4" in text.output

    as_json = runner.invoke(app, [str(run), "--json"])
    report = json.loads(as_json.output)
    assert report["run"]["events"] == {"oom_backoff": 1} and report["run"]["last_step"] == 200
    assert [f["id"] for f in report["findings"] if f["id"] == "oom_backoff"] == ["oom_backoff"]

    only_env = json.loads(runner.invoke(app, ["--json"]).output)
    assert only_env["run"] is None and "packages" in only_env["environment"]
    assert "Example" in runner.invoke(app, ["--help"]).output

    missing = runner.invoke(app, [str(tmp_path / "nope")])
    assert isinstance(missing.exception, UserInputError) and "not a directory" in str(missing.exception)
    with pytest.raises(UserInputError, match="no metrics.jsonl"):
        diagnose_run(tmp_path)


def test_diverged_run_is_divergence_not_overfitting(tmp_path: Path) -> None:
    """lr 0.5: the loss climbs from the start and the eval at step 0 stays the best. The advice
    is a far lower lr, never `train.max_steps=0`; an error-level finding exits 1."""
    config = {**CONFIG, "train": {**CONFIG["train"], "lr": 0.5}}
    records = [{**r, "lr": 0.5, "loss": 3.0 + r["step"] / 40} for r in _healthy()]
    records.insert(0, {"step": 0, "eval_loss": 3.0, "eval_ppl": math.exp(3.0)})
    for r in records[1:]:
        if "eval_loss" in r:
            r["eval_loss"] = r["loss"] + 0.1
    run = _run_dir(tmp_path, records, config=config)
    found = _by_id(run)
    assert "overfitting" not in found
    assert found["loss_rising"].changes[0] == "train.lr=0.05"
    assert not any("max_steps=0" in change for f in found.values() for change in f.changes)
    app = typer.Typer()
    app.command()(doctor)
    assert CliRunner().invoke(app, [str(run)]).exit_code == 1
    assert CliRunner().invoke(app, [str(run), "--json"]).exit_code == 1


def test_stuck_run_gets_orders_of_magnitude_more_lr(tmp_path: Path) -> None:
    config = {**CONFIG, "train": {**CONFIG["train"], "lr": 1e-7}}
    records = [{**r, "lr": 1e-7, "loss": 5.0 + 0.02 * math.sin(r["step"])} for r in _healthy()]
    found = _by_id(_run_dir(tmp_path, records, config=config))
    assert found["loss_flat"].changes == ["train.lr=1e-5"]


def test_oscillating_loss_gets_the_tutorials_advice(tmp_path: Path) -> None:
    records = [{**r, "loss": r["loss"] * (1.06 if r["step"] % 2 else 0.94)} for r in _healthy()]
    found = _by_id(_run_dir(tmp_path, records))
    assert found["loss_oscillating"].changes == [
        "train.lr=0.0001",
        "train.grad_accum=4",
        "train.warmup_steps=10",
    ]
    assert "loss_oscillating" not in _by_id(_run_dir(tmp_path / "calm", _healthy()))


def test_slow_steps_name_the_levers_not_yet_on(tmp_path: Path) -> None:
    config = {**CONFIG, "train": {**CONFIG["train"], "precision": "fp32"}}
    records = [{**r, "step_time_s": 80.0} for r in _healthy()]
    slow = _by_id(_run_dir(tmp_path, records, config=config))["slow_training"]
    assert slow.changes == ["train.precision=bf16", "data.packing=true"] and "80.0 s" in slow.evidence
