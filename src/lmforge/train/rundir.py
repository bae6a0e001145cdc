"""The run directory (README.md, "The run directory"): its paths, its resolved config and its manifest."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import torch
import yaml

from lmforge.ckpt.atomic import remove_within, require_writable
from lmforge.config import LmforgeConfig, dump_config, redact
from lmforge.config.redact import redact_argv
from lmforge.run_layout import RunPaths

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


def make_run_dir(paths: RunPaths) -> None:
    """Create the run directory, or say why it cannot be (a read-only or missing parent)."""
    require_writable(paths.root, what="the run directory", fix="set run.output_dir to a writable directory")


def start_fresh(paths: RunPaths, *, keep_aside: bool) -> Path | None:
    """Clear what an earlier run wrote here so a fresh run never mixes with it.

    `keep_aside` moves those records to previous/<time>/ (an attempt that crashed before its first
    checkpoint: its logs may explain the crash); otherwise they are deleted (run.overwrite).
    Returns where they went. Only entries of `RunPaths.owned` are touched."""
    present = [p for p in paths.owned() if p.exists() or p.is_symlink()]
    if not present:
        return None
    if not keep_aside:
        for entry in present:
            remove_within(entry, paths.root)
        return None
    aside = paths.previous / time.strftime("%Y%m%d-%H%M%S")
    while aside.exists():
        aside = aside.with_name(aside.name + "-1")
    aside.mkdir(parents=True)
    for entry in present:
        os.rename(entry, aside / entry.name)
    return aside


def write_resolved_config(cfg: LmforgeConfig, paths: RunPaths) -> None:
    """config.yaml: the config as validated, defaults filled in, secrets redacted."""
    text = yaml.safe_dump(dump_config(cfg), sort_keys=False)
    paths.config.write_text(text, encoding="utf-8")


def write_manifest(paths: RunPaths, **fingerprints: Any) -> dict[str, Any]:
    """manifest.json: what produced this run (code, packages, hardware, data and tokenizer)."""
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(redact_argv([os.path.basename(sys.argv[0]), *sys.argv[1:]])),
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
