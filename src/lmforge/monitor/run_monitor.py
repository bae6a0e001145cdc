"""Everything that watches one training run from the outside, opened and closed together:
the event log (with alerts and the Prometheus event counter listening), the metric sinks
(W&B / MLflow / SwanLab), the Prometheus endpoint and the system sampler. When a run finishes,
`publish_run` hands its model, data report and sample generations to the sinks that publish them.

Rank 0 owns the sinks, the endpoint and the sampler; every rank writes events and can alert
(a stall or an out-of-memory is seen by the rank it happens on).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.config.schema import MonitorConfig
from lmforge.monitor.alerts import AlertSender, alerts_configured
from lmforge.monitor.events import EventLog
from lmforge.monitor.prometheus import PrometheusExporter
from lmforge.monitor.sinks import RunPublisher, Sink, WandbSink, open_sinks
from lmforge.monitor.system import SystemSampler
from lmforge.run_layout import RunPaths

if TYPE_CHECKING:
    import numpy as np

    from lmforge.data.run_data import RunData
    from lmforge.monitor.run_artifacts import Sample, SampleGenerator

log = logging.getLogger(__name__)


@dataclass
class RunMonitor:
    events: EventLog
    sinks: list[Sink] = field(default_factory=list)
    exporter: PrometheusExporter | None = None
    sampler: SystemSampler | None = None

    def record_listeners(self) -> list[Callable[[dict[str, Any]], None]]:
        """Who gets each metrics record besides metrics.jsonl."""
        listeners: list[Callable[[dict[str, Any]], None]] = [sink.log for sink in self.sinks]
        if self.exporter is not None:
            listeners.append(self.exporter.update)
        return listeners

    def system_metrics(self) -> dict[str, float]:
        """The latest background sample (also pushed to the endpoint)."""
        if self.sampler is None:
            return {}
        sample = self.sampler.latest()
        if self.exporter is not None and sample:
            self.exporter.update(sample)
        return sample

    def log_histograms(self, step: int, values: dict[str, np.ndarray]) -> int:
        """Histograms (tag -> a 1-D sample of values) to each sink that draws them (TensorBoard);
        how many sinks took them. Never raises: histograms never stop a run."""
        return self._to_sinks("log_histograms", "the histograms", step, values)

    def log_samples(self, step: int, samples: list[Sample]) -> None:
        """Show an eval step's generations in every sink that shows them (rank 0). Never raises."""
        self._to_sinks("log_samples", "the eval samples", step, samples)

    def _to_sinks(self, method: str, what: str, step: int, payload: Any) -> int:
        """Call `method(step, payload)` on every sink that has it; a sink that fails is a warning
        and training goes on. Returns how many sinks took the payload."""
        taken = 0
        for sink in self.sinks:
            write = getattr(sink, method, None)
            if write is None:
                continue
            try:
                write(step, payload)
            except Exception as err:
                log.warning("%s: writing %s of step %d failed: %s", sink.name, what, step, err)
            else:
                taken += 1
        return taken

    def publish_run(
        self,
        paths: RunPaths,
        run_name: str,
        *,
        stage: str,
        data: RunData,
        trainer_summary: dict[str, Any],
        generate: SampleGenerator,
    ) -> None:
        """Publish a finished run to every sink that publishes (W&B, MLflow): call on rank 0 after
        final/ and the exports are written, before `close`. The eval data (else the train data) of
        `data` gives the prompts of the sample generations. Never raises: the model is already safe in
        final/, so a failure is a warning and a `publish_failed` event."""
        publishers = [sink for sink in self.sinks if isinstance(sink, RunPublisher)]
        if not publishers:  # no model load nor generation when nothing would publish them
            return
        step = 0
        try:
            from lmforge.monitor.run_artifacts import finished_run

            run = finished_run(
                paths, run_name, stage=stage, data=data, trainer_summary=trainer_summary, generate=generate
            )
            step = run.step
        except Exception as err:
            self._publish_failed(", ".join(sink.name for sink in publishers), step, err, paths)
            return
        for sink in publishers:
            try:
                sink.publish_run(run)
            except Exception as err:  # one sink failing must not keep the others from publishing
                self._publish_failed(sink.name, step, err, paths)
            else:
                log.info(
                    "%s: logged the model, the data report and %d generations", sink.name, len(run.samples)
                )

    def _publish_failed(self, what: str, step: int, err: Exception, paths: RunPaths) -> None:
        message = (
            f"publishing the finished run to {what} failed ({type(err).__name__}: {err}); "
            f"the trained model is safe in {paths.final}"
        )
        self.events.emit("publish_failed", step, message)  # redacted, and logged as a warning

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:  # closing one sink must not lose the others
                log.warning("closing %s failed: %s", sink.name, err)
        if self.sampler is not None:
            self.sampler.stop()
        if self.exporter is not None:
            self.exporter.stop()


def open_run_monitor(
    cfg: MonitorConfig,
    run_dir: Path,
    run_name: str,
    *,
    rank: int,
    config: dict[str, Any],
    resume_step: int | None,
) -> RunMonitor:
    """Open the run's monitoring; `config` is the resolved, redacted config (for the sinks)."""
    events = EventLog(RunPaths(run_dir).events)
    monitor = RunMonitor(events)
    if alerts_configured(cfg.alerts):

        def sent(event: dict[str, Any], status: int) -> None:
            events.emit("alert_sent", event["step"], f"alert for {event['kind']} sent (HTTP {status})")

        events.listeners.append(AlertSender(cfg.alerts, run_name, on_sent=sent, run_dir=run_dir))
    if rank != 0:
        return monitor
    try:
        monitor.sinks = open_sinks(cfg, run_dir, run_name, config, resume_step)
        for sink in monitor.sinks:
            if isinstance(sink, WandbSink):  # W&B's own alerts, for the same event kinds
                events.listeners.append(_wandb_alerts(sink, cfg))
        if cfg.prometheus.enabled:
            monitor.exporter = PrometheusExporter(cfg.prometheus, run_name)
            port = monitor.exporter.start()
            log.info("Prometheus metrics on http://%s:%d/metrics", cfg.prometheus.host, port)
            events.listeners.append(monitor.exporter.count_event)
        if cfg.system_metrics_seconds:
            monitor.sampler = SystemSampler(cfg.system_metrics_seconds).start()
    except BaseException:
        monitor.close()
        raise
    return monitor


def _wandb_alerts(sink: WandbSink, cfg: MonitorConfig) -> Callable[[dict[str, Any]], None]:
    def alert(event: dict[str, Any]) -> None:
        if event["kind"] in cfg.alerts.kinds:
            sink.alert(event, cfg.alerts.window_seconds)

    return alert
