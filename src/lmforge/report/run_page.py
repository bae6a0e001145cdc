"""report.html for one run: summary, curves with event markers, events, data, checkpoints,
export verdicts and the resolved config."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from lmforge.config.dotted import flatten
from lmforge.config.schema import DistributedConfig, ModelConfig, TrainConfig
from lmforge.config.stages import stage_spec
from lmforge.report.generation_section import generation_section
from lmforge.report.html import (
    esc,
    fmt_duration,
    fmt_number,
    fmt_time,
    key_values,
    page,
    status_badge,
    table,
    verdict,
)
from lmforge.report.load import RunSummary, estimated_step
from lmforge.report.observability_sections import histograms_section, profile_section
from lmforge.report.plots import EVENT_COLORS, PALETTE, Chart, Line, Marker, render_chart, render_histogram
from lmforge.report.stage_metrics_section import stage_metrics_sections
from lmforge.run_layout import RunPaths

UNMARKED_KINDS = ("finished",)  # the end of the run is the end of the axis
MEMORY_KEYS = (
    "rss_gb",
    "gpu_mem_allocated_gb",
    "gpu_mem_reserved_gb",
    "gpu_mem_peak_gb",
    "sys_gpu_mem_used_gb",
)
# (title, metric id, [(metric key, label)]) for the curves section.
CHARTS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("Loss", "loss", (("loss", "train loss"), ("eval_loss", "eval loss"))),
    ("Learning rate", "lr", (("lr", "lr"),)),
    ("Gradient norm (before clipping)", "grad_norm", (("grad_norm", "grad norm"),)),
    ("Throughput, tokens/s (non-pad)", "tokens_per_s", (("tokens_per_s", "tokens/s"),)),
    ("Model FLOPs utilisation", "mfu", (("mfu", "MFU"),)),
    ("Memory, GB", "memory", tuple((key, key.removesuffix("_gb")) for key in MEMORY_KEYS)),
    ("Share of wall time waiting for data", "data_wait_share", (("data_wait_share", "data wait"),)),
    ("Communication, share of step time", "comm_share", (("comm_share", "any collective"),)),
    (
        "Communication, seconds per step",
        "comm_s",
        (
            ("comm_s", "any collective"),
            ("comm_all_reduce_s", "all-reduce"),
            ("comm_reduce_scatter_s", "reduce-scatter"),
            ("comm_all_gather_s", "all-gather"),
        ),
    ),
)
SPARSE_KEYS = ("eval_loss", "eval_ppl")
OPTIONAL_CHARTS = ("comm_share", "comm_s")
LINEAR_METRICS = ("mfu", "data_wait_share", "comm_share")


def render_run(run: RunSummary) -> str:
    body = [
        f"<h1>{esc(run.name)} {status_badge(run.status)}</h1>",
        f'<p class="missing">{esc(run.root)}</p>',
        *(f'<p class="fail">{esc(problem)}</p>' for problem in run.problems),
        "<h2>Summary</h2>",
        summary_table(run),
        "<h2>Curves</h2>",
        curves(run),
        "<h2>Events</h2>",
        events_table(run),
        "<h2>Data</h2>",
        data_section(run.data_report),
        "<h2>Checkpoints</h2>",
        checkpoints_section(run),
        "<h2>Export</h2>",
        export_section(run.export),
        generation_section(run),
        stage_metrics_sections(run),
        profile_section(run.root),
        histograms_section(run.root),
        "<h2>Resolved config</h2>",
        f'<pre class="config">{esc(run.config_text) or "(no config.yaml)"}</pre>',
        "<h2>Environment</h2>",
        environment_section(run.manifest),
    ]
    return page(f"lmforge report: {run.name}", body)


def summary_table(run: RunSummary) -> str:
    cfg = run.config
    train = cfg.train if "train" in cfg.sections else None
    sources = [str(s.path or s.dataset) for s in cfg.data.train] if cfg.data is not None else []
    loss, eval_loss = run.last_finite("loss"), run.last_finite("eval_loss")
    best = run.best_eval()
    throughput = run.series.get("tokens_per_s")
    events = Counter(str(e.get("kind")) for e in run.events)
    rows: list[tuple[str, Any]] = [
        ("status", status_badge(run.status)),
        ("model", _model_line(cfg.model)),
        ("stage / method", f"{train.stage} / {train.method}" if train else "? / ?"),
        ("data", ", ".join(sources) or "?"),
        ("strategy", _strategy_line(cfg.distributed, run.manifest)),
        ("started", fmt_time(run.started)),
        ("duration", fmt_duration(run.duration_s)),
        ("steps", f"{run.last_step if run.last_step is not None else 0} of {_planned_steps(train)}"),
        *(
            _reward_headline(run)  # online RL: the reward is the measure, its policy loss sits near 0
            if train is not None and stage_spec(train.stage).online_rl
            else [
                ("final train loss", f"{fmt_number(loss[1])} (step {loss[0]})" if loss else "not recorded"),
                (
                    "final eval loss",
                    f"{fmt_number(eval_loss[1])} (step {eval_loss[0]})" if eval_loss else "no eval",
                ),
            ]
        ),
        ("best eval", f"{best[0]} {fmt_number(best[1])} (step {best[2]})" if best else "no eval"),
        ("tokens seen", fmt_number(_last_value(run, "tokens_seen"))),
        ("median tokens/s", fmt_number(_median(throughput.finite()) if throughput else None)),
        ("events", ", ".join(f"{kind} {n}" for kind, n in sorted(events.items())) or "none"),
        ("final model", str(RunPaths(run.root).final) if run.has_final else "none"),
    ]
    return key_values(rows)


REWARD_SPAN = 10  # logged steps averaged at each end of an RL run's reward


def _reward_headline(run: RunSummary) -> list[tuple[str, Any]]:
    """An online-RL run's summary rows: the reward (its first and last logged steps' means, as one
    step's reward is noisy), the eval reward, then the policy loss, said to be near zero by design."""
    reward, eval_reward = run.last_finite("reward"), run.last_finite("eval_reward")
    loss = run.last_finite("loss")
    series = run.series.get("reward")
    values = series.finite() if series is not None else np.array([])
    span = min(REWARD_SPAN, len(values))
    trend = (
        f"; mean of the first {span} logged steps {fmt_number(float(values[:span].mean()))} -> "
        f"last {span} {fmt_number(float(values[-span:].mean()))}"
        if len(values) >= 2
        else ""
    )
    return [
        ("final reward", f"{fmt_number(reward[1])} (step {reward[0]}){trend}" if reward else "not recorded"),
        (
            "final eval reward",
            f"{fmt_number(eval_reward[1])} (step {eval_reward[0]})" if eval_reward else "no eval",
        ),
        (
            "final policy loss",
            f"{fmt_number(loss[1])} (step {loss[0]}; near zero by design in online RL: judge the run by its reward)"
            if loss
            else "not recorded",
        ),
    ]


def curves(run: RunSummary) -> str:
    markers = [
        Marker(step, str(e.get("kind")), str(e.get("message", "")))
        for e in run.events
        if e.get("kind") not in UNMARKED_KINDS
        and (step := estimated_step(e, run.events, run.last_step)) is not None
    ]
    charts = []
    for title, metric, keys in CHARTS:
        if metric in OPTIONAL_CHARTS and not any(key in run.series for key, _ in keys):
            continue  # recorded by some runs only (communication: distributed runs)
        lines = [
            Line(label, run.series[key].steps, run.series[key].values, PALETTE[i], dots=key in SPARSE_KEYS)
            for i, (key, label) in enumerate(keys)
            if key in run.series
        ]
        log_ok = metric not in LINEAR_METRICS
        charts.append(render_chart(Chart(title, metric, lines, markers, log_ok=log_ok)))
    return _event_key(markers) + '<div class="charts">' + "".join(charts) + "</div>"


def events_table(run: RunSummary) -> str:
    if not run.events:
        return '<p class="missing">no events (events/events.jsonl is empty or absent)</p>'
    rows = []
    for event in run.events:
        step = event.get("step")
        shown = (
            step
            if isinstance(step, int) and step >= 0
            else f"~{estimated_step(event, run.events, run.last_step)}"
        )
        extra = {k: v for k, v in event.items() if k not in ("time", "step", "kind", "message")}
        rows.append(
            [
                fmt_time(event.get("time") if isinstance(event.get("time"), int | float) else None),
                shown,
                event.get("kind", ""),
                event.get("message", ""),
                ", ".join(f"{k}={v}" for k, v in extra.items()),
            ]
        )
    return table(["time", "step", "kind", "message", "details"], rows, css="events")


def data_section(report: dict[str, Any] | None) -> str:
    if report is None:
        return '<p class="missing">no data_report.json</p>'
    parts = ["<h3>Kept and dropped</h3>", table(["what", "count"], _kept_dropped(report))]
    mix = _mix_rows(report)
    if mix:
        title = (
            "<h3>Mix of sources (trained on so far)</h3>"
            if report.get("streaming")
            else "<h3>Mix of sources (planned; the sampler shuffles it)</h3>"
        )
        parts += [title, table(["source", "weight", "tokens", "share", "epochs"], mix)]
    for split in ("train", "eval"):
        info = report.get(split)
        if not isinstance(info, dict):
            continue
        packing = info.get("packing")
        if isinstance(packing, dict) and "efficiency" in packing:
            parts.append(
                f"<p>{split} packing efficiency: <b>{esc(fmt_number(packing['efficiency']))}</b> "
                f"({esc(packing.get('rows', '?'))} rows for {esc(packing.get('samples', '?'))} samples)</p>"
            )
        histogram = info.get("length_histogram")
        if isinstance(histogram, dict):
            parts.append(
                render_histogram(
                    f"{split} sample lengths",
                    f"length_histogram_{split}",
                    list(histogram.get("edges") or []),
                    list(histogram.get("counts") or []),
                )
            )
        lengths = {k: v for k, v in info.items() if "length" in k or "tokens_p" in k or k.endswith("_max")}
        if lengths and not isinstance(histogram, dict):
            parts.append(
                f"<p>{split} lengths: {esc(', '.join(f'{k} {fmt_number(v)}' for k, v in lengths.items()))} "
                '<span class="missing">(no length histogram recorded)</span></p>'
            )
    flat = flatten({k: v for k, v in report.items() if k != "fingerprint"})
    parts.append("<details><summary>full data report</summary>" + key_values(flat.items()) + "</details>")
    return "".join(parts)


def checkpoints_section(run: RunSummary) -> str:
    if not run.checkpoints:
        return '<p class="missing">no checkpoints/step-N directories</p>'
    best_step = run.best.get("step") if run.best else None
    rows = []
    for status in run.checkpoints:
        rows.append(
            [
                status.step,
                str(status.path.name),
                verdict(status.complete),
                status.problem or "marker, manifest and every file's sha256 verified",
                "best" if status.step == best_step else "",
            ]
        )
    return table(["step", "directory", "complete", "verification", ""], rows, css="checkpoints")


def export_section(export: dict[str, Any] | None) -> str:
    if not export:
        return '<p class="missing">no export (export/export.json absent: export.formats was empty)</p>'
    rows = []
    for fmt, artifact in (export.get("artifacts") or {}).items():
        check = artifact.get("verification") or {}
        parity = check.get("parity") or {}
        accuracy = parity.get("accuracy") or {}
        rows.append(
            [
                fmt,
                artifact.get("dtype", ""),
                check.get("precision", ""),
                verdict(check.get("passed") if check else None),
                check.get("runtime", ""),
                (check.get("integrity") or {}).get("status", ""),
                parity.get("ppl_artifact"),
                parity.get("ppl_reference"),
                parity.get("ppl_increase"),
                parity.get("top1_agreement"),
                accuracy.get("artifact"),
                accuracy.get("reference"),
                parity.get("logits_max_abs_diff"),
                parity.get("greedy_prefix"),
                "; ".join(check.get("failures") or []) or parity.get("skipped", ""),
                artifact.get("dir") or "removed (failed its gates)",
            ]
        )
    headers = ["format", "dtype", "precision", "verdict", "runtime", "integrity", "ppl export", "ppl trained"]
    headers += ["ppl increase", "top-1 agreement", "accuracy export", "accuracy trained", "max |logit diff|"]
    headers += ["greedy prefix", "failures / notes", "directory"]
    return f"<p>reference: {esc(export.get('reference', '?'))}</p>" + table(headers, rows, css="export")


def environment_section(manifest: dict[str, Any]) -> str:
    if not manifest:
        return '<p class="missing">no manifest.json</p>'
    return key_values(flatten(manifest).items())


def _event_key(markers: list[Marker]) -> str:
    kinds = sorted({m.kind for m in markers})
    if not kinds:
        return '<p class="missing">no guardrail events to mark</p>'
    keys = "".join(
        f'<span class="key" style="background:{EVENT_COLORS.get(k, "#333")}"></span>{esc(k)}' for k in kinds
    )
    return f"<p>event markers (dashed lines; hover for the message):{keys}</p>"


def _kept_dropped(report: dict[str, Any]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    counts = _section(report, "rows")
    for key in ("rows_read", "rows_kept", "rows_bad"):
        if key in counts:
            rows.append([key.replace("_", " "), counts[key]])
    for reason, n in (counts.get("bad_by_reason") or {}).items():
        rows.append([f"bad row: {reason}", n])
    for reason, n in (report.get("dropped") or {}).items():
        rows.append([f"dropped: {reason}", n])
    train = _section(report, "train")
    for key in ("documents", "samples", "rows", "tokens", "blocks", "empty_documents_skipped"):
        if isinstance(train.get(key), int):
            rows.append([f"train {key.replace('_', ' ')}", train[key]])
    if isinstance(train.get("remainder_tokens_dropped"), int):
        rows.append(["dropped: remainder tokens (partial last block)", train["remainder_tokens_dropped"]])
    for key in ("train_blocks", "eval_blocks", "exact_duplicates_in_train", "eval_samples_also_in_train"):
        if isinstance(report.get(key), int):
            rows.append([key.replace("_", " "), report[key]])
    return rows


def _mix_rows(report: dict[str, Any]) -> list[list[Any]]:
    """One row per training source of a mixed stream or token store: its weight, the tokens it gave
    the mix, their share, and how many passes over the source that was (an upsampled source > 1)."""
    sources = _section(report, "train").get("sources") or []
    mix = report.get("mix")
    if not isinstance(mix, list):  # a token store plans its mix exactly: blocks per source
        mix = _planned_mix(sources, report.get("block_length"))
    if not mix:
        return []
    rows = []
    for index, entry in enumerate(mix):
        source = sources[index] if index < len(sources) and isinstance(sources[index], dict) else {}
        epochs = entry.get("epochs", source.get("epochs", ""))
        share = entry.get("share")
        rows.append(
            [
                entry.get("path", index),
                entry.get("weight", ""),
                entry.get("tokens", ""),
                f"{share:.1%}" if isinstance(share, int | float) else "",
                fmt_number(epochs) if isinstance(epochs, int | float) else epochs,
            ]
        )
    return rows


def _planned_mix(sources: list[Any], block_length: Any) -> list[dict[str, Any]]:
    planned = [s for s in sources if isinstance(s, dict) and "planned_blocks" in s]
    if not planned or len(planned) != len(sources) or not isinstance(block_length, int):
        return []
    total = sum(s["planned_blocks"] for s in planned) or 1
    return [
        {
            "path": s.get("path"),
            "weight": s.get("weight"),
            "tokens": s["planned_blocks"] * block_length,
            "share": s["planned_blocks"] / total,
        }
        for s in planned
    ]


def _section(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    return value if isinstance(value, dict) else {}


def _model_line(model: ModelConfig | None) -> str:
    if model is None:
        return "?"
    return f"{model.path or model.preset or 'inline config'} ({model.dtype}, attention {model.attn_implementation})"


def _planned_steps(train: TrainConfig | None) -> str:
    if train is None:
        return "?"
    return str(train.max_steps) if train.max_steps else f"{train.epochs:g} epoch(s)"


def _strategy_line(dist: DistributedConfig, manifest: dict[str, Any]) -> str:
    """The engine the run really used (manifest.json records it); the config's choice for runs
    written before the manifest did."""
    hardware = manifest.get("hardware") or {}
    devices = ", ".join(hardware.get("gpus") or []) or f"CPU ({hardware.get('cpu_count', '?')} cores)"
    used = manifest.get("distributed")
    if isinstance(used, dict) and used.get("engine"):
        engine = str(used["engine"])
        strategy = "single process" if engine == "none" else engine
        if engine == "deepspeed" and used.get("zero_stage") is not None:
            strategy += f" ZeRO-{used['zero_stage']}"
        if engine != "none":
            strategy += f" x {used.get('world_size', '?')} processes"
        layout = used.get("layout")
        if isinstance(layout, dict) and int(layout.get("tensor", 1)) > 1:
            strategy += f" (mesh: data {layout.get('data')} x tensor {layout['tensor']})"
        return f"{strategy} on {devices}"
    strategy = dist.strategy
    if dist.strategy == "deepspeed":
        strategy += f", ZeRO-{dist.zero_stage}"
    return f"{strategy} on {devices}"


def _last_value(run: RunSummary, key: str) -> float | None:
    last = run.last_finite(key)
    return last[1] if last else None


def _median(values: np.ndarray) -> float | None:
    return float(np.median(values)) if len(values) else None
