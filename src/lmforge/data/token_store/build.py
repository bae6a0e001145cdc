"""`build_token_store`: tokenize a config's sources into a sharded token store with datatrove.

The input files of every source are dealt to `tasks` tasks; each task writes one shard per
file (see shards.py). Finished tasks are recorded by datatrove (`logs/completions/`), so a
re-run after a failure or a kill redoes only the unfinished ones. The manifest is written
last, once every shard is complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

from datatrove.executor.base import PipelineExecutor
from rich.console import Console
from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import DataConfig, TokenStoreConfig
from lmforge.data.encoding import untruncated
from lmforge.data.text import eos_id
from lmforge.data.token_store.executors import LOGS_DIR, make_executor, run_quietly, write_slurm_script
from lmforge.data.token_store.layout import MANIFEST, input_files, store_fingerprint, store_location
from lmforge.data.token_store.manifest import collect_shards, write_manifest
from lmforge.data.token_store.pipeline import (
    PLAN_FILE,
    TOKENIZER_DIR,
    InputFile,
    TokenizeShards,
    files_of_task,
    read_plan,
    write_plan,
)
from lmforge.data.token_store.shards import read_sidecar, shard_stem
from lmforge.data.tokenizer import tokenizer_fingerprint
from lmforge.errors import UserInputError

ExecutorKind = Literal["local", "slurm", "ray"]
_console = Console(stderr=True, highlight=False, soft_wrap=True)  # paths unbroken


def build_token_store(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    cache_dir: Path,
    executor: ExecutorKind | None = None,
    tasks: int | None = None,
    workers: int | None = None,
    dry_run: bool = False,
) -> Path:
    """Build (or finish building) the token store of `cfg`'s sources; returns its directory.

    `executor`, `tasks` and `workers` override data.store's. With `dry_run` nothing is
    tokenized: the local executor's plan is printed, or the Slurm script is written to
    `<store>/logs/launch_script.slurm`, checked with `bash -n` and printed. A Slurm build
    returns once the job array is submitted; run it again when the job has finished to write
    the manifest. `seed` does not change the store (hold-out and mix are drawn when reading).
    """
    del seed  # one store serves every seed
    overrides = {"executor": executor, "tasks": tasks, "workers": workers}
    settings = TokenStoreConfig.model_validate(  # validated: --tasks 0 is refused like data.store.tasks: 0
        {
            **(cfg.store or TokenStoreConfig()).model_dump(),
            **{k: v for k, v in overrides.items() if v is not None},
        }
    )
    files = input_files(cfg)
    fingerprint = store_fingerprint(cfg, tokenizer, files)
    store = store_location(cfg, cache_dir, fingerprint)
    if (store / MANIFEST).is_file() and _plan_is(store, files) and not dry_run:
        _console.print(f"token store already built: {store}")
        return store
    pipeline = [TokenizeShards(str(store))]
    runner = make_executor(
        settings.executor,
        pipeline,  # type: ignore[arg-type]  # datatrove's list is invariant in its element type
        tasks=settings.tasks,
        workers=settings.workers,
        store=store,
        slurm=settings.slurm,
    )
    if dry_run:  # nothing in the store changes but the script under logs/
        _print_plan(store, files, settings, runner)
        return store
    tokenizer_fp = tokenizer_fingerprint(tokenizer)
    _stage(store, tokenizer, files, tokenizer_fp, eos_id(tokenizer), settings.tasks)
    _forget_stale_tasks(store, files, settings.tasks)
    if settings.executor == "slurm":
        _submit(runner)
    else:
        run_quietly(runner, store, _Progress(store, files, settings.tasks))
    shards = collect_shards(store, files)
    if shards is None:
        _console.print(
            f"token store {store}: tasks submitted or unfinished; run the same command again once they "
            "have finished to check the shards and write the manifest"
        )
        return store
    write_manifest(store, shards, fingerprint, tokenizer_fp, eos_id(tokenizer))
    _console.print(
        f"token store complete: {len(shards)} shards, {sum(s.info.tokens for s in shards):,} tokens in {store}"
    )
    return store


def _submit(runner: PipelineExecutor) -> None:
    """Submit the Slurm job array (its tasks run on the cluster); sbatch must be on PATH."""
    try:
        runner.run()
    except FileNotFoundError as err:
        raise UserInputError(
            f"data.store.executor slurm: {err.filename or 'sbatch'} was not found. Fix: run lmforge prepare on "
            "a Slurm login node, or add --dry-run to write the job script only."
        ) from None


def _plan_is(store: Path, files: list[InputFile]) -> bool:
    if not (store / PLAN_FILE).is_file():
        return False
    planned = read_plan(store).files
    return planned == files


def _planned_tasks(store: Path) -> int | None:
    marker = store / LOGS_DIR / "tasks.json"
    return int(json.loads(marker.read_text())["tasks"]) if marker.is_file() else None


def _stage(
    store: Path,
    tokenizer: PreTrainedTokenizerBase,
    files: list[InputFile],
    tokenizer_fp: str,
    eos_id: int,
    tasks: int,
) -> None:
    """The plan and the tokenizer the tasks read. Another task count deals the files anew, so
    datatrove's completion marks are cleared (complete shards of unchanged files are still kept)."""
    store.mkdir(parents=True, exist_ok=True)
    (store / MANIFEST).unlink(missing_ok=True)
    if _planned_tasks(store) != tasks:  # files are dealt anew: no completion mark holds
        shutil.rmtree(store / LOGS_DIR / "completions", ignore_errors=True)
        (store / LOGS_DIR).mkdir(parents=True, exist_ok=True)
        (store / LOGS_DIR / "tasks.json").write_text(json.dumps({"tasks": tasks}))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    write_plan(store, files, tokenizer_fp, eos_id, None if backend is None else untruncated(backend).to_str())
    saved = store / TOKENIZER_DIR
    if not saved.is_dir():
        tokenizer.save_pretrained(str(saved.with_name(TOKENIZER_DIR + ".tmp")))
        saved.with_name(TOKENIZER_DIR + ".tmp").rename(saved)


def _forget_stale_tasks(store: Path, files: list[InputFile], tasks: int) -> None:
    """A task marked complete by datatrove runs again when one of its shards is gone (deleted by
    hand after a damage report) or no longer matches its input file (changed on disk)."""
    for rank in range(tasks):
        mark = store / LOGS_DIR / "completions" / f"{rank:05d}"
        if mark.is_file() and not all(_shard_is_current(store, f) for f in files_of_task(files, rank, tasks)):
            mark.unlink()


def _shard_is_current(store: Path, item: InputFile) -> bool:
    info = read_sidecar(shard_stem(store, item.split, item.source, item.number))
    return info is not None and (info.input_path, info.input_size, info.input_mtime_ns) == (
        item.path,
        item.size,
        item.mtime_ns,
    )


class _Progress:
    """(tasks done, tokens written) read from the store: datatrove's completion marks and the
    sidecars of finished shards, each sidecar read once."""

    def __init__(self, store: Path, files: list[InputFile], tasks: int) -> None:
        self.completions = store / LOGS_DIR / "completions"
        self.pending = [shard_stem(store, f.split, f.source, f.number) for f in files]
        self.tasks, self.tokens = tasks, 0

    def __call__(self) -> tuple[int, int]:
        still_pending = []
        for stem in self.pending:
            info = read_sidecar(stem)
            if info is None:
                still_pending.append(stem)
            else:
                self.tokens += info.tokens
        self.pending = still_pending
        done = sum(1 for _ in self.completions.glob("*")) if self.completions.is_dir() else 0
        return min(done, self.tasks), self.tokens


def _print_plan(store: Path, files: list[InputFile], settings: TokenStoreConfig, runner: object) -> None:
    if settings.executor == "slurm":
        from datatrove.executor.slurm import SlurmPipelineExecutor

        assert isinstance(runner, SlurmPipelineExecutor)
        script = write_slurm_script(runner, store)
        _console.print(f"Slurm script (not submitted): {script}")
        print(script.read_text(encoding="utf-8"))
        return
    _console.print(
        f"token store {store}: {len(files)} input files, {settings.tasks} tasks ({settings.executor})"
    )
    for rank in range(settings.tasks):
        mine = files_of_task(files, rank, settings.tasks)
        _console.print(f"  task {rank}: {len(mine)} files" + (f", first {mine[0].path}" if mine else ""))
