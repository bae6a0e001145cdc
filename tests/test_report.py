"""`lmforge report`, `lmforge runs` and `lmforge runs compare` on run directories built as
lmforge writes them (synthetic files, real checkpoint sealing), plus one short real run with a
NaN drill; the 100k-step file checks that big runs stay fast and small."""

from __future__ import annotations

import json
import math
import random
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer
import yaml
from typer.testing import CliRunner

from lmforge.ckpt.atomic import commit_checkpoint, write_best
from lmforge.cli.report import report, runs_app
from lmforge.errors import UserInputError
from lmforge.report import list_runs, load_run, write_comparison, write_report
from lmforge.report.load import run_status
from lmforge.report.plots import MAX_BUCKETS, downsample
from tests.test_guardrails import config

CONFIG_XSS = "</pre><script>alert('config')</script>"
EVENT_XSS = '<script>alert("event")</script><img src=x onerror=alert(1)>'
SECTIONS = ("Summary", "Curves", "Events", "Data", "Checkpoints", "Export", "Resolved config")
# What a 100k-step report may take here (2 shared CPU cores, a test suite running beside it):
# measured 1.9 s to read 45 MB of metrics.jsonl and 0.2 s to render, 0.27 MB of HTML.
BIG_RUN_SECONDS = 15.0
BIG_RUN_MAX_BYTES = 3_000_000


def build_run(
    root: Path, *, name: str = "synthetic", lr: float = 1e-3, max_length: int = 64, end: str = "finished"
) -> Path:
    """A run directory as `lmforge train` leaves it: config, manifest, metrics with a NaN step and
    evals, events (skip, rollback, OOM back-off, stall, alert), data report, one complete and one
    interrupted checkpoint, final/ and export/export.json."""
    run = root / name
    (run / "events").mkdir(parents=True)
    config = {
        "run": {"name": name, "output_dir": str(root), "seed": 0},
        "model": {"preset": "llama-tiny", "path": CONFIG_XSS, "dtype": "float32"},
        "data": {"train": [{"path": "train.jsonl"}], "max_length": max_length, "packing": True},
        "train": {"stage": "sft", "method": "lora", "lr": lr, "max_steps": 40},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (run / "manifest.json").write_text(json.dumps({"created": "2026-11-22T10:00:00+0000", "hardware": {}}))
    records = []
    for step in range(1, 41):
        record: dict[str, Any] = {
            "step": step,
            "loss": 4.0 * math.exp(-step / 15) + 1.0,
            "lr": lr,
            "grad_norm": 1.0 + 0.01 * step,
            "tokens_per_s": 2800.0,
            "mfu": 0.02,
            "rss_gb": 0.5,
            "data_wait_share": 0.05,
            "tokens_seen": 256 * step,
        }
        if step == 20:
            record.update(loss="nan", grad_norm="inf")  # how metrics.jsonl stores them
        if step % 10 == 0:
            record.update(eval_loss=record["loss"] if step != 20 else 2.5, eval_ppl=10.0)
        records.append(record)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    t0 = 1_795_000_000.0
    events = [
        {
            "time": t0 + 20,
            "step": 20,
            "kind": "nonfinite",
            "message": "step 20: non-finite loss",
            "action": "skip",
        },
        {"time": t0 + 21, "step": 20, "kind": "skip", "message": EVENT_XSS, "action": "skip"},
        {"time": t0 + 30, "step": 30, "kind": "rollback", "message": "rolled back to step-25"},
        {"time": t0 + 33, "step": 33, "kind": "oom_backoff", "message": "micro-batch 8 now runs as 2 chunks"},
        {"time": t0 + 35, "step": -1, "kind": "stall", "message": "no progress for 300 s"},
        {"time": t0 + 36, "step": 36, "kind": "alert_sent", "message": "alert sent to slack"},
        {"time": t0 + 40, "step": 40, "kind": end, "message": f"{end} after 40 steps"},
    ]
    (run / "events" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "data_report.json").write_text(json.dumps(DATA_REPORT))
    _checkpoints(run)
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text("{}")
    (run / "export").mkdir()
    (run / "export" / "export.json").write_text(json.dumps(EXPORT))
    return run


def _checkpoints(run: Path) -> None:
    staging = run / "checkpoints" / ".staging"
    staging.mkdir(parents=True)
    (staging / "model.safetensors").write_bytes(b"weights")
    commit_checkpoint(staging, run / "checkpoints" / "step-25", step=25)
    write_best(run / "checkpoints", {"step": 25, "metric": "eval_loss", "value": 1.9, "path": "step-25"})
    torn = run / "checkpoints" / "step-40"  # a save interrupted before its marker
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"half")


DATA_REPORT = {
    "rows": {
        "rows_read": 120,
        "rows_kept": 110,
        "rows_bad": 10,
        "bad_by_reason": {"missing column 'output'": 10},
    },
    "dropped": {"over_length": 4},
    "train": {
        "samples": 100,
        "tokens": 3000,
        "length_p50": 30.0,
        "length_max": 64,
        "packing": {"rows": 52, "samples": 100, "efficiency": 0.9123},
        "length_histogram": {"edges": [0, 16, 32, 48, 64], "counts": [10, 50, 30, 10]},
    },
    "eval": {"samples": 6, "tokens": 180, "length_p50": 29.0},
}
PARITY = {"top1_agreement": 0.98972, "logits_max_abs_diff": 0.00637, "ppl_artifact": 397.707}
EXPORT = {
    "source": "final",
    "reference": "final",
    "artifacts": {
        "safetensors": {
            "dir": "export/safetensors",
            "dtype": "bf16",
            "verification": {
                "passed": True,
                "failures": [],
                "runtime": "transformers",
                "integrity": {"status": "ok"},
                "parity": {**PARITY, "ppl_reference": 397.737, "greedy_prefix": 1.0},
            },
        },
        "gguf": {
            "dir": "export/gguf",
            "dtype": "q8_0",
            "verification": {
                "passed": False,
                "failures": ["top-1 agreement 0.41 < 0.9"],
                "runtime": "llama.cpp",
                "integrity": {"status": "ok"},
                "parity": {"top1_agreement": 0.41},
            },
        },
    },
}


def test_report_has_every_section_event_markers_and_verdicts(tmp_path: Path) -> None:
    out = write_report(build_run(tmp_path))
    assert out == tmp_path / "synthetic" / "report.html"
    page = out.read_text()
    for section in SECTIONS:
        assert f"<h2>{section}</h2>" in page
    charts = set(re.findall(r'<svg class="plot" data-metric="([^"]+)"', page))
    expected = {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory", "data_wait_share"}
    assert expected | {"length_histogram_train"} <= charts
    loss_chart = re.search(r'<svg class="plot" data-metric="loss".*?</svg>', page, re.S)
    assert loss_chart is not None
    for kind, step in (("nonfinite", 20), ("skip", 20), ("rollback", 30), ("oom_backoff", 33), ("stall", 35)):
        assert f'data-kind="{kind}" data-step="{step}"' in loss_chart.group(0)  # stall: step from its time
    assert 'class="nonfinite"' in loss_chart.group(0) and "step 20: train loss = nan" in loss_chart.group(0)
    assert loss_chart.group(0).count('class="series"') == 3  # train loss broken at the NaN, eval loss
    assert "<circle" in loss_chart.group(0)  # eval points
    assert "finished" in page and "status ok" in page
    assert "0.9123" in page and "missing column &#x27;output&#x27;" in page and "dropped: over_length" in page
    checkpoints = re.search(r'<table class="checkpoints">.*?</table>', page, re.S)
    assert checkpoints is not None
    rows = checkpoints.group(0).split("<tr>")[1:]
    assert "40" in rows[1] and "FAIL" in rows[1] and "no completion marker" in rows[1]
    assert "25" in rows[2] and "PASS" in rows[2] and "sha256 verified" in rows[2] and "best" in rows[2]
    export = re.search(r'<table class="export">.*?</table>', page, re.S)
    assert export is not None
    assert "0.9897" in export.group(0) and "397.7" in export.group(0) and "PASS" in export.group(0)
    assert "FAIL" in export.group(0) and "top-1 agreement 0.41 &lt; 0.9" in export.group(0)
    assert "max_length: 64" in page  # the resolved config, as written


def test_untrusted_text_is_escaped_and_the_page_loads_nothing(tmp_path: Path) -> None:
    page = write_report(build_run(tmp_path)).read_text()
    assert "<script" not in page.lower() and "<img" not in page
    assert "&lt;script&gt;alert(&#x27;config&#x27;)&lt;/script&gt;" in page  # config value, shown as text
    assert "&lt;script&gt;alert(&quot;event&quot;)&lt;/script&gt;" in page  # event message, shown as text
    tags = re.findall(r"<[^>]+>", page)  # markup only: the escaped text above has no "<"
    assert not [t for t in tags if re.search(r"^<(link|iframe|object|embed)\b|\b(src|href)\s*=", t, re.I)]
    style = page.split("<style>")[1].split("</style>")[0]
    assert "url(" not in style and "@import" not in style  # no font or image fetched either


def test_status_comes_from_the_last_end_event() -> None:
    def status(*kinds: str, final: bool = True, metrics: bool = True, last: float | None = 0.0) -> str:
        events = [{"kind": kind, "step": i} for i, kind in enumerate(kinds)]
        return run_status(events, has_final=final, has_metrics=metrics, last_write=last)

    assert status("nonfinite", "finished") == "finished"
    assert status("signal", "finished") == "finished"  # interrupted, then resumed to the end
    assert status("finished", "failed") == "failed"
    assert status("stopped") == "stopped"
    assert status("signal") == "interrupted"
    assert status("finished", final=False) == "finished (no final/)"
    assert status(final=False) == "incomplete"  # killed: no end event, nothing written lately
    assert status(final=False, last=time.time()) == "running"
    assert status(final=False, metrics=False, last=None) == "prepared"


def test_downsampling_keeps_extremes_nonfinite_points_and_event_steps() -> None:
    rng = np.random.default_rng(0)
    n = 100_000
    steps = np.arange(1, n + 1)
    values = rng.normal(2.0, 0.1, n)
    values[12_345], values[54_321], values[70_000], values[80_000] = 50.0, -50.0, np.nan, np.inf
    kept = downsample(steps, values, keep_steps=np.array([33_333]))
    assert len(kept) <= 2 * MAX_BUCKETS + 10
    assert {12_345, 54_321, 70_000, 80_000, 0, n - 1} <= set(kept.tolist())
    assert 33_332 in kept  # index of step 33,333
    for lo in range(0, n, n // 10):  # every stretch of the run is still drawn
        assert np.any((kept >= lo) & (kept < lo + n // 10))


def test_a_100k_step_run_renders_in_seconds_and_stays_small(tmp_path: Path) -> None:
    run = tmp_path / "big"
    (run / "events").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"run": {"name": "big"}, "train": {"stage": "pretrain"}}))
    rng = random.Random(0)
    with open(run / "metrics.jsonl", "w") as handle:
        for step in range(1, 100_001):
            record: dict[str, Any] = {
                "step": step,
                "loss": 2 + 3 * math.exp(-step / 20_000) + rng.random() * 0.1,
                "lr": 3e-4,
                "grad_norm": rng.random(),
                "tokens_per_s": 40_000 + rng.random() * 1000,
                "step_time_s": 0.1,
                "mfu": 0.4,
                "rss_gb": 3.2,
                "data_wait_share": rng.random() * 0.05,
                "tokens_seen": step * 4096,
                "skipped_steps": 0,
            }
            if step % 1000 == 0:
                record["eval_loss"] = record["loss"]
            if step == 61_234:
                record["loss"] = "nan"
            if step == 77_777:
                record["loss"] = 1e4  # a spike a mean-per-bucket downsampler would flatten
            handle.write(json.dumps(record) + "\n")
    (run / "events" / "events.jsonl").write_text(
        json.dumps({"time": 1.0, "step": 61_234, "kind": "nonfinite", "message": "nan"}) + "\n"
    )
    started = time.perf_counter()
    page = write_report(run).read_text()
    elapsed = time.perf_counter() - started
    assert elapsed < BIG_RUN_SECONDS, f"report of 100k steps took {elapsed:.1f} s"
    assert len(page.encode()) < BIG_RUN_MAX_BYTES
    assert "step 61234: train loss = nan" in page and 'data-step="61234"' in page
    assert "(log scale)" in page  # the 1e4 spike is kept, so loss spans >200x: drawn on a log axis


def test_compare_shows_config_differences_and_every_curve(tmp_path: Path) -> None:
    a = build_run(tmp_path, name="lr-low", lr=1e-4)
    b = build_run(tmp_path, name="lr-high", lr=3e-4, max_length=128)
    page = write_comparison([a, b], tmp_path / "compare.html").read_text()
    diff = re.search(r'<table class="diff">.*?</table>', page, re.S)
    assert diff is not None
    rows = {row.split("</td>")[0].removeprefix("<td>"): row for row in diff.group(0).split("<tr>")[2:]}
    assert set(rows) == {"train.lr", "data.max_length"}  # run.name / output_dir differ but say nothing
    assert "0.0001" in rows["train.lr"] and "0.0003" in rows["train.lr"]
    assert "64" in rows["data.max_length"] and "128" in rows["data.max_length"]
    loss = re.search(r'<svg class="plot" data-metric="compare_loss".*?</svg>', page, re.S)
    assert loss is not None and ">lr-low<" in loss.group(0) and ">lr-high<" in loss.group(0)
    assert len(set(re.findall(r'class="series" fill="none" stroke="([^"]+)"', loss.group(0)))) == 2


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command("report")(report)
    app.add_typer(runs_app, name="runs")
    return app


def test_runs_lists_every_run_with_its_status(tmp_path: Path) -> None:
    build_run(tmp_path, name="good")
    build_run(tmp_path, name="broken", end="failed")
    (tmp_path / "not-a-run").mkdir()
    rows = {row.name: row for row in list_runs(tmp_path)}
    assert set(rows) == {"good", "broken"}
    assert rows["good"].status == "finished" and rows["broken"].status == "failed"
    assert rows["good"].steps == 40 and rows["good"].stage == "sft"
    assert rows["good"].best_eval_metric == "eval_loss" and rows["good"].best_eval_value == 1.9
    result = CliRunner().invoke(_cli(), ["runs", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert {r["name"]: r["status"] for r in json.loads(result.output)} == {
        "good": "finished",
        "broken": "failed",
    }
    table = CliRunner().invoke(_cli(), ["runs", str(tmp_path)], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "broken" in table.output and "failed" in table.output


def test_cli_report_and_compare_write_their_pages(tmp_path: Path) -> None:
    a, b = build_run(tmp_path, name="a"), build_run(tmp_path, name="b", lr=5e-4)
    result = CliRunner().invoke(_cli(), ["report", str(a), "--out", str(tmp_path / "a.html")])
    assert result.exit_code == 0, result.output
    assert "<h2>Curves</h2>" in (tmp_path / "a.html").read_text()
    out = tmp_path / "ab.html"
    result = CliRunner().invoke(_cli(), ["runs", "compare", str(a), str(b), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "train.lr" in out.read_text()
    missing = CliRunner().invoke(_cli(), ["report", str(tmp_path / "nothing")])
    assert isinstance(missing.exception, UserInputError) and "not a run directory" in str(missing.exception)


@pytest.fixture(scope="module")
def nan_drill_run(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:  # noqa: F811
    """A real 12-step run (about 10 s here) with evals and a NaN drill at step 7, rolled back to step-4."""
    from lmforge.config import load_config
    from lmforge.train.runner import run_training

    root = tmp_path_factory.mktemp("nan-drill")
    base = config(
        root,
        corpus,
        name="nan-drill",
        faults=[{"kind": "nan", "step": 7}],
        guard={"nonfinite": "rollback"},
        max_steps=12,
        eval_every=5,
        save_every=4,
    )
    base["data"]["eval_fraction"] = 0.05
    return run_training(load_config(None, base=base)).run_dir


def test_report_of_a_real_run_with_a_nan_drill(nan_drill_run: Path) -> None:
    page = write_report(nan_drill_run).read_text()
    for section in SECTIONS:
        assert f"<h2>{section}</h2>" in page
    assert 'data-kind="nonfinite" data-step="7"' in page and 'data-kind="rollback" data-step="7"' in page
    assert 'data-metric="length_histogram_train"' in page  # the data stage records document lengths
    assert "step 7: train loss = nan" in page
    run = load_run(nan_drill_run)
    assert run.status == "finished" and run.last_step == 12
    assert "eval_loss" in run.series and all(c.complete for c in run.checkpoints)
    assert page.count('<span class="pass">PASS</span>') >= len(run.checkpoints) >= 1


def test_length_histogram_bins_are_powers_of_two() -> None:
    from lmforge.data.stats import LengthHistogram, length_histogram

    assert length_histogram(np.array([1, 2, 3, 4, 7, 8, 100])) == {
        "edges": [1, 2, 4, 8, 16, 32, 64, 128],
        "counts": [1, 2, 2, 1, 0, 0, 1],
    }
    streamed = LengthHistogram()
    for part in ([1, 2, 3], [4, 7], [8, 100]):
        streamed.add(np.array(part))
    assert streamed.to_json() == length_histogram(np.array([1, 2, 3, 4, 7, 8, 100]))


@pytest.mark.parametrize(
    ("distributed", "expected"),
    [
        ({"engine": "none", "world_size": 1, "zero_stage": None}, "single process on CPU (2 cores)"),
        ({"engine": "ddp", "world_size": 2, "zero_stage": None}, "ddp x 2 processes on CPU (2 cores)"),
        (
            {"engine": "deepspeed", "world_size": 2, "zero_stage": 3},
            "deepspeed ZeRO-3 x 2 processes on CPU (2 cores)",
        ),
        (
            {"engine": "fsdp", "world_size": 4, "zero_stage": None, "layout": {"data": 2, "tensor": 2}},
            "fsdp x 4 processes (mesh: data 2 x tensor 2) on CPU (2 cores)",
        ),
    ],
)
def test_strategy_line_is_the_engine_the_manifest_recorded(
    tmp_path: Path, distributed: dict[str, Any], expected: str
) -> None:
    # The config says strategy auto with ZeRO-2 defaults; the run used what manifest.json records.
    run = build_run(tmp_path)
    manifest = {
        "created": "2026-11-22T10:00:00+0000",
        "hardware": {"cpu_count": 2},
        "distributed": distributed,
    }
    (run / "manifest.json").write_text(json.dumps(manifest))
    page = write_report(run).read_text()
    assert f"<th>strategy</th><td>{expected}</td>" in page


def with_stage(run: Path, stage: str, **metrics: float) -> Path:
    """`run` as a `stage` run whose every step recorded `metrics` (TRL's names; "/" as "__")."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["train"]["stage"] = stage
    config["data"].pop("packing")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record.update({key.replace("__", "/"): value for key, value in metrics.items()})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_each_stage_family_gets_its_section_under_its_own_title_only_when_recorded(tmp_path: Path) -> None:
    """GRPO's and DPO's metrics share TRL's `rewards/` prefix: each goes under its stage's title."""
    plain = write_report(build_run(tmp_path, name="plain")).read_text()
    assert "<h2>Reinforcement learning</h2>" not in plain and "<h2>Mixture of experts</h2>" not in plain
    assert "<h2>Preference optimisation" not in plain
    rl_moe = build_run(tmp_path, name="rl-moe")
    moe = {"moe_load_imbalance": 1.2, "aux_loss": 0.03}
    page = write_report(
        with_stage(rl_moe, "grpo", reward=0.1, kl=0.01, rewards__exact_match__mean=0.5, **moe)
    ).read_text()
    rl = page.split("<h2>Reinforcement learning</h2>")[1].split("<h2>")[0]
    moe_section = page.split("<h2>Mixture of experts</h2>")[1].split("<h2>")[0]
    assert set(re.findall(r'data-metric="stage_([^"]+)"', rl)) == {"kl", "reward", "rewards/exact_match/mean"}
    assert set(re.findall(r'data-metric="stage_([^"]+)"', moe_section)) == {"aux_loss", "moe_load_imbalance"}
    dpo = {"rewards__chosen": 0.2, "rewards__margins": 0.3, "rewards__accuracies": 0.7, "logps__chosen": -9.0}
    page = write_report(with_stage(build_run(tmp_path, name="dpo"), "dpo", **dpo)).read_text()
    assert "<h2>Reinforcement learning</h2>" not in page
    section = page.split("<h2>Preference optimisation: pair accuracy, margin and implicit rewards</h2>")[1]
    charted = re.findall(r'data-metric="stage_([^"]+)"', section.split("<h2>")[0])
    assert charted == ["rewards/accuracies", "rewards/margins", "rewards/chosen", "logps/chosen"]
