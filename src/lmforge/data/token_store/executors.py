"""Which datatrove executor runs the store's tasks, and running it quietly with a progress line.

Local processes (`LocalPipelineExecutor`: tests and one machine), a Slurm job array
(`SlurmPipelineExecutor`: the job is submitted and runs on its own) or Ray
(`RayPipelineExecutor`). datatrove's own completion files (`<store>/logs/completions/`) make a
re-run redo only the tasks that did not finish; its task logs go to `<store>/logs/`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from datatrove.executor.base import PipelineExecutor
from datatrove.executor.local import LocalPipelineExecutor
from datatrove.executor.slurm import SlurmPipelineExecutor
from datatrove.pipeline.base import PipelineStep

from lmforge.config.schema import SlurmStoreConfig
from lmforge.errors import UserInputError
from lmforge.verbosity import progress_bar

LOGS_DIR = "logs"
LAUNCH_SCRIPT = "launch_script.slurm"
_POLL_S = 0.5


def make_executor(
    kind: str, pipeline: list[PipelineStep], *, tasks: int, workers: int, store: Path, slurm: SlurmStoreConfig
) -> PipelineExecutor:
    """The datatrove executor of `kind` for the store's pipeline; refuses what cannot run here."""
    logs = str(store / LOGS_DIR)
    if kind == "local":
        parallel = min(tasks, os.cpu_count() or 1) if workers == -1 else min(workers, tasks)
        return LocalPipelineExecutor(pipeline, tasks=tasks, workers=parallel, logging_dir=logs)
    if kind == "slurm":
        if slurm.partition is None:
            raise UserInputError(
                "data.store.slurm.partition is not set. Fix: set it to the Slurm partition the "
                "tokenization tasks run on (sinfo lists them)."
            )
        # sbatch takes whole units: 2.0 GB is written 2G, 1.5 GB 1536M (the later directive wins).
        memory = slurm.mem_per_cpu_gb
        whole_gb = memory.is_integer()
        extra = {} if whole_gb else {"mem-per-cpu": f"{round(memory * 1024)}M"}
        return SlurmPipelineExecutor(
            pipeline,
            tasks=tasks,
            workers=workers,
            time=slurm.time,
            partition=slurm.partition,
            cpus_per_task=slurm.cpus_per_task,
            mem_per_cpu_gb=int(memory) if whole_gb else 1,
            job_name="lmforge-token-store",
            qos="",  # the cluster's default QOS (datatrove would write "normal"); add one with sbatch_args
            venv_path=slurm.venv,
            sbatch_args={**extra, **slurm.sbatch_args},
            logging_dir=logs,
        )
    if importlib.util.find_spec("ray") is None:
        raise UserInputError(
            "data.store.executor: ray is not installed in this environment. Fix: pip install ray "
            "(and start or join a cluster: ray start), or use executor local or slurm."
        )
    from datatrove.executor.ray import RayPipelineExecutor

    return RayPipelineExecutor(pipeline, tasks=tasks, workers=workers, logging_dir=logs)


def write_slurm_script(executor: SlurmPipelineExecutor, store: Path) -> Path:
    """The sbatch script datatrove would submit, at `<store>/logs/launch_script.slurm`, checked by
    `bash -n`; nothing is submitted and no task runs."""
    pickled = executor.logging_dir.resolve_paths("executor.pik")
    script = executor.get_launch_file_contents(
        executor.get_sbatch_args(executor.tasks), f"srun -l -n 1 launch_pickled_pipeline {pickled}"
    )
    path = store / LOGS_DIR / LAUNCH_SCRIPT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script, encoding="utf-8")
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        raise UserInputError(
            f"{path}: the generated Slurm script is not valid bash ({check.stderr.strip()}). "
            "Fix: check data.store.slurm (sbatch_args, venv) for quotes or newlines."
        )
    return path


def run_quietly(executor: PipelineExecutor, store: Path, progress: Callable[[], tuple[int, int]]) -> None:
    """Run `executor` with datatrove's console logging sent to `<store>/logs/console.log` (its
    per-task logs are in `<store>/logs/logs/`), while one progress line shows tasks done and
    tokens written. `progress()` returns (tasks done, tokens) from what is on disk."""
    with _stderr_to(store / LOGS_DIR / "console.log") as console, _progress_line(executor, progress, console):
        executor.run()


@contextmanager
def _stderr_to(log: Path) -> Iterator[Any]:
    """File descriptor 2 goes to `log` (datatrove's workers inherit it); yields a stream on the
    real stderr for the progress line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    console = os.fdopen(os.dup(saved), "w", buffering=1)
    with log.open("a") as target:
        os.dup2(target.fileno(), 2)
        try:
            yield console
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            console.close()


@contextmanager
def _progress_line(
    executor: PipelineExecutor, progress: Callable[[], tuple[int, int]], console: Any
) -> Iterator[None]:
    stop = threading.Event()
    bar = progress_bar(total=executor.world_size, desc="token store", unit="task", file=console)

    def update() -> None:
        done, tokens = progress()
        bar.update(done - bar.n)  # tasks finish in other processes: the bar follows their count
        bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
        bar.refresh()

    def poll() -> None:
        while not stop.wait(_POLL_S):
            update()
        update()  # the final count, once every task has stopped

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield
    finally:
        stop.set()
        poller.join()
        bar.close()
