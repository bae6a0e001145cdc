"""The report's "Generation quality" section: how the greedy completions of eval prompts scored
at each eval step (eval_bleu, eval_chrf, ... in metrics.jsonl; all on 0-100, see
evaluate/quality.py), as a chart and a table, and the completions of the last eval step
(<run>/eval_samples.jsonl), each beside its prompt and reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.monitor.metrics import read_step_records
from lmforge.report.html import esc, table
from lmforge.report.load import RunSummary
from lmforge.report.plots import PALETTE, Chart, Line, render_chart
from lmforge.run_layout import RunPaths

# metrics.jsonl key -> column label, in the order shown.
QUALITY_KEYS = {
    "eval_bleu": "BLEU",
    "eval_chrf": "chrF",
    "eval_rouge1": "ROUGE-1",
    "eval_rouge2": "ROUGE-2",
    "eval_rougeL": "ROUGE-L",
    "eval_exact_match": "exact match",
    "eval_bertscore": "BERTScore",
}
MAX_TABLE_ROWS = 50  # eval steps listed; a longer run shows the first and the latest ones
MAX_SAMPLE_CHARS = 2000  # a long prompt (a whole chat template) is cut in the page, not on disk
SAMPLES_STYLE = "<style>table.samples td{white-space:pre-wrap;max-width:36em}</style>"  # newlines kept


def generation_section(run: RunSummary) -> str:
    """<h2>Generation quality</h2> with a chart and a table of the scores per eval step and the last
    eval step's samples; "" when the run recorded neither."""
    keys = [key for key in QUALITY_KEYS if key in run.series]
    samples_step, samples = latest_samples(RunPaths(run.root).eval_samples)
    if not keys and not samples:
        return ""
    parts = ["<h2>Generation quality</h2>"]
    if keys:
        parts += [
            '<p class="missing">greedy completions of the first eval prompts at each eval step, '
            "scored against their references; every score on 0-100</p>",
            _chart(run, keys),
            _scores_table(run, keys),
        ]
    if samples:
        parts += [f"<h3>Samples at step {esc(samples_step)}</h3>", _samples_table(samples)]
    return "".join(parts)


def latest_samples(path: Path) -> tuple[int | None, list[dict[str, Any]]]:
    """(step, samples) of the last eval step in eval_samples.jsonl; (None, []) when there is none.
    Torn or foreign lines are skipped: the report never fails on a file a crash cut short."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for record in read_step_records(path):
        by_step.setdefault(record["step"], []).append(record)
    if not by_step:
        return None, []
    last = max(by_step)
    return last, by_step[last]


def _chart(run: RunSummary, keys: list[str]) -> str:
    lines = [
        Line(QUALITY_KEYS[key], run.series[key].steps, run.series[key].values, PALETTE[i], dots=True)
        for i, key in enumerate(keys)
    ]
    return (
        '<div class="charts">'
        + render_chart(Chart("Generation quality (0-100)", "generation_quality", lines, log_ok=False))
        + "</div>"
    )


def _scores_table(run: RunSummary, keys: list[str]) -> str:
    """One row per eval step that has a score; the first and the latest steps of a long run."""
    values = {
        key: dict(zip(run.series[key].steps.tolist(), run.series[key].values.tolist(), strict=True))
        for key in keys
    }
    steps = sorted({step for column in values.values() for step in column})
    if len(steps) > MAX_TABLE_ROWS:
        half = MAX_TABLE_ROWS // 2
        steps = steps[:half] + steps[-half:]
    rows = [[step, *(values[key].get(step) for key in keys)] for step in steps]
    return table(["step", *(QUALITY_KEYS[key] for key in keys)], rows)


def _samples_table(samples: list[dict[str, Any]]) -> str:
    rows = [[_text(s.get("prompt")), _text(s.get("completion")), _text(s.get("reference"))] for s in samples]
    return SAMPLES_STYLE + table(["prompt", "completion", "reference"], rows, css="samples")


def _text(value: Any) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= MAX_SAMPLE_CHARS else text[:MAX_SAMPLE_CHARS] + " [...]"
