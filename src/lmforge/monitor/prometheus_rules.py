"""Files for operators of a Prometheus/Grafana stack: alerting rules, a dashboard, a scrape config.

`write_rules` (`lmforge monitor rules`) writes them. The expressions use only the names that
`lmforge.monitor.prometheus` exports (`EXPORTED_NAMES`; a test checks it), each series
labelled with its `run`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from lmforge.errors import UserInputError
from lmforge.monitor.prometheus import EVENTS_COUNTER


def write_rules(out_dir: Path) -> list[Path]:
    """Write Prometheus alerting rules, a Grafana dashboard and a scrape-config example into out_dir."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserInputError(f"--out {out_dir}: exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    rules = out_dir / "lmforge-alerts.rules.yml"
    rules.write_text(
        "# Prometheus alerting rules for lmforge runs (rule_files: in prometheus.yml).\n"
        + yaml.safe_dump(alert_rules(), sort_keys=False, width=200),
        encoding="utf-8",
    )
    dashboard = out_dir / "lmforge-dashboard.json"
    dashboard.write_text(json.dumps(grafana_dashboard(), indent=2) + "\n", encoding="utf-8")
    scrape = out_dir / "prometheus-scrape.yml"
    scrape.write_text(
        "# Add to prometheus.yml; one target per training process (rank) that serves /metrics.\n"
        + yaml.safe_dump(
            {
                "rule_files": [rules.name],
                "scrape_configs": [
                    {
                        "job_name": "lmforge",
                        "scrape_interval": "15s",
                        "static_configs": [{"targets": ["127.0.0.1:9400"]}],
                    }
                ],
            },
            sort_keys=False,
        ),
        encoding="utf-8",
    )
    return [rules, dashboard, scrape]


def _rule(name: str, expr: str, for_: str, severity: str, summary: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": "Run {{ $labels.run }}: " + summary},
    }


def _events(kind: str, window: str) -> str:
    return f'increase({EVENTS_COUNTER}{{kind="{kind}"}}[{window}]) > 0'


def alert_rules() -> dict[str, Any]:
    """Prometheus rule groups over the exported names only."""
    rules = [
        _rule(
            "LmforgeNonFinite",
            f"(lmforge_loss != lmforge_loss) or {_events('nonfinite', '10m')}",
            "0m",
            "critical",
            "NaN/inf loss or gradients (try train.precision=bf16, a lower train.lr).",
        ),
        _rule(
            "LmforgeStalled",
            f"changes(lmforge_step[15m]) == 0 or {_events('stall', '15m')}",
            "5m",
            "critical",
            "No optimizer step for 15 minutes (hung collective, dataloader or storage).",
        ),
        _rule(
            "LmforgeLossSpike",
            "(lmforge_loss - avg_over_time(lmforge_loss[1h])) > 6 * stddev_over_time(lmforge_loss[1h])"
            f" or {_events('spike', '15m')}",
            "0m",
            "warning",
            "Loss spike: more than 6 standard deviations above its last hour.",
        ),
        _rule(
            "LmforgeRollback",
            _events("rollback", "30m"),
            "0m",
            "warning",
            "The guardrails rolled the run back to its last checkpoint.",
        ),
        _rule(
            "LmforgeOomBackoff",
            _events("oom_backoff", "30m"),
            "0m",
            "warning",
            "Out of memory: the micro-batch was halved (throughput drops).",
        ),
        _rule(
            "LmforgeOomLadder",
            _events("oom_ladder", "1h"),
            "0m",
            "warning",
            "Out of memory at micro-batch 1: the run restarts from its last checkpoint with a memory saver on.",
        ),
        _rule(
            "LmforgeDataBound",
            "avg_over_time(lmforge_data_wait_share[10m]) > 0.3",
            "10m",
            "warning",
            "Over 30% of step time waits for data (raise train.dataloader_workers).",
        ),
        _rule(
            "LmforgeLowThroughput",
            "avg_over_time(lmforge_tokens_per_second[10m]) < 0.5 * max_over_time(lmforge_tokens_per_second[6h])",
            "15m",
            "warning",
            "Tokens per second fell below half of this run's best.",
        ),
        _rule(
            "LmforgeRunFailed",
            f"{_events('failed', '30m')} or {_events('stopped', '30m')}",
            "0m",
            "critical",
            "The run failed or was stopped by its guardrails.",
        ),
    ]
    return {"groups": [{"name": "lmforge", "rules": rules}]}


def grafana_dashboard() -> dict[str, Any]:
    """A Grafana dashboard (import it, pick the Prometheus data source and the run)."""
    panels = [
        ("Loss", ["lmforge_loss", "lmforge_eval_loss", "lmforge_loss_rank_max"]),
        ("Learning rate", ["lmforge_learning_rate"]),
        ("Gradient norm", ["lmforge_grad_norm", "lmforge_grad_clipped"]),
        ("Update / parameter ratio", ["lmforge_update_ratio"]),
        ("Tokens per second", ["lmforge_tokens_per_second"]),
        ("Step time (s)", ["lmforge_step_time_seconds"]),
        ("Data wait share / MFU", ["lmforge_data_wait_share", "lmforge_mfu"]),
        ("Step", ["lmforge_step"]),
        ("Process memory", ["lmforge_sys_process_rss_bytes", "lmforge_sys_children_rss_bytes"]),
        ("GPU memory", ["lmforge_sys_gpu_memory_used_bytes", "lmforge_sys_gpu_memory_reserved_bytes"]),
        ("GPU utilisation (%)", ["lmforge_sys_gpu_utilization_percent"]),
        ("CPU (%)", ["lmforge_sys_cpu_percent", "lmforge_sys_process_cpu_percent"]),
        (
            "Disk (bytes/s)",
            ["lmforge_sys_disk_read_bytes_per_second", "lmforge_sys_disk_write_bytes_per_second"],
        ),
        ("Skipped / non-finite steps", ["lmforge_skipped_steps", "lmforge_nonfinite_steps"]),
    ]
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    built: list[dict[str, Any]] = []
    for index, (title, names) in enumerate(panels):
        targets = [
            {"expr": f'{name}{{run=~"$run"}}', "legendFormat": f"{name} {{{{run}}}}", "refId": chr(65 + i)}
            for i, name in enumerate(names)
        ]
        grid = {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)}
        built.append(
            {
                "id": index + 1,
                "type": "timeseries",
                "title": title,
                "datasource": datasource,
                "gridPos": grid,
                "targets": targets,
            }
        )
    events = f'sum by (kind) (increase({EVENTS_COUNTER}{{run=~"$run"}}[$__rate_interval]))'
    built.append(
        {
            "id": len(built) + 1,
            "type": "timeseries",
            "title": "Events",
            "datasource": datasource,
            "gridPos": {"h": 8, "w": 24, "x": 0, "y": 8 * ((len(panels) + 1) // 2)},
            "targets": [{"expr": events, "legendFormat": "{{kind}}", "refId": "A"}],
        }
    )
    return {
        "title": "lmforge training",
        "uid": "lmforge-training",
        "schemaVersion": 39,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
                {
                    "name": "run",
                    "type": "query",
                    "datasource": datasource,
                    "query": "label_values(lmforge_step, run)",
                    "includeAll": True,
                    "multi": True,
                },
            ]
        },
        "panels": built,
    }
