"""The run directory (README.md, "The run directory"), by name: one torch-free definition that training, the
report, the doctor and evaluation all read (`lmforge runs` and `lmforge report` start in a
fraction of a second because nothing here imports torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    def deepspeed_config(self) -> Path:
        """The DeepSpeed config the engine ran with (generated, or the user's JSON resolved)."""
        return self.root / "deepspeed_config.json"

    @property
    def log_file(self) -> Path:
        """Everything logged, at full detail, upstream warnings included (the console stays short)."""
        return self.root / "train.log"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.root / "events"

    @property
    def eval_samples(self) -> Path:
        """Greedy completions of eval prompts at each eval step, one JSON line per sample with its step."""
        return self.root / "eval_samples.jsonl"

    @property
    def rl_samples(self) -> Path:
        """Online RL: sampled completions with their rewards at each logged step, one JSON line each."""
        return self.root / "rl_samples.jsonl"

    @property
    def rl_settings(self) -> Path:
        """Online RL: the update's settings as the TRL trainer resolved them (loss, ratios, sampling)."""
        return self.root / "rl_settings.json"

    @property
    def reference(self) -> Path:
        """Online RL with a KL term on a full fine-tune: the starting weights TRL loads as its reference."""
        return self.root / "reference"

    @property
    def adapter_audit(self) -> Path:
        """LoRA / DoRA / QLoRA: which modules and parameters got adapters, and their trainable parameters."""
        return self.root / "adapter_audit.json"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tb"

    @property
    def histograms(self) -> Path:
        """Per-tensor mean, std and abs max of weights and gradients at each histogram step."""
        return self.root / "histograms.jsonl"

    @property
    def profile(self) -> Path:
        """torch.profiler traces (Chrome/Perfetto JSON) and the top-ops table of the profiled window."""
        return self.root / "profile"

    @property
    def stacks(self) -> Path:
        """Every thread's stack, dumped by the stall watchdog."""
        return self.root / "stacks"

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
    def processor(self) -> Path:
        """A vision preset run's processor settings, saved at its start: what final/ and every
        checkpoint copy beside the model (a model.path run copies them from that folder)."""
        return self.root / "processor"

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
    def history(self) -> Path:
        """Each earlier launch's config.yaml and manifest.json, in history/launch-<k>/."""
        return self.root / "history"

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
            "eval_samples.jsonl",
            *("checkpoints", "final", "final.partial", "final.old", "export", "report.html", "stacks"),
            *(
                "deepspeed_config.json",
                "train.log",
                "bad_rows.jsonl",
                "tokenizer",
                "sinks.json",
                "wandb",
                "mlruns",
                "swanlog",
                "history",
                "histograms.jsonl",
                "profile",
                "rl_samples.jsonl",
                "reference",
                ".reference.tmp",
                "adapter_audit.json",
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


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file of a run directory, or {} when it is missing, unreadable or not an object
    (records a reader shows when present and does without otherwise)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
