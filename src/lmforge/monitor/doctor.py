"""`lmforge doctor`: what this machine offers, and the whole report that adds a run's diagnosis.

`environment_report()` lists versions, devices, CPU, memory and disk, and
`environment_findings()` turns them into problems (no write access, little disk).
`doctor_report()` joins them with `diagnose_run()` (monitor/diagnosis.py) for a run directory.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from lmforge.config.recorded import read_recorded_config
from lmforge.monitor.diagnosis import diagnose_run
from lmforge.monitor.events import read_events
from lmforge.monitor.metrics import read_metrics
from lmforge.monitor.run_view import Finding
from lmforge.run_layout import RunPaths

GB = 1e9
PACKAGES = ("lmforge", "torch", "transformers", "peft", "trl", "deepspeed", "accelerate", "datasets")
LOW_DISK_GB = 10.0


def environment_report(run_dir: Path | None = None) -> dict[str, Any]:
    """Versions, accelerator, CPU, memory, and free space / write access of the cwd and run dir."""
    import torch

    from lmforge.distributed.devices import cpu_supports_bf16

    report: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "devices": [],
        "nccl_version": None,
        "bf16_supported": cpu_supports_bf16(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_total_gb": round(psutil.virtual_memory().total / GB, 1),
        "ram_available_gb": round(psutil.virtual_memory().available / GB, 1),
        "disks": [_disk(Path.cwd())] + ([_disk(run_dir)] if run_dir is not None else []),
    }
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            report["devices"].append(
                {
                    "name": props.name,
                    "memory_gb": round(props.total_memory / GB, 1),
                    "capability": f"{props.major}.{props.minor}",
                }
            )
        report["bf16_supported"] = bool(torch.cuda.is_bf16_supported())
        try:
            report["nccl_version"] = ".".join(str(part) for part in torch.cuda.nccl.version())
        except Exception:  # torch built without NCCL
            report["nccl_version"] = None
    return report


def environment_findings(env: dict[str, Any]) -> list[Finding]:
    """Problems of the machine itself: no write access, little disk."""
    findings = []
    for disk in env["disks"]:
        if not disk["writable"]:
            findings.append(
                Finding(
                    "not_writable",
                    "error",
                    f"cannot write to {disk['path']}",
                    "creating a file there failed",
                    ["run.output_dir=<a writable directory>"],
                )
            )
        elif disk["free_gb"] is not None and disk["free_gb"] < LOW_DISK_GB:
            findings.append(
                Finding(
                    "low_disk",
                    "warning",
                    f"little free disk at {disk['path']}",
                    f"{disk['free_gb']} GB free",
                    ["train.keep_last=1", "run.output_dir=<a larger disk>"],
                    "checkpoints hold weights and optimizer state (about 3x the fp32 model size each)",
                )
            )
    return findings


def doctor_report(run_dir: Path | None) -> dict[str, Any]:
    """The whole `lmforge doctor` answer as plain data (what --json prints)."""
    env = environment_report(run_dir)
    findings = environment_findings(env)
    summary: dict[str, Any] | None = None
    if run_dir is not None:
        findings += diagnose_run(run_dir)
        paths = RunPaths(run_dir)
        records = read_metrics(paths.metrics)
        kinds: dict[str, int] = {}
        for event in read_events(paths.events):
            kinds[str(event.get("kind"))] = kinds.get(str(event.get("kind")), 0) + 1
        summary = {
            "dir": str(run_dir),
            "records": len(records),
            "last_step": records[-1].get("step") if records else None,
            "events": kinds,
            # Keys of an older lmforge, values that no longer validate: read around, and said.
            "config_notes": list(read_recorded_config(paths.config).notes),
        }
    return {"environment": env, "run": summary, "findings": [asdict(f) for f in findings]}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _disk(path: Path) -> dict[str, Any]:
    """Free space and write access at path (or its nearest existing parent)."""
    probe = path.resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free: float | None = round(psutil.disk_usage(str(probe)).free / GB, 1)
    except OSError:
        free = None
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".lmforge-doctor-"):
            writable = True
    except OSError:
        writable = False
    return {"path": str(path), "free_gb": free, "writable": writable}
