"""A stream's DataLoader, and its position saved with every checkpoint for an exact resume.

A map-style dataset (the cache, the token store) resumes by HF's own means: the seeded sampler
is replayed and the batches already trained on are skipped. A stream cannot be skipped through
cheaply (the skipped part would be read and tokenized again), so its position is saved instead:
torchdata's `StatefulDataLoader` asks the stream (in each worker) for its state after every batch
it yields, and that state goes into the checkpoint, one JSON file per rank. On resume the loader
is given it back before the first batch and HF's skip is turned off (`ignore_data_skip`).

Each rank reads its own part of the stream (the stream splits itself by data-parallel rank and
worker), so the loader is built here, not by accelerate, which would split it a second time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lmforge.data.streaming.report import reader_states
from lmforge.errors import CheckpointError, UserInputError

STATE_DIR = "data_state"


def is_stream(dataset: Any) -> bool:
    """A dataset read in order without an index: it has a position instead of a length."""
    return isinstance(dataset, torch.utils.data.IterableDataset)


def stream_loader(dataset: Any, args: TrainingArguments, collator: Any) -> StatefulDataLoader:
    """The training DataLoader of a stream, with the Trainer's batch size and worker settings."""
    workers = args.dataloader_num_workers
    return StatefulDataLoader(
        dataset,
        batch_size=args.per_device_train_batch_size,
        collate_fn=collator,
        num_workers=workers,
        pin_memory=args.dataloader_pin_memory,
        prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        persistent_workers=args.dataloader_persistent_workers if workers > 0 else False,
    )


def _state_file(checkpoint: str | Path, rank: int) -> Path:
    return Path(checkpoint) / STATE_DIR / f"rank-{rank:05d}.json"


def save_stream_position(
    position: dict[str, Any], checkpoint: str | Path, *, rank: int, world_size: int
) -> None:
    """Write this rank's stream position (the loader's `state_dict()` where the checkpointed step
    ended) into the checkpoint being saved, before it is sealed with its hash manifest."""
    target = _state_file(checkpoint, rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    state = {"world_size": world_size, "rank": rank, "workers": _workers(position), "loader": position}
    target.write_text(json.dumps(state), encoding="utf-8")


def restore_stream_position(
    loader: StatefulDataLoader, checkpoint: str | Path, *, rank: int, world_size: int
) -> None:
    """Put the loader back where this rank's stream was when `checkpoint` was saved. A checkpoint
    of another world size or worker count is refused: each rank's position is a place in its own
    part of the stream, and those parts are cut by rank and worker."""
    source = _state_file(checkpoint, rank)
    if not source.is_file():
        raise UserInputError(
            f"{checkpoint} holds no stream position for rank {rank} ({source.name} is missing): it was not "
            "written by a streaming run of this world size. Fix: resume it with the data settings and number "
            "of processes that wrote it, or start a new run (a new run.name)."
        )
    saved = json.loads(source.read_text(encoding="utf-8"))
    if "loader" not in saved:
        raise CheckpointError(f"{source}: not a stream position lmforge wrote (no 'loader' entry)")
    if saved["world_size"] != world_size or saved["workers"] != loader.num_workers:
        raise UserInputError(
            f"{checkpoint} was written by a streaming run of {saved['world_size']} process(es) with "
            f"{saved['workers']} dataloader worker(s) each; this run has {world_size} and {loader.num_workers}. "
            "A stream is split by rank and worker, so its position cannot be carried to another split exactly. "
            f"Fix: resume with {saved['world_size']} process(es) and train.dataloader_workers={saved['workers']}, "
            "or use data.store (a map-style token store resumes on any world size)."
        )
    loader.load_state_dict(saved["loader"])


def _workers(position: dict[str, Any]) -> int:
    """Dataloader workers of a saved loader state: one snapshot per worker (none without workers)."""
    snapshot = position.get("_snapshot") or {}
    return len(snapshot.get("_worker_snapshots") or {})


class StreamReportCallback(TrainerCallback):
    """data_report.json of a streaming run, rewritten at each logged step and at the end from what
    every rank's stream has read so far (counts, lengths, bad rows, the mix and its epochs).
    A collective at logged steps: every rank sends its states to rank 0, which writes the file."""

    def __init__(
        self, path: Path, before: dict[str, Any], report: Callable[[list[dict[str, Any]]], dict[str, Any]]
    ) -> None:
        self.path, self.before, self.report = path, before, report

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._write(state, kw.get("train_dataloader"))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._write(state, kw.get("train_dataloader"))

    def _write(self, state: TrainerState, loader: Any) -> None:
        if not isinstance(loader, StatefulDataLoader):
            return
        states = reader_states(loader.state_dict())
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, states)  # small JSON-safe dicts between lmforge's own ranks
            states = [one for rank_states in gathered for one in rank_states]
        if state.is_world_process_zero and states:
            report = {**self.report(states), **self.before}  # the eval split is the cache's
            partial = self.path.with_suffix(".json.partial")
            partial.write_text(json.dumps(report, indent=2), encoding="utf-8")
            partial.replace(self.path)  # a reader never sees half a report
