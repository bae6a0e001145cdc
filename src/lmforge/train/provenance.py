"""What a resumed run changed since the launch that wrote its checkpoints, and a history of launches.

A resume continues the same optimisation. Settings that change its maths (model, tokenizer,
data, sequence length, batch and accumulation, optimizer and schedule, precision, seed) must be
the ones the checkpoints were trained with, or the run directory would describe steps it never
ran: such a change stops the run before any model is built, with the diff and the ways forward,
unless `train.resume_changed: allow` says it is meant (then it is recorded as an event). The
other settings (log and eval cadence, sinks, guardrails, exports, run length) may change freely
and are recorded too. Every launch's config.yaml and manifest.json are kept under history/.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from lmforge.config import LmforgeConfig, dump_config
from lmforge.config.dotted import flatten
from lmforge.config.recorded import read_recorded_config
from lmforge.errors import UserInputError
from lmforge.run_layout import RunPaths, read_json_object

# Dotted keys (and key prefixes) whose change alters the maths of the steps still to run.
MATHS_KEYS = (
    "model.",
    "tokenizer.",
    "data.train",
    "data.eval",
    "data.max_length",
    "data.packing",
    "data.padding_free",
    "data.chat_template",
    "data.train_on",
    "data.over_length",
    "data.eval_fraction",
    "train.stage",
    "train.method",
    "train.lora.",
    "train.freeze.",
    "train.dpo.",
    "train.kto.",
    "train.micro_batch_size",
    "train.grad_accum",
    "train.rl.",
    "train.rewards",
    "train.lr",
    "train.optimizer",
    "train.schedule",
    "train.min_lr_ratio",
    "train.decay_ratio",
    "train.warmup_steps",
    "train.warmup_ratio",
    "train.weight_decay",
    "train.adam_beta2",
    "train.max_grad_norm",
    "train.precision",
    "train.fp8.",  # the float8 recipe and which layers stay bf16
    "run.seed",
)
# Keys that say where and how to run, not what: never reported as changes.
IGNORED_KEYS = ("run.name", "run.output_dir", "run.overwrite", "train.resume", "train.resume_changed")
FINGERPRINTS = ("data_fingerprint", "tokenizer_fingerprint")


@dataclass(frozen=True)
class Change:
    key: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.key}: {_show(self.before)} -> {_show(self.after)}"


@dataclass(frozen=True)
class LaunchChanges:
    """What this launch changed against the one that wrote the run directory."""

    maths: list[Change]
    harmless: list[Change]


# The settings whose product with the data-parallel degree is the global batch.
BATCH_KEYS = ("train.micro_batch_size", "train.grad_accum")
GLOBAL_BATCH = "global batch (micro_batch_size x grad_accum x data-parallel processes)"


def changes_since_last_launch(
    cfg: LmforgeConfig, paths: RunPaths, fingerprints: dict[str, str], *, data_parallel: int = 1
) -> LaunchChanges:
    """The resolved config (`cfg`, precision already resolved) and the data / tokenizer
    fingerprints against the run directory's config.yaml and manifest.json. `data_parallel`: this
    launch's data-parallel degree, compared with the one manifest.json recorded, so that a resume on
    another number of processes with the same global batch is the same maths (and one that keeps
    micro-batch and accumulation but changes the global batch is not)."""
    recorded = read_recorded_config(paths.config)
    if not recorded.found:
        return LaunchChanges([], [])
    before, after = flatten(recorded.as_dict()), flatten(dump_config(cfg))
    maths: list[Change] = []
    harmless: list[Change] = []
    # The keys the run's config.yaml is written with: dump_config leaves out settings that do not
    # apply to the run (GRPO's loss variant under RLOO, vLLM's under transformers generation), which
    # the recorded side, read back through the schema, holds at their defaults.
    for key in sorted(after):
        if key.startswith(IGNORED_KEYS) or before.get(key) == after.get(key):
            continue
        if key == "train.precision" and before.get(key) == "auto":
            continue  # written before config.yaml recorded the resolved precision: unknown, not changed
        change = Change(key, before.get(key), after.get(key))
        (maths if key.startswith(MATHS_KEYS) else harmless).append(change)
    manifest = read_json_object(paths.manifest)
    maths, harmless = _judge_global_batch(before, after, manifest, data_parallel, maths, harmless)
    for name in FINGERPRINTS:
        old = manifest.get(name)
        if old is not None and old != fingerprints.get(name):
            maths.append(Change(name, old[:12], str(fingerprints.get(name))[:12]))
    return LaunchChanges(maths, harmless)


def _judge_global_batch(
    before: dict[str, Any],
    after: dict[str, Any],
    manifest: dict[str, Any],
    data_parallel: int,
    maths: list[Change],
    harmless: list[Change],
) -> tuple[list[Change], list[Change]]:
    """Micro-batch and accumulation matter through the global batch they make with the world: the
    same global batch on another number of processes runs the same steps (resharding resume)."""
    old_parallel = recorded_data_parallel(manifest)
    old_batch = _global_batch(before, old_parallel)
    new_batch = _global_batch(after, data_parallel)
    if old_batch is None or new_batch is None:
        return maths, harmless
    if old_batch == new_batch:
        moved = [c for c in maths if c.key in BATCH_KEYS]
        return [c for c in maths if c.key not in BATCH_KEYS], [*harmless, *moved]
    words = (f"{old_batch} on {old_parallel} process(es)", f"{new_batch} on {data_parallel} process(es)")
    return [*maths, Change(GLOBAL_BATCH, *words)], harmless


def _global_batch(flat: dict[str, Any], data_parallel: int) -> int | None:
    micro, accum = flat.get(BATCH_KEYS[0]), flat.get(BATCH_KEYS[1])
    if not isinstance(micro, int) or not isinstance(accum, int):
        return None
    return micro * accum * data_parallel


def recorded_data_parallel(manifest: dict[str, Any]) -> int:
    """The data-parallel degree of the launch that wrote manifest.json (world size / model-parallel
    degree; 1 for a manifest written before lmforge recorded its engine)."""
    summary = manifest.get("distributed")
    if not isinstance(summary, dict):
        return 1
    layout = summary.get("layout")
    if isinstance(layout, dict) and isinstance(layout.get("data"), int):
        return int(layout["data"])
    world = summary.get("world_size")
    return int(world) if isinstance(world, int) else 1


def refuse_unless_allowed(changes: LaunchChanges, cfg: LmforgeConfig, paths: RunPaths) -> None:
    """UserInputError with the diff and the ways forward when a maths setting changed and
    `train.resume_changed` does not allow it."""
    if not changes.maths or cfg.train.resume_changed == "allow":
        return
    lines = "\n".join(f"  {change}" for change in changes.maths)
    raise UserInputError(
        f"{paths.root} was trained with other settings than this run's, and resuming would mix them:\n"
        f"{lines}\n"
        "Fix: run with the settings it was trained with; or start a new run (run.name=<new name>, or "
        "run.overwrite=true to replace this one); or set train.resume_changed=allow to continue from the "
        "checkpoint with the new settings (recorded as a config_changed event and in history/)"
    )


def keep_launch_history(paths: RunPaths) -> None:
    """Move the previous launch's config.yaml and manifest.json to history/launch-<k>/ before this
    launch writes its own, so the run directory shows every launch's settings."""
    if not (paths.config.is_file() or paths.manifest.is_file()):
        return
    paths.history.mkdir(parents=True, exist_ok=True)
    number = 1 + sum(1 for entry in paths.history.iterdir() if entry.name.startswith("launch-"))
    target = paths.history / f"launch-{number}"
    target.mkdir()
    for record in (paths.config, paths.manifest):
        if record.is_file():
            os.replace(record, target / record.name)


def describe(changes: list[Change]) -> str:
    return "; ".join(str(change) for change in changes)


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value
