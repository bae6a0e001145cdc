"""`lmforge monitor ...`: helpers for watching runs from outside (Prometheus, Grafana)."""

from __future__ import annotations

from pathlib import Path

import typer

from lmforge.cli.console import console

monitor_app = typer.Typer(
    help="Monitoring helpers: Prometheus alerting rules and a Grafana dashboard.", no_args_is_help=True
)


@monitor_app.callback()
def _group() -> None:
    """Monitoring helpers: Prometheus alerting rules and a Grafana dashboard."""
    # A callback keeps `monitor` a command group even while it has a single command.


@monitor_app.command("rules")
def rules(
    out: Path = typer.Option(
        ..., "--out", help="Directory to write the rules, dashboard and scrape example into."
    ),
) -> None:
    """Write Prometheus alerting rules, a Grafana dashboard and a scrape-config example.

    They use exactly the names that a run with `monitor.prometheus.enabled=true` exports.

    Example: `lmforge monitor rules --out monitoring/`
    """
    from lmforge.monitor.prometheus_rules import write_rules

    for path in write_rules(out):
        console.print(f"wrote {path}", markup=False)
