"""The runs the UI shows and controls: one directory of run directories (`--runs`, default ./runs).

Nothing here trains. A run is started as `lmforge train CONFIG run.output_dir=ROOT`, or as
`lmforge launch CONFIG --nproc-per-node N ...` for N processes, the command a user would type, in a
process of its own session: the UI does not own its life. A run is running while its `.lock` is
held (train/run_lock.py), so a restarted UI finds its runs again by the lock, and stops one by
sending SIGTERM to the pid the lock names (rank 0 of a launch): the run checkpoints, then exits,
every rank at the same step (the ranks agree on a stop signal, train/guard_callback.py). Each
launch goes through a small waiter (`python -m lmforge.ui.waiter`) that records the exit code and
keeps the console output, which the run page shows when the run ends.

Every path comes from a run name checked against the root: a name is one plain directory entry, and
the directory it resolves to (symlinks followed) must lie inside the root.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.errors import UserInputError
from lmforge.report import list_runs
from lmforge.report.load import is_run_dir
from lmforge.train.run_lock import LOCK_NAME

if TYPE_CHECKING:
    from lmforge.config.schema import LmforgeConfig

UI_DIR = ".ui"  # under the root: the configs the UI launched, console logs, exit codes
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TAIL_BYTES = 8192
MAX_PROCESSES = 64  # processes per node the form accepts


class UnknownRun(UserInputError):
    """A run name that is not a run directory inside the root (the UI answers 404)."""


@dataclass
class RunState:
    """A run as the UI shows it: the report's row plus whether a process holds it now."""

    name: str
    status: str
    stage: str
    steps: int | None
    running: bool
    pid: int | None
    exit_code: int | None
    best_eval_metric: str | None
    best_eval_value: float | None
    processes: int  # per node, as the UI launched it (1: `lmforge train`)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RunsRoot:
    def __init__(self, root: Path, cwd: Path | None = None) -> None:
        self.root = root.resolve()
        self.cwd = (cwd or Path.cwd()).resolve()
        self.ui_dir = self.root / UI_DIR

    # --- reading ----------------------------------------------------------------------------
    def runs(self) -> list[RunState]:
        rows = list_runs(self.root) if self.root.is_dir() else []
        inside = [
            row for row in rows if Path(row.path).resolve().is_relative_to(self.root)
        ]  # no symlinks out
        return [self._state(self._name(Path(row.path)), Path(row.path), row) for row in inside]

    def run_dir(self, name: str) -> Path:
        """The run directory `name` names inside the root (a sweep's trials one level down:
        `sweep/trial-0000`); UnknownRun for anything else."""
        parts = name.split("/")
        if len(parts) > 2 or not all(_NAME.fullmatch(part) for part in parts) or parts[0] == UI_DIR:
            raise UnknownRun(f"{name!r}: not a run name (letters, digits, '.', '_', '-')")
        path = (self.root / name).resolve()
        if not path.is_relative_to(self.root) or not is_run_dir(path):
            raise UnknownRun(f"{name}: no run of that name under {self.root}")
        return path

    def state(self, name: str) -> RunState:
        path = self.run_dir(name)
        row = next((r for r in list_runs(path)), None)
        return self._state(name, path, row)

    def sweep_dir(self, name: str) -> Path:
        """The sweep directory `name` names inside the root (one holding study.db)."""
        path = (self.root / name).resolve()
        if (
            not _NAME.fullmatch(name)
            or not path.is_relative_to(self.root)
            or not (path / "study.db").is_file()
        ):
            raise UnknownRun(f"{name}: no sweep of that name under {self.root}")
        return path

    def sweeps(self) -> list[str]:
        return sorted(p.parent.name for p in self.root.glob("*/study.db") if _NAME.fullmatch(p.parent.name))

    def _name(self, path: Path) -> str:
        return path.resolve().relative_to(self.root).as_posix()

    def console_tail(self, name: str) -> str:
        log = self.ui_dir / f"{name}.console.log"
        if not log.is_file():
            return ""
        with log.open("rb") as handle:
            handle.seek(max(0, log.stat().st_size - _TAIL_BYTES))
            return handle.read().decode("utf-8", "replace")

    def launch_status(self, name: str) -> dict[str, Any]:
        """How a launch the UI started has gone before its run directory exists: its exit code once
        it ended (a config `lmforge train` refused before writing anything) and its console."""
        if not _NAME.fullmatch(name):
            raise UnknownRun(f"{name!r}: not a run name")
        exit_file = self.ui_dir / f"{name}.exit"
        return {
            "exit_code": int(exit_file.read_text()) if exit_file.is_file() else None,
            "console": self.console_tail(name),
        }

    def examples(self) -> list[str]:
        """The example configs a new run can start from: examples/*.yaml in the UI's working
        directory, where `lmforge train examples/NAME.yaml` would find them (their data paths are
        relative to it)."""
        return sorted(p.name for p in (self.cwd / "examples").glob("*.yaml") if _NAME.fullmatch(p.name))

    def example_text(self, name: str) -> str:
        if name not in self.examples():
            raise UnknownRun(f"{name!r}: no example of that name in {self.cwd / 'examples'}")
        return (self.cwd / "examples" / name).read_text(encoding="utf-8")

    def config_text(self, name: str) -> str:
        config = self.run_dir(name) / "config.yaml"
        return config.read_text(encoding="utf-8") if config.is_file() else ""

    # --- acting -----------------------------------------------------------------------------
    def validate(self, text: str) -> str:
        """The config's name after the CLI's own validation; UserInputError with its message."""
        cfg = self._load(text)
        if not _NAME.fullmatch(cfg.run.name):
            raise UserInputError(f"run.name {cfg.run.name!r}: use letters, digits, '.', '_' or '-'")
        return cfg.run.name

    def estimate(self, text: str, gpus: int = 1, gpu_mem: str = "80GB") -> dict[str, Any]:
        """`lmforge estimate`'s strategies and recommendation for the config text, per GPU of `gpu_mem`."""
        from lmforge.distributed.estimate import estimate_memory
        from lmforge.distributed.planner import overall_recommendation, plan_layouts_for
        from lmforge.export.safetensors_stream import parse_size

        cfg = self._load(text, tokenizer_optional=True)
        result = estimate_memory(cfg, gpus=gpus, gpu_mem_bytes=parse_size(gpu_mem), nodes=1)
        recommendation = overall_recommendation(result, plan_layouts_for(cfg, result)).to_dict()
        strategies = [
            {"strategy": row.strategy, "total_gpu": row.total_gpu, "fits": row.fits}
            for row in result.strategies
        ]
        return {
            "parameters": result.model.total_params,
            "gpus": gpus,
            "gpu_mem": gpu_mem,
            "strategies": strategies,
            "recommendation": recommendation,
        }

    def preview(self, text: str, samples: int = 2) -> dict[str, Any]:
        """`lmforge prepare --show`: the data stage on the config text (its report written where the
        run will be, its cache reused by the run), and the first samples as (text, carries loss) runs."""
        from lmforge.data.run_data import first_samples, prepare_run_data, supervised_runs

        _, tokenizer, data = prepare_run_data(self._load(text))
        shown = [] if data.conversational_rows else first_samples(data, samples)
        return {
            "report": data.report,
            "samples": [
                {"tokens": len(ids), "runs": supervised_runs(tokenizer, ids, labels)} for ids, labels in shown
            ],
            "note": "preference rows are tokenized by TRL at training time"
            if data.conversational_rows
            else "",
        }

    def launch(self, text: str, processes: int = 1) -> str:
        """Start `lmforge train` on the config text, or `lmforge launch` with `processes` per node;
        returns the run's name."""
        name = self.validate(text)
        if not 1 <= processes <= MAX_PROCESSES:
            raise UserInputError(f"processes per node: {processes}; choose 1 to {MAX_PROCESSES}")
        if self._holder(self.root / name) is not None:
            raise UserInputError(f"run {name} is running; stop it first, or choose another run.name")
        config = self._write_config(name, text)
        (self.ui_dir / f"{name}.processes").write_text(str(processes))
        self._start(name, self._command(config, processes, [f"run.output_dir={self.root}"]))
        return name

    def resume(self, name: str, max_steps: int | None = None) -> None:
        """Run the recorded config again, with as many processes as before: `train.resume: auto`
        continues from the last checkpoint; `max_steps` above the old target extends the run."""
        path = self.run_dir(name)
        if self._holder(path) is not None:
            raise UserInputError(f"run {name} is running already")
        overrides = [f"run.output_dir={self.root}", "train.resume=auto"]
        if max_steps is not None:
            overrides.append(f"train.max_steps={int(max_steps)}")
        self._start(name, self._command(path / "config.yaml", self._processes(name), overrides))

    def stop(self, name: str) -> int:
        """SIGTERM to the process holding the run: it checkpoints at the step boundary and exits."""
        pid = self._holder(self.run_dir(name))
        if pid is None:
            raise UserInputError(f"run {name} is not running")
        os.kill(pid, signal.SIGTERM)
        return pid

    # --- helpers ----------------------------------------------------------------------------
    def _state(self, name: str, path: Path, row: Any) -> RunState:
        pid = self._holder(path)
        exit_file = self.ui_dir / f"{name}.exit"
        exit_code = int(exit_file.read_text()) if pid is None and exit_file.is_file() else None
        status = row.status if row else "prepared"
        if pid is None and status == "running":  # written to lately (the report's guess), held by no process
            status = "incomplete"
        return RunState(
            name=name,
            status="running" if pid is not None else status,
            stage=row.stage if row else "?",
            steps=row.steps if row else None,
            running=pid is not None,
            pid=pid,
            exit_code=exit_code,
            best_eval_metric=row.best_eval_metric if row else None,
            best_eval_value=row.best_eval_value if row else None,
            processes=self._processes(name),
        )

    def _processes(self, name: str) -> int:
        """Processes per node the UI launched the run with; for a run started elsewhere (`lmforge
        launch` in a terminal), the world size its manifest records, so a resume from the UI runs on
        as many processes (on this one node). 1 when unknown."""
        record = self.ui_dir / f"{name}.processes"
        if record.is_file():
            return int(record.read_text())
        return recorded_processes_per_node(self.root / name / "manifest.json")

    @staticmethod
    def _command(config: Path, processes: int, overrides: list[str]) -> list[str]:
        """lmforge's own command line for the run: train in this process, or launch N workers."""
        if processes == 1:
            return ["train", str(config), *overrides]
        return ["launch", str(config), *overrides, "--nproc-per-node", str(processes)]

    def _holder(self, run_dir: Path) -> int | None:
        """The pid holding the run's lock, or None when no process holds it."""
        lock = run_dir / LOCK_NAME
        if not lock.is_file():
            return None
        with lock.open("r", encoding="utf-8") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    return int(json.loads(handle.read() or "{}").get("pid"))
                except (ValueError, TypeError):
                    return None
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            return None

    def _load(self, text: str, *, tokenizer_optional: bool = False) -> LmforgeConfig:
        """The editor's config through the CLI's `load_config`, its runs in the root; errors name
        the editor's lines ("config:3"), not the draft file they were checked in."""
        from lmforge.config import load_config

        draft = self._write_config("draft", text)
        try:
            cfg = load_config(draft, [f"run.output_dir={self.root}"], tokenizer_optional=tokenizer_optional)
        except UserInputError as err:
            raise UserInputError(str(err).replace(str(draft), "config")) from None
        # The UI writes only under its runs directory (and lmforge's own cache, when unset).
        store = cfg.data.store.path if cfg.data.store is not None else None
        written = {"data.cache_dir": cfg.data.cache_dir, "data.store.path": store}
        for key, value in written.items():
            if value is not None and not (self.cwd / value).resolve().is_relative_to(self.root):
                raise UserInputError(
                    f"{key}: {value} is outside the UI's runs directory {self.root}, and the UI writes nowhere "
                    "else. Fix: a directory inside it, or leave the key unset (lmforge's own cache)"
                )
        return cfg

    def _write_config(self, stem: str, text: str) -> Path:
        self.ui_dir.mkdir(parents=True, exist_ok=True)
        path = self.ui_dir / f"{stem}.yaml"
        path.write_text(text, encoding="utf-8")
        return path

    def _start(self, name: str, args: list[str]) -> None:
        self.ui_dir.mkdir(parents=True, exist_ok=True)
        (self.ui_dir / f"{name}.exit").unlink(missing_ok=True)
        command = [sys.executable, "-m", "lmforge.ui.waiter", str(self.ui_dir), name, *args]
        # A session of its own: closing the UI (or Ctrl-C in its terminal) does not stop the run.
        subprocess.Popen(
            command,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )


def recorded_processes_per_node(manifest: Path) -> int:
    """The world size a run's manifest.json records, 1 when the manifest is missing or unreadable
    (a run that never started training)."""
    try:
        summary = json.loads(manifest.read_text(encoding="utf-8")).get("distributed") or {}
        world = int(summary.get("world_size") or 1)
    except (OSError, ValueError, AttributeError, TypeError):
        return 1
    return min(max(world, 1), MAX_PROCESSES)
