"""`lmforge train` and `lmforge prepare`: a training job in this process (what every distributed
worker runs too), then its report; or the data stage alone."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from enum import Enum
from pathlib import Path
from types import FrameType
from typing import Any, cast

import typer

from lmforge.cli.ckpt import print_export
from lmforge.cli.console import OVERRIDES_HELP, VERBOSE_HELP, apply_verbosity, console
from lmforge.config import load_config
from lmforge.config.schema import TokenStoreConfig
from lmforge.distributed.worker_failures import record_worker_errors


class StoreExecutor(str, Enum):
    """The datatrove executors `lmforge prepare --executor` accepts (data.store.executor)."""

    local = "local"
    slurm = "slurm"
    ray = "ray"


@record_worker_errors  # a failed worker's error reaches `lmforge launch`
def train(
    config: Path = typer.Argument(..., help="YAML config file."),
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """Run a training job in this process.

    Example: `lmforge train examples/pretrain_tiny.yaml train.max_steps=50`
    """
    apply_verbosity(verbose)
    # Before the training stack is imported: a bad config, or a run this machine cannot do, is
    # answered in a second.
    cfg = load_config(config, overrides)
    from lmforge.train.preflight import check_machine_requirements, require_tested_versions

    check_machine_requirements(cfg)
    require_tested_versions()  # before the training stack imports a library lmforge was not tested on
    from rich.markup import escape

    from lmforge.distributed.ranks import current_world, leave_process_group
    from lmforge.report import report_after_run
    from lmforge.sweep.pruning import callbacks_from_env
    from lmforge.train.oom_ladder import DRIVER_ENV, OOM_LADDER_EXIT, OomRestart
    from lmforge.train.runner import run_training

    try:
        # A sweep's trial reports its eval metric to the study (and stops when the pruner says so).
        outcome = run_training(cfg, after_run=report_after_run, extra_callbacks=callbacks_from_env())
    except OomRestart as stop:
        # Out of memory with nothing left to halve: the oom_ladder event said which rung is next.
        if DRIVER_ENV not in os.environ:  # nobody restarts this process: say how to go on
            console.print(f"[bold yellow]stopped[/] {escape(str(stop))}", highlight=False)
        sys.exit(OOM_LADDER_EXIT)  # SystemExit: not recorded as a worker's error for the launcher
    _exit_zero_on_stop_signals()  # the run's work is done: a late SIGTERM must not turn it into 143
    # Every rank ran to the end, or stopped at the same step (the ranks agree on a stop signal):
    # leave together.
    leave_process_group()
    if not current_world().is_main:  # the summary is the run's, said once
        return
    if outcome.interrupted_by is not None:
        console.print(
            f"[bold yellow]stopped[/] by {outcome.interrupted_by} at step {outcome.steps} with a checkpoint; "
            "run the same command to resume"
        )
        return
    if outcome.already_finished:
        console.print(
            f"[bold green]already finished[/] at step {outcome.steps}"
            + (f" (final loss {outcome.last_loss:.4f})" if outcome.last_loss is not None else "")
            + "; nothing to train. Model in "
            f"{outcome.final_dir} (raise train.max_steps to continue it, or run.overwrite=true to start over)"
        )
    else:
        console.print(f"[bold green]done[/] {outcome.steps} steps; model in {outcome.final_dir}")
    if outcome.last_eval_ppl is not None:
        console.print(f"eval perplexity: {_change(outcome.first_eval_ppl, outcome.last_eval_ppl, '.2f')}")
    elif outcome.last_eval_loss is not None:  # preference stages: their loss is no perplexity
        console.print(
            f"eval loss ({cfg.train.stage}): {_change(outcome.first_eval_loss, outcome.last_eval_loss, '.4f')}"
        )
    if outcome.export is not None:
        print_export(outcome.export)


def _change(before: float | None, after: float, fmt: str) -> str:
    """`before -> after`; the end value alone when nothing was measured before training (no
    train.eval_every: the eval data runs once, at the end)."""
    if before is None:
        return f"{after:{fmt}} (at the end; set train.eval_every to also measure the start)"
    return f"{before:{fmt}} -> {after:{fmt}}"


def _exit_zero_on_stop_signals() -> None:
    """From here on, SIGTERM / SIGINT end the process with exit code 0 at once: the run is complete
    (final/ sealed, or a checkpoint written for a signal stop) and only printing and interpreter
    shut-down (seconds, with torch loaded) are left. The default handlers would report 143 / 130."""

    def exit_complete(signum: int, frame: FrameType | None) -> None:
        sys.stdout.flush()
        sys.stderr.write(f"{signal.Signals(signum).name} after the run completed: exit code 0\n")
        sys.stderr.flush()
        os._exit(0)

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, exit_complete)


def prepare(
    config: Path = typer.Argument(..., help="YAML config file."),
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    show: int = typer.Option(
        0, "--show", help="Print N training samples with the tokens that carry loss highlighted."
    ),
    executor: StoreExecutor | None = typer.Option(
        None,
        "--executor",
        help="Build the sharded token store (data.store) with this datatrove executor; overrides "
        "data.store.executor, and uses the store with its defaults where data.store is unset.",
    ),
    tasks: int | None = typer.Option(None, "--tasks", min=1, help="Token store tasks (data.store.tasks)."),
    workers: int | None = typer.Option(
        None, "--workers", min=-1, help="Tasks run at once by the local executor (data.store.workers)."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Token store: tokenize nothing; print the plan, or write and check the Slurm script.",
    ),
) -> None:
    """Data stage only: load, validate, tokenize, pack and cache the data; print the data report.

    `lmforge train` with the same config reuses the cache. With data.store (or --executor) the
    sources are tokenized into a sharded token store instead, by datatrove tasks.

    Example: `lmforge prepare examples/sft_lora.yaml --show 2`, or a token store:
    `lmforge prepare examples/pretrain_at_scale.yaml --executor local --tasks 2`
    """
    cfg = load_config(config, overrides)  # before the heavy imports: a bad config is answered at once
    if cfg.data.store is not None or executor is not None:
        if cfg.data.store is None:  # --executor alone: the store with its defaults
            cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"store": TokenStoreConfig()})})
        if not _build_token_store(cfg, executor, tasks, workers, dry_run):
            return  # a dry run, or a Slurm / Ray job still to finish: nothing to report yet
    from rich.text import Text

    from lmforge.data.run_data import first_samples, prepare_run_data, supervised_runs

    report_path, tokenizer, data = prepare_run_data(cfg)
    console.print_json(json.dumps(data.report))
    # Preference / KTO rows are tokenized by TRL at train time: shown as rendered text.
    shown = (
        _show_preference_rows(tokenizer, data, show)
        if data.conversational_rows
        else first_samples(data, show)
    )
    for number, (ids, labels) in enumerate(shown, start=1):
        console.rule(
            f"sample {number}: {len(ids)} tokens, {sum(label != -100 for label in labels)} with loss"
        )
        text = Text()
        for piece, supervised in supervised_runs(tokenizer, ids, labels):
            text.append(piece, style="bold green" if supervised else "dim")
        console.print(text)
    if show and not data.conversational_rows:
        console.print("[dim]dim: context only (no loss)[/]   [bold green]green: tokens that carry loss[/]")
    console.print(f"data report written to {report_path}")


def _build_token_store(
    cfg: Any, executor: StoreExecutor | None, tasks: int | None, workers: int | None, dry_run: bool
) -> bool:
    """`lmforge prepare` with data.store: build (or finish) the token store; True once it is complete."""
    from lmforge.data.run_data import resolve_cache_dir
    from lmforge.data.token_store.build import ExecutorKind, build_token_store
    from lmforge.data.tokenizer_source import obtain_tokenizer
    from lmforge.run_layout import RunPaths

    cache_dir = resolve_cache_dir(cfg)
    paths = RunPaths(cfg.run.dir)
    paths.root.mkdir(parents=True, exist_ok=True)
    tokenizer = obtain_tokenizer(cfg, paths, cache_dir)
    kind = cast("ExecutorKind", executor.value) if executor is not None else None
    store = build_token_store(
        cfg.data,
        tokenizer,
        seed=cfg.run.seed,
        cache_dir=cache_dir,
        executor=kind,
        tasks=tasks,
        workers=workers,
        dry_run=dry_run,
    )
    return not dry_run and (store / "manifest.json").is_file()


def _show_preference_rows(tokenizer: Any, data: Any, count: int) -> list[tuple[list[int], list[int]]]:
    """The first rows as training renders them: the prompt through the chat template, then each answer."""
    for number in range(min(count, len(data.train))):
        row = data.train[number]
        prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        answers = {k: row[k] for k in ("chosen", "rejected", "completion") if k in row}
        label = f" (label: {'desirable' if row['label'] else 'undesirable'})" if "label" in row else ""
        console.rule(f"row {number + 1}{label}")
        console.print(prompt, markup=False, highlight=False, end="")
        for name, answer in answers.items():
            console.print(f"[bold green]{name}:[/] ", end="")
            console.print(answer[0]["content"], markup=False, highlight=False)
    return []
