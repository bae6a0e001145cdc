"""The run directory of PRODUCT.md: its paths, its resolved config and its manifest."""

from __future__ import annotations

import json
import os
import platform
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

from lmforge.ckpt.atomic import remove_within
from lmforge.config import LmforgeConfig, dump_config, redact
from lmforge.config.redact import redact_argv
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

    @property
    def final_partial(self) -> Path:
        """Where final/ is written before one rename puts it in place."""
        return self.root / "final.partial"

    @property
    def previous(self) -> Path:
        """Records of earlier attempts that ended before their first checkpoint, kept aside."""
        return self.root / "previous"

    @property
    def finished(self) -> Path:
        """Written inside final/ (so it exists exactly when final/ does): the step training ended at."""
        return self.final / FINISHED_NAME

    def owned(self) -> list[Path]:
        """What a training run writes here: the only entries lmforge ever moves or deletes."""
        names = [
            *("config.yaml", "manifest.json", "metrics.jsonl", "events", "tb", "data_report.json"),
            *("checkpoints", "final", "final.partial", "final.old", "export", "report.html", "stacks"),
            *(
                "deepspeed_config.json",
                "bad_rows.jsonl",
                "tokenizer",
                "sinks.json",
                "wandb",
                "mlruns",
                "swanlog",
            ),
        ]
        return [self.root / name for name in names]


FINISHED_NAME = "lmforge_finished.json"


def holds_training_run(paths: RunPaths) -> bool:
    """Whether training already wrote here (what `lmforge prepare` writes does not count)."""
    return any(p.exists() for p in (paths.metrics, paths.checkpoints, paths.final))


def read_finished(paths: RunPaths) -> dict[str, Any] | None:
    """{step, max_steps} of a finished run (its final/ is complete), else None."""
    try:
        record = json.loads(paths.finished.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def make_run_dir(paths: RunPaths) -> None:
    """Create the run directory, or say why it cannot be (a read-only or missing parent)."""
    try:
        paths.root.mkdir(parents=True, exist_ok=True)
        probe = paths.root / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UserInputError(
            f"cannot write the run directory {paths.root}: {err.strerror or err}; set run.output_dir to a "
            "writable directory"
        ) from None


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
