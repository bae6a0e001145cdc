"""A Prometheus /metrics endpoint for a training run (its alerting rules and Grafana dashboard
are in `lmforge.monitor.prometheus_rules`).

Every exported name is in METRICS (gauges set from metrics records and system samples) or
EVENTS_COUNTER; the rules and the dashboard use only those names (a test checks it). Each
series carries the label `run`. The endpoint listens on 127.0.0.1 by default and serves from
its own registry, so nothing else in the process leaks into it.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import Any

from lmforge.config.schema import ALERT_KINDS, PrometheusConfig
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)
GB = 1e9  # the records' *_gb keys are decimal gigabytes
MB = 1e6


@dataclass(frozen=True)
class Exported:
    key: str  # key in a metrics record or a SystemSampler sample
    name: str  # exported Prometheus name
    help: str
    scale: float = 1.0  # record value * scale = exported value (Prometheus wants base units)


# The one table of exported gauges. Keys missing from a record leave their gauge unchanged.
METRICS: tuple[Exported, ...] = (
    Exported("step", "lmforge_step", "Last logged optimizer step."),
    Exported("loss", "lmforge_loss", "Training loss (mean over the logging interval)."),
    Exported("lr", "lmforge_learning_rate", "Learning rate."),
    Exported("grad_norm", "lmforge_grad_norm", "Global gradient norm before clipping."),
    Exported("grad_clipped", "lmforge_grad_clipped", "1 when the last logged step's gradients were clipped."),
    Exported("update_ratio", "lmforge_update_ratio", "||update|| / ||parameters|| of the last step."),
    Exported("tokens_per_s", "lmforge_tokens_per_second", "Non-pad tokens per second."),
    Exported("samples_per_s", "lmforge_samples_per_second", "Samples per second."),
    Exported("step_time_s", "lmforge_step_time_seconds", "Seconds per optimizer step."),
    Exported("data_wait_share", "lmforge_data_wait_share", "Share of step time spent waiting for data."),
    Exported("mfu", "lmforge_mfu", "Model FLOPs utilisation (0..1)."),
    Exported("eval_loss", "lmforge_eval_loss", "Evaluation loss."),
    Exported("eval_ppl", "lmforge_eval_perplexity", "Evaluation perplexity."),
    Exported("nonfinite_count", "lmforge_nonfinite_steps", "Steps with a NaN/inf loss or gradient so far."),
    Exported("skipped_steps", "lmforge_skipped_steps", "Updates skipped by the guardrails so far."),
    Exported("spike_count", "lmforge_loss_spikes", "Loss spikes detected so far."),
    Exported("rollbacks", "lmforge_rollbacks", "Rollbacks to a checkpoint so far."),
    Exported("tokens_seen", "lmforge_tokens_seen", "Non-pad training tokens consumed so far."),
    Exported("epoch", "lmforge_epoch", "Fractional epoch."),
    Exported("loss_rank_max", "lmforge_loss_rank_max", "Highest per-rank loss of the step."),
    Exported("straggler", "lmforge_straggler", "Slowest rank's step time over the median (1 = even)."),
    # CommTiming.take_window() keys (lmforge.distributed.comm_timing), distributed runs:
    Exported("comm_share", "lmforge_comm_share", "Share of step time with a collective in flight (0..1)."),
    Exported("comm_s", "lmforge_comm_seconds", "Seconds per step with any collective in flight."),
    Exported("comm_all_reduce_s", "lmforge_comm_all_reduce_seconds", "Seconds per step in all-reduce."),
    Exported(
        "comm_reduce_scatter_s", "lmforge_comm_reduce_scatter_seconds", "Seconds per step in reduce-scatter."
    ),
    Exported("comm_all_gather_s", "lmforge_comm_all_gather_seconds", "Seconds per step in all-gather."),
    # Mixture-of-Experts models (lmforge.train.moe_metrics); the per-expert counts stay in the sinks.
    Exported(
        "moe_load_max_over_mean",
        "lmforge_moe_load_max_over_mean",
        "Busiest expert's load / mean, worst layer.",
    ),
    Exported("moe_load_cv", "lmforge_moe_load_cv", "Coefficient of variation of expert loads, worst layer."),
    Exported(
        "moe_aux_loss",
        "lmforge_moe_aux_loss",
        "Router load-balancing auxiliary loss (before its coefficient).",
    ),
    Exported("rss_gb", "lmforge_rss_bytes", "Resident memory of the training process.", GB),
    Exported(
        "gpu_mem_allocated_gb", "lmforge_gpu_memory_allocated_bytes", "torch CUDA memory allocated.", GB
    ),
    Exported("gpu_mem_reserved_gb", "lmforge_gpu_memory_reserved_bytes", "torch CUDA memory reserved.", GB),
    Exported("gpu_mem_peak_gb", "lmforge_gpu_memory_peak_bytes", "Peak torch CUDA memory allocated.", GB),
    # SystemSampler.latest() keys (lmforge.monitor.system):
    Exported("sys_cpu_percent", "lmforge_sys_cpu_percent", "System-wide CPU use, percent."),
    Exported(
        "sys_process_cpu_percent",
        "lmforge_sys_process_cpu_percent",
        "This process's CPU, percent of one core.",
    ),
    Exported(
        "sys_children_cpu_percent", "lmforge_sys_children_cpu_percent", "Child processes' CPU (data workers)."
    ),
    Exported("sys_process_rss_gb", "lmforge_sys_process_rss_bytes", "This process's resident memory.", GB),
    Exported(
        "sys_children_rss_gb", "lmforge_sys_children_rss_bytes", "Child processes' resident memory.", GB
    ),
    Exported("sys_mem_used_gb", "lmforge_sys_memory_used_bytes", "System memory in use.", GB),
    Exported("sys_mem_available_gb", "lmforge_sys_memory_available_bytes", "System memory available.", GB),
    Exported("sys_mem_percent", "lmforge_sys_memory_percent", "System memory in use, percent."),
    Exported("sys_disk_read_mb_s", "lmforge_sys_disk_read_bytes_per_second", "Disk reads, all disks.", MB),
    Exported("sys_disk_write_mb_s", "lmforge_sys_disk_write_bytes_per_second", "Disk writes, all disks.", MB),
    Exported("sys_net_sent_mb_s", "lmforge_sys_network_sent_bytes_per_second", "Network sent, all NICs.", MB),
    Exported("sys_net_recv_mb_s", "lmforge_sys_network_received_bytes_per_second", "Network received.", MB),
    Exported("sys_gpu_util_percent", "lmforge_sys_gpu_utilization_percent", "GPU busy time, percent (NVML)."),
    Exported("sys_gpu_mem_util_percent", "lmforge_sys_gpu_memory_busy_percent", "GPU memory busy, percent."),
    Exported(
        "sys_gpu_mem_used_gb", "lmforge_sys_gpu_memory_used_bytes", "GPU memory in use (all processes).", GB
    ),
    Exported("sys_gpu_mem_total_gb", "lmforge_sys_gpu_memory_total_bytes", "GPU memory size.", GB),
    Exported("sys_gpu_mem_allocated_gb", "lmforge_sys_gpu_memory_allocated_bytes", "torch allocated.", GB),
    Exported("sys_gpu_mem_reserved_gb", "lmforge_sys_gpu_memory_reserved_bytes", "torch reserved.", GB),
    Exported("sys_gpu_temp_c", "lmforge_sys_gpu_temperature_celsius", "GPU temperature."),
    Exported("sys_gpu_power_w", "lmforge_sys_gpu_power_watts", "GPU power draw."),
    Exported("time", "lmforge_last_update_timestamp_seconds", "Unix time of the last metrics record."),
)
EVENTS_COUNTER = "lmforge_events_total"
EXPORTED_NAMES: frozenset[str] = frozenset({m.name for m in METRICS} | {EVENTS_COUNTER})
# Event kinds whose counters exist from the start at 0, so that increase() sees their first event.
KNOWN_EVENT_KINDS: tuple[str, ...] = tuple(dict.fromkeys((*ALERT_KINDS, "signal", "alert_sent")))


class PrometheusExporter:
    """Gauges from metrics records, a counter of events, served over HTTP by prometheus_client."""

    def __init__(self, cfg: PrometheusConfig, run_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.cfg = cfg
        self.run_name = run_name
        self.port: int | None = None
        self._server: Any = None
        self._thread: Any = None
        if not _is_loopback(cfg.host):
            log.warning(
                "monitor.prometheus.host=%s: /metrics will be reachable from other machines; training "
                "metrics reveal run names and progress. Use 127.0.0.1 and scrape through a tunnel or proxy.",
                cfg.host,
            )
        self.registry = CollectorRegistry(auto_describe=True)
        # Series appear on their first value: a key the run never logs (GPU memory on a CPU
        # run) exports no sample rather than a misleading 0.
        self._gauges = {m.key: Gauge(m.name, m.help, ["run"], registry=self.registry) for m in METRICS}
        self._events = Counter(EVENTS_COUNTER, "Run events by kind.", ["run", "kind"], registry=self.registry)
        for kind in KNOWN_EVENT_KINDS:
            self._events.labels(run=run_name, kind=kind)

    def start(self) -> int:
        """Serve /metrics on cfg.host:cfg.port in a daemon thread; returns the port (cfg.port 0: a free one)."""
        from prometheus_client import start_http_server

        try:
            self._server, self._thread = start_http_server(
                self.cfg.port, addr=self.cfg.host, registry=self.registry
            )
        except OSError as err:
            raise UserInputError(
                f"monitor.prometheus: cannot listen on {self.cfg.host}:{self.cfg.port} ({err.strerror or err}); "
                "choose another monitor.prometheus.port (0 picks a free one)"
            ) from None
        self.port = int(self._server.server_port)
        log.info("Prometheus metrics on http://%s:%d/metrics", _url_host(self.cfg.host), self.port)
        return self.port

    def update(self, record: dict[str, Any]) -> None:
        """Set the gauges of every known key in a metrics record (or a SystemSampler sample)."""
        for metric in METRICS:
            if metric.key in record:
                value = _as_float(record[metric.key])
                if value is not None:
                    self._gauges[metric.key].labels(run=self.run_name).set(value * metric.scale)
        if "step" in record and "time" not in record:
            self._gauges["time"].labels(run=self.run_name).set(time.time())

    def count_event(self, event: dict[str, Any]) -> None:
        """Count one event by kind (an EventLog listener)."""
        self._events.labels(run=self.run_name, kind=str(event.get("kind", "unknown"))).inc()

    __call__ = count_event

    def stop(self) -> None:
        """Stop serving and free the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None


def _as_float(value: Any) -> float | None:
    """Numbers, bools and the "nan"/"inf" strings metrics.jsonl keeps; None for anything else."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "+inf"):
        return float(value)
    return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


__all__ = [
    "METRICS",
    "EXPORTED_NAMES",
    "PrometheusExporter",
]
