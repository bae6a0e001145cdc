"""Metric sinks besides metrics.jsonl: Weights & Biases, MLflow, SwanLab (TensorBoard lives elsewhere).

`open_sinks(cfg, run_dir, run_name, config, resume_step)` opens the sinks named in
`monitor.loggers`, each writing under the run directory by default and working with no
network: W&B offline, MLflow's file store in run_dir/mlruns, SwanLab offline. A resumed run
continues the same W&B / MLflow run (ids kept in run_dir/sinks.json) on the same step axis:
each sink logs a (key, step) pair at most once and never goes back, so the steps a resume
replays after its checkpoint are not logged again. Open sinks on the main process only.

W&B and MLflow are also `RunPublisher`s: when a run finishes, they log its model, data report,
sample generations and summary (sink_publish.py).
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lmforge.config.redact import redact
from lmforge.config.schema import MonitorConfig
from lmforge.errors import UserInputError
from lmforge.monitor.sink_step_axis import STATE_FILE, StepAxisSink
from lmforge.run_layout import RunPaths

if TYPE_CHECKING:
    import numpy as np

    from lmforge.monitor.run_artifacts import FinishedRun, Sample

log = logging.getLogger(__name__)
TENSORBOARD_FLUSH_SECONDS = 5.0  # how stale the TensorBoard view may get between flushes
DEFAULT_PROJECT = "lmforge"
SINK_LOGGERS = ("wandb", "mlflow", "swanlab")
# pip requirement that brings each sink's library back (SwanLab and TensorBoard are in the default install).
_INSTALL = {
    "wandb": "'lmforge[wandb]'",
    "mlflow": "'lmforge[mlflow]'",
    "swanlab": "'swanlab>=0.10' 'protobuf<7'",
    "tensorboard": "tensorboard",
}
_MODULE = {"wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab", "tensorboard": "tensorboard"}
SAMPLES_KEY = "eval_samples"  # where each sink shows the eval steps' generations


class Sink(Protocol):
    name: str

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class RunPublisher(Protocol):
    """A sink that publishes a finished run: called once, on rank 0, after final/ and the exports are
    written and before `close`, only when the run finished. May raise; the caller reports it."""

    name: str

    def publish_run(self, run: FinishedRun) -> None: ...


def open_sinks(
    cfg: MonitorConfig, run_dir: Path, run_name: str, config: dict[str, Any], resume_step: int | None
) -> list[Sink]:
    """Open every sink in cfg.loggers; a missing library is a UserInputError."""
    project = cfg.project or DEFAULT_PROJECT
    safe_config = redact(config)  # the caller redacts too; a second pass costs nothing
    openers = {
        "tensorboard": TensorBoardSink,
        "wandb": WandbSink,
        "mlflow": MlflowSink,
        "swanlab": SwanlabSink,
    }
    names = [name for name in dict.fromkeys(cfg.loggers) if name in openers]
    for name in names:  # every library checked before any run is created
        _require(name)
    sinks: list[Sink] = []
    try:
        for name in names:
            sinks.append(openers[name](run_dir, run_name, project, safe_config, resume_step))
    except Exception:
        for sink in sinks:
            with contextlib.suppress(Exception):
                sink.close()
        raise
    return sinks


def require_sink_packages(cfg: MonitorConfig) -> None:
    """UserInputError naming the extra to install for a selected sink whose library is missing;
    called when a run starts, before its data or model is built."""
    for name in dict.fromkeys(cfg.loggers):
        if name in _MODULE:
            _require(name)


def _require(name: str) -> None:
    import importlib.util

    if importlib.util.find_spec(_MODULE[name]) is None:
        raise UserInputError(
            f"monitor.loggers: '{name}' needs the {name} package; install it with "
            f"`pip install {_INSTALL[name]}` or remove {name} from monitor.loggers"
        )


class TensorBoardSink(StepAxisSink):
    """TensorBoard event files in run_dir/tb, tagged with metrics.jsonl's own key names."""

    name = "tensorboard"

    def __init__(
        self, run_dir: Path, run_name: str, project: str, config: dict[str, Any], resume_step: int | None
    ) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter

        super().__init__(run_dir, resume_step)
        # purge_step hides what a crashed run logged after its checkpoint, so the TensorBoard
        # step axis never goes backwards either.
        purge = resume_step + 1 if resume_step is not None else None
        self._writer = SummaryWriter(str(RunPaths(run_dir).tensorboard), purge_step=purge)
        self._summary = Summary
        # The writer's FileWriter, set by SummaryWriter.__init__ (typed None: it is None once closed).
        self._events: Any = self._writer.file_writer
        self._flushed_at = time.monotonic()

    def _write(self, step: int, values: dict[str, float]) -> bool:
        # One event holding every value of the step: `add_scalar` per key (an event each) cost
        # 2.4 ms a step for online RL's 47 series, this 0.23 ms; TensorBoard reads both the same.
        summary = self._summary(
            value=[self._summary.Value(tag=key, simple_value=value) for key, value in values.items()]
        )
        self._events.add_summary(summary, step)
        # A flush waits for the writer's thread: every step it cost 2.4 ms of a 27 ms H100 step
        # (llama-tiny). TensorBoard re-reads its files every few seconds anyway, and a crash
        # loses at most these seconds of the view (metrics.jsonl, written every record, keeps all).
        if time.monotonic() - self._flushed_at < TENSORBOARD_FLUSH_SECONDS:
            return False
        self._writer.flush()
        self._flushed_at = time.monotonic()
        return True

    def log_histograms(self, step: int, values: dict[str, np.ndarray]) -> None:
        """One histogram per tag (a 1-D sample of a tensor's values) at `step`; a step that a
        resumed run replays after its checkpoint is not drawn twice."""
        if self._closed or (self._floor is not None and step <= self._floor):
            return
        for tag, samples in values.items():
            self._writer.add_histogram(tag, samples, step)

    def log_samples(self, step: int, samples: list[Sample]) -> None:
        """The samples as one markdown table (TensorBoard's text tab) under `eval_samples`."""
        if self._closed or (self._floor is not None and step <= self._floor):
            return
        self._writer.add_text(SAMPLES_KEY, samples_markdown(samples), step)
        self._writer.flush()  # an eval step is rare: its samples show at once

    def _finish(self) -> None:
        self._writer.close()


class WandbSink(StepAxisSink):
    """Weights & Biases: offline unless WANDB_MODE or WANDB_API_KEY says otherwise; files in run_dir/wandb."""

    name = "wandb"

    def __init__(
        self, run_dir: Path, run_name: str, project: str, config: dict[str, Any], resume_step: int | None
    ) -> None:
        import wandb

        super().__init__(run_dir, resume_step)
        configured = os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY")
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            console="off",  # stdout/stderr stay ours (already redacted), not copied into the run
            x_disable_meta=True,  # no argv (overrides may hold secrets), git remote or host details
            silent=True,
        )
        self._run = wandb.init(
            project=project,
            name=run_name,
            id=self.run_id,  # None: wandb picks one, kept in sinks.json for the resume
            resume="allow",
            dir=str(run_dir),  # wandb adds the wandb/ folder itself
            mode=None if configured else "offline",
            config=config,
            settings=settings,
        )
        self.run_id = self._run.id
        self.files_dir = Path(self._run.dir).parent  # wandb/offline-run-<time>-<id>/ (or run-...)
        self._state.put(self.name, {"run_id": self.run_id, "last_step": self._floor})

    def _write(self, step: int, values: dict[str, float]) -> bool:
        self._run.log(values, step=step)
        return True

    def log_samples(self, step: int, samples: list[Sample]) -> None:
        """A `wandb.Table` (step, prompt, completion, reference) under `eval_samples` at `step`."""
        import wandb

        if self._closed or (self._floor is not None and step <= self._floor):
            return
        columns: list[str | int] = [
            "step",
            "prompt",
            "completion",
            "reference",
            *(["reward"] if _rewarded(samples) else []),
        ]
        rows: list[list[Any]] = [
            [step, s.prompt, s.completion, s.reference, s.reward][: len(columns)] for s in samples
        ]
        table = wandb.Table(columns=columns, data=rows)
        self._run.log({SAMPLES_KEY: table}, step=step)

    def publish_run(self, run: FinishedRun) -> None:
        """Dataset and model artifacts (with their lineage), the generations table and the summary."""
        from lmforge.monitor.sink_publish import publish_wandb

        # The table goes on the last step this run logged (W&B drops rows behind its step).
        steps = [s for s in (self._step, self._floor, run.step) if s is not None]
        publish_wandb(self._run, run, step=max(steps))

    def alert(self, event: dict[str, Any], window_seconds: float) -> None:
        """`wandb.alert` for an event (W&B rate-limits by title with wait_duration)."""
        import wandb

        severe = event["kind"] in ("failed", "stopped", "stall")
        self._run.alert(
            title=f"lmforge {event['kind']}",
            text=f"step {event['step']}: {event['message']}",
            level=wandb.AlertLevel.ERROR if severe else wandb.AlertLevel.WARN,  # type: ignore[attr-defined]
            wait_duration=window_seconds,
        )

    def _finish(self) -> None:
        self._run.finish()


class MlflowSink(StepAxisSink):
    """MLflow: MLFLOW_TRACKING_URI if set, else the file store run_dir/mlruns; the same run on resume."""

    name = "mlflow"
    _id: str  # the MLflow run id (run_id without the Optional)

    def __init__(
        self, run_dir: Path, run_name: str, project: str, config: dict[str, Any], resume_step: int | None
    ) -> None:
        from mlflow.tracking import MlflowClient

        super().__init__(run_dir, resume_step)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 refuses new file stores unless asked; the file store is the one backend
            # that needs no server and no database (`mlflow ui --backend-store-uri` reads it).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        existing = self._existing_run(self.run_id)
        if existing is not None:
            self._id = existing.info.run_id
            self.client.update_run(self._id, status="RUNNING")
            logged = dict(existing.data.params)
        else:
            run = self.client.create_run(
                experiment_id, run_name=run_name, tags={"lmforge.run_dir": str(run_dir)}
            )
            self._id, logged = run.info.run_id, {}
        self.run_id = self._id
        self._log_params(_flatten(config), logged)
        self.client.log_dict(self._id, config, "config.json")
        self._state.put(self.name, {"run_id": self.run_id, "last_step": self._floor})

    def _existing_run(self, run_id: str | None) -> Any:
        if not run_id:
            return None
        try:
            return self.client.get_run(run_id)
        except Exception:
            log.warning("mlflow run %s from %s not found; starting a new run", run_id, STATE_FILE)
            return None

    def _log_params(self, params: dict[str, str], logged: dict[str, str]) -> None:
        """Params are immutable in MLflow: on resume, new keys are added and changed ones reported."""
        from mlflow.entities import Param

        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            log.warning("mlflow keeps the first value of params changed on resume: %s", ", ".join(changed))
        fresh = [Param(k, v) for k, v in params.items() if k not in logged]
        for start in range(0, len(fresh), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self._id, params=fresh[start : start + 100])

    def _write(self, step: int, values: dict[str, float]) -> bool:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        self.client.log_batch(self._id, metrics=metrics)
        return True

    def log_samples(self, step: int, samples: list[Sample]) -> None:
        """An MLflow table artifact per eval step: eval_samples/step-<step>.json."""
        if self._closed or (self._floor is not None and step <= self._floor):
            return
        table = {
            "step": [step] * len(samples),
            "prompt": [s.prompt for s in samples],
            "completion": [s.completion for s in samples],
            "reference": [s.reference for s in samples],
            **({"reward": [s.reward for s in samples]} if _rewarded(samples) else {}),
        }
        self.client.log_table(self._id, table, f"{SAMPLES_KEY}/step-{step}.json")

    def publish_run(self, run: FinishedRun) -> None:
        """Dataset input, data report, generations table, summary and a LoggedModel of final/."""
        from lmforge.monitor.sink_publish import publish_mlflow

        publish_mlflow(self.client, self._id, run)

    def _finish(self) -> None:
        self.client.set_terminated(self._id, "FINISHED")


class SwanlabSink(StepAxisSink):
    """SwanLab: offline (files in run_dir/swanlog) unless SWANLAB_MODE or SWANLAB_API_KEY says otherwise."""

    name = "swanlab"

    def __init__(
        self, run_dir: Path, run_name: str, project: str, config: dict[str, Any], resume_step: int | None
    ) -> None:
        import swanlab

        super().__init__(run_dir, resume_step)
        configured = os.environ.get("SWANLAB_MODE") or os.environ.get("SWANLAB_API_KEY")
        kwargs: dict[str, Any] = {}
        if configured and self.run_id:  # resuming needs the SwanLab service; offline runs start anew
            kwargs = {"id": self.run_id, "resume": "allow"}
        self._run = swanlab.init(
            project=project,
            experiment_name=run_name,
            config=config,
            logdir=str(run_dir / "swanlog"),
            mode=None if configured else "offline",
            # No argv (overrides may hold secrets) or git remote in the metadata; output stays ours.
            settings=swanlab.Settings(
                probe={"runtime": False, "git": False}, terminal={"proxy_type": "none"}
            ),
            **kwargs,
        )
        self.run_id = str(getattr(self._run, "id", None) or self.run_id or "")
        self._state.put(self.name, {"run_id": self.run_id, "last_step": self._floor})

    def _write(self, step: int, values: dict[str, float]) -> bool:
        self._run.log(values, step=step)
        return True

    def log_samples(self, step: int, samples: list[Sample]) -> None:
        """One `swanlab.Text` per sample under `eval_samples` at `step`."""
        import swanlab

        if self._closed or (self._floor is not None and step <= self._floor):
            return
        texts = [swanlab.Text(_sample_text(s), caption=f"step {step}") for s in samples]
        self._run.log({SAMPLES_KEY: texts}, step=step)

    def _finish(self) -> None:
        self._run.finish()


def samples_markdown(samples: list[Sample]) -> str:
    """A markdown table of samples whose cells show the text as written: HTML and markdown
    characters escaped, newlines as line breaks."""
    rewarded = _rewarded(samples)
    header = ["prompt", "completion", "reference", *(["reward"] if rewarded else [])]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in samples:
        cells = [s.prompt, s.completion, "" if s.reference is None else s.reference]
        if rewarded:
            cells.append("" if s.reward is None else f"{s.reward:.4g}")
        rows.append("| " + " | ".join(_markdown_cell(text) for text in cells) + " |")
    return "\n".join(rows)


def _rewarded(samples: list[Sample]) -> bool:
    """Online RL's samples carry rewards: the tables get a reward column (eval generations do not)."""
    return any(s.reward is not None for s in samples)


def _markdown_cell(text: str) -> str:
    """Markdown's escapable characters (Python-Markdown's, with the table's |) backslashed, then
    HTML's: the cell renders the text, never markup or a link from it."""
    escaped = html.escape(re.sub(r"([\\`*_{}\[\]()#+\-.!|])", r"\\\1", text), quote=False)
    return escaped.replace("\r\n", "\n").replace("\n", "<br>")


def _sample_text(sample: Sample) -> str:
    reference = "" if sample.reference is None else f"\n\nreference: {sample.reference}"
    reward = "" if sample.reward is None else f"\n\nreward: {sample.reward:.4g}"
    return f"prompt: {sample.prompt}\n\ncompletion: {sample.completion}{reference}{reward}"


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted params (train.lr=0.0003), values as short strings (MLflow caps a param's length)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{path}."))
        else:
            text = json.dumps(value) if not isinstance(value, str) else value
            if isinstance(value, float) and not math.isfinite(value):
                text = str(value)
            flat[path] = text[:6000]
    return flat
