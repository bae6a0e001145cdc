"""The /metrics endpoint: real prometheus_client server on loopback, values scraped back over HTTP,
and rules/dashboard that use only exported names."""

from __future__ import annotations

import json
import logging
import math
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from lmforge.cli.monitor import monitor_app
from lmforge.config.schema import PrometheusConfig
from lmforge.monitor.events import EventLog
from lmforge.monitor.prometheus import EXPORTED_NAMES, METRICS, PrometheusExporter
from lmforge.monitor.prometheus_rules import write_rules

NAME = re.compile(r"\blmforge_[a-z0-9_]+\b")


@pytest.fixture()
def exporter() -> Iterator[PrometheusExporter]:
    exp = PrometheusExporter(PrometheusConfig(enabled=True, port=0), "demo")
    exp.start()
    yield exp
    exp.stop()


def _scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_scrape_values_and_event_counter(exporter: PrometheusExporter, tmp_path: Path) -> None:
    assert exporter.port and exporter.port > 0
    exporter.update({"step": 10, "loss": 2.5, "lr": 3e-4, "grad_norm": 1.25, "tokens_per_s": 2800.0})
    exporter.update({"step": 20, "loss": float("nan"), "rss_gb": 1.5, "eval_ppl": 12.0, "note": "x"})
    exporter.update({"sys_disk_write_mb_s": 2.0, "sys_gpu_util_percent": 97.0})
    events = EventLog(tmp_path / "events", listeners=[exporter.count_event])
    events.emit("nonfinite", 20, "loss is nan")
    events.emit("nonfinite", 21, "loss is nan")
    events.emit("rollback", 21, "back to step-10")

    got = _scrape(exporter.port)
    run = (("run", "demo"),)
    assert got["lmforge_step"][run] == 20
    assert math.isnan(got["lmforge_loss"][run])
    assert got["lmforge_learning_rate"][run] == pytest.approx(3e-4)
    assert got["lmforge_grad_norm"][run] == 1.25
    assert got["lmforge_tokens_per_second"][run] == 2800
    assert got["lmforge_eval_perplexity"][run] == 12
    assert got["lmforge_rss_bytes"][run] == 1.5e9  # exported in base units
    assert got["lmforge_sys_disk_write_bytes_per_second"][run] == 2e6
    assert got["lmforge_sys_gpu_utilization_percent"][run] == 97
    assert got["lmforge_last_update_timestamp_seconds"][run] > 1e9
    assert "lmforge_mfu" not in got  # never logged: no sample, not a misleading 0
    counts = got["lmforge_events_total"]
    assert counts[(("kind", "nonfinite"), ("run", "demo"))] == 2
    assert counts[(("kind", "rollback"), ("run", "demo"))] == 1
    assert counts[(("kind", "stall"), ("run", "demo"))] == 0  # known kinds exist from the start
    assert set(got) - {n for n in got if n.endswith("_created")} <= EXPORTED_NAMES


def test_listens_on_loopback_only(exporter: PrometheusExporter) -> None:
    server = exporter._server
    assert server.socket.getsockname()[0] == "127.0.0.1"
    exporter.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=2)


def test_non_loopback_host_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    PrometheusExporter(PrometheusConfig(host="0.0.0.0", port=0), "demo")  # not started: nothing is exposed
    assert any("0.0.0.0" in r.getMessage() and "other machines" in r.getMessage() for r in caplog.records)
    caplog.clear()
    PrometheusExporter(PrometheusConfig(host="::1", port=0), "demo")
    PrometheusExporter(PrometheusConfig(host="localhost", port=0), "demo")
    assert not caplog.records


def test_busy_port_is_a_user_error(exporter: PrometheusExporter) -> None:
    from lmforge.errors import UserInputError

    other = PrometheusExporter(PrometheusConfig(port=exporter.port or 0), "demo")
    with pytest.raises(UserInputError, match="monitor.prometheus"):
        other.start()


def test_rules_and_dashboard_use_only_exported_names(tmp_path: Path) -> None:
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names)) and len({m.key for m in METRICS}) == len(METRICS)
    assert all(re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", n) for n in names)
    paths = write_rules(tmp_path)
    assert [p.name for p in paths] == [
        "lmforge-alerts.rules.yml",
        "lmforge-dashboard.json",
        "prometheus-scrape.yml",
    ]
    rules = yaml.safe_load(paths[0].read_text())
    alerts = {r["alert"]: r for r in rules["groups"][0]["rules"]}
    for expected in (
        "LmforgeNonFinite",
        "LmforgeStalled",
        "LmforgeLossSpike",
        "LmforgeDataBound",
        "LmforgeLowThroughput",
    ):
        assert expected in alerts and alerts[expected]["expr"] and alerts[expected]["labels"]["severity"]
    dashboard = json.loads(paths[1].read_text())
    assert dashboard["panels"] and all(p["targets"] for p in dashboard["panels"])
    used: set[str] = set()
    for path in paths[:2]:
        used |= set(NAME.findall(path.read_text()))
    assert used, "no metric names found"
    assert used <= EXPORTED_NAMES, used - EXPORTED_NAMES
    # The rules cover the failure modes they promise.
    for name in ("lmforge_step", "lmforge_loss", "lmforge_data_wait_share", "lmforge_tokens_per_second"):
        assert name in used


def test_cli_monitor_rules(tmp_path: Path) -> None:
    out = tmp_path / "monitoring"
    result = CliRunner().invoke(monitor_app, ["rules", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "lmforge-alerts.rules.yml").is_file() and (out / "lmforge-dashboard.json").is_file()
    assert "wrote" in result.output
    help_text = CliRunner().invoke(monitor_app, ["rules", "--help"]).output
    assert "Example" in help_text

    blocker = tmp_path / "file"
    blocker.write_text("x")
    failed = CliRunner().invoke(monitor_app, ["rules", "--out", str(blocker)])
    assert failed.exit_code != 0 and "not a directory" in str(failed.exception)


def test_system_sampler_feeds_the_exporter(exporter: PrometheusExporter) -> None:
    import time

    from lmforge.monitor.system import SYSTEM_KEYS, SystemSampler

    assert set(SYSTEM_KEYS) <= {m.key for m in METRICS}  # every sampled key has an exported name
    sampler = SystemSampler(interval_s=0.05).start()
    try:
        deadline = time.monotonic() + 5
        while "sys_net_recv_mb_s" not in sampler.latest() and time.monotonic() < deadline:
            time.sleep(0.05)
        sample = sampler.latest()
    finally:
        sampler.stop()
    assert sampler._thread is None
    assert set(sample) <= set(SYSTEM_KEYS)
    for key in ("sys_cpu_percent", "sys_process_rss_gb", "sys_mem_available_gb", "sys_net_recv_mb_s"):
        assert key in sample and sample[key] >= 0
    assert 0.01 < sample["sys_process_rss_gb"] < 64
    if not _cuda_available():
        assert not any(key.startswith("sys_gpu") for key in sample)  # CPU machine: GPU keys are absent
    exporter.update(sample)
    got = _scrape(exporter.port or 0)
    assert got["lmforge_sys_process_rss_bytes"][(("run", "demo"),)] == pytest.approx(
        sample["sys_process_rss_gb"] * 1e9
    )


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())
