"""The run directory of PRODUCT.md: its paths, its resolved config and its manifest."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import torch
import yaml

from lmforge.config import LmforgeConfig, dump_config, redact
from lmforge.errors import UserInputError

TRACKED_PACKAGES = (
    "lmforge",
    "torch",
    "transformers",
    "datasets",
    "tokenizers",
    "safetensors",
    "accelerate",
    "peft",
    "pydantic",
    "numpy",
    "pyarrow",
)


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.root / "events"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tb"

    @property
    def data_report(self) -> Path:
        return self.root / "data_report.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def staging(self) -> Path:
        """Where HF Trainer writes a checkpoint before it is sealed and renamed into `checkpoints/`."""
        return self.checkpoints / ".staging"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def final(self) -> Path:
        return self.root / "final"

    @property
    def export(self) -> Path:
        return self.root / "export"


def holds_training_run(paths: RunPaths) -> bool:
    """Whether training already wrote here (what `lmforge prepare` writes does not count)."""
    return any(p.exists() for p in (paths.metrics, paths.checkpoints, paths.final))


def claim_run_dir(paths: RunPaths, *, resuming: bool, overwrite: bool) -> None:
    """Make sure a fresh run never mixes its files with an older run's."""
    if resuming or not holds_training_run(paths):
        paths.root.mkdir(parents=True, exist_ok=True)
        return
    if not overwrite:
        raise UserInputError(
            f"run directory {paths.root} already holds a run with no checkpoint to resume from; "
            "choose another run.name, or set run.overwrite=true to replace it"
        )
    shutil.rmtree(paths.root)
    paths.root.mkdir(parents=True)


def write_resolved_config(cfg: LmforgeConfig, paths: RunPaths) -> None:
    """config.yaml: the config as validated, defaults filled in, secrets redacted."""
    text = yaml.safe_dump(dump_config(cfg), sort_keys=False)
    paths.config.write_text(text, encoding="utf-8")


def write_manifest(paths: RunPaths, **fingerprints: Any) -> dict[str, Any]:
    """manifest.json: what produced this run (code, packages, hardware, data and tokenizer)."""
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv)),
        "git": _git_info(),
        "packages": _package_versions(),
        "python": sys.version.split()[0],
        "hardware": hardware_summary(),
        **fingerprints,
    }
    # The command line can carry an override with a secret in it: redact like every dump.
    manifest = redact(manifest)
    paths.manifest.write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest


def hardware_summary() -> dict[str, Any]:
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": gpus,
    }


def _package_versions() -> dict[str, str]:
    versions = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _git_info() -> dict[str, Any] | None:
    """Commit of the working directory's repository, and whether it had uncommitted changes."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(dirty)}
