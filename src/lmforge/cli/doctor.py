"""`lmforge doctor [RUN_DIR]`: environment check, and a run's diagnosis from its metrics and events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from lmforge.cli.console import console

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def doctor(
    run_dir: Path | None = typer.Argument(
        None, help="A run directory (runs/\\<name>) to diagnose.", show_default=False
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """Check the environment; with RUN_DIR, diagnose the run from metrics.jsonl and events/.

    Each finding names the config change to try, as dotted key=value overrides. Exits 1 when a
    finding is an error (NaN steps, a rising loss, a stall, a failed run).

    Example: `lmforge doctor runs/sft --json`
    """
    from lmforge.monitor.doctor import doctor_report

    report = doctor_report(run_dir)
    # An error-level finding fails the command, so scripts and CI can act on it.
    failed = any(f["severity"] == "error" for f in report["findings"])
    if as_json:
        print(json.dumps(report, indent=2))
        if failed:
            raise typer.Exit(1)
        return
    _print_environment(report["environment"])
    if report["run"] is not None:
        run = report["run"]
        events = ", ".join(f"{kind} {count}" for kind, count in sorted(run["events"].items())) or "none"
        console.print(
            f"\nrun {run['dir']}: {run['records']} metrics records, last step {run['last_step']}, events: {events}",
            markup=False,
        )
        for note in run["config_notes"]:
            console.print(f"  note: {note}", markup=False)
    findings = report["findings"]
    if not findings:
        console.print("[green]no problems found[/]")
        return
    for finding in findings:
        console.print(
            f"\n[{_STYLE.get(finding['severity'], 'bold')}]{finding['severity']}[/] {finding['title']} ({finding['id']})"
        )
        console.print(f"  evidence: {finding['evidence']}", markup=False)
        if finding["changes"]:
            console.print(f"  try: {' '.join(finding['changes'])}", markup=False)
        if finding["advice"]:
            console.print(f"  why: {finding['advice']}", markup=False)
    if failed:
        raise typer.Exit(1)


def _print_environment(env: dict[str, Any]) -> None:
    table = Table(title="environment", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    rows: list[tuple[str, Any]] = [("python", env["python"]), ("platform", env["platform"])]
    rows += [(name, version or "not installed") for name, version in env["packages"].items()]
    rows += [
        ("CUDA", f"{env['cuda_version']}" if env["cuda_available"] else "not available"),
        (
            "devices",
            "; ".join(f"{d['name']} ({d['memory_gb']} GB, sm {d['capability']})" for d in env["devices"])
            or "CPU only",
        ),
        ("NCCL", env["nccl_version"] or "-"),
        ("bf16", "supported" if env["bf16_supported"] else "not supported"),
        ("CPUs", f"{env['cpu_usable']} usable of {env['cpu_count']}"),
        ("RAM", f"{env['ram_available_gb']} GB available of {env['ram_total_gb']} GB"),
    ]
    for disk in env["disks"]:
        access = "writable" if disk["writable"] else "NOT writable"
        rows.append((f"disk {disk['path']}", f"{disk['free_gb']} GB free, {access}"))
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
