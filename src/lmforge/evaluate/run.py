"""`lmforge eval`: the evaluation summary of a run's final model or of a model directory.

The summary is one JSON-ready dict: per data file results (perplexity; accuracy and
generation quality for QA rows), the run's own eval data when given a config (perplexity, and
the generation quality of rows with an answer: sft, dpo, kto), harness task results, and
top-level totals (`accuracy`, `correct`, `total` over every QA file; `perplexity` of the run's
eval data, else of the first data file). Generation quality (evaluate/quality.py) scores the
same greedy answers that accuracy does: BLEU, chrF, ROUGE-1/2/L and exact match, on 0-100.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.config.stages import stage_spec
from lmforge.errors import UserInputError
from lmforge.evaluate.harness import require_harness, run_harness_tasks
from lmforge.evaluate.loading import load_for_inference
from lmforge.evaluate.quality import generation_quality, require_bertscore
from lmforge.evaluate.rows import data_kind, read_qa_rows, read_texts

if TYPE_CHECKING:
    from lmforge.evaluate.accuracy import Scoring

log = logging.getLogger(__name__)
TEXT_BLOCK_SIZE = 256  # tokens per perplexity block of plain text
QUALITY_LABELS = {
    "bleu": "BLEU",
    "chrf": "chrF",
    "rouge1": "ROUGE-1",
    "rouge2": "ROUGE-2",
    "rougeL": "ROUGE-L",
    "exact_match": "exact match",
    "bertscore": "BERTScore",
}


@dataclass
class EvalRequest:
    """What `lmforge eval` was asked for."""

    target: Path  # a YAML config or a model directory
    data: list[Path] = field(default_factory=list)
    scoring: Scoring = "exact"
    max_new_tokens: int = 32
    limit: int | None = None
    tasks: list[str] = field(default_factory=list)
    adapter: Path | None = None
    batch_size: int = 8
    columns: dict[str, str] | None = None  # QA rows: {"question": COL, "answer": COL}
    bertscore_model: str | None = None  # also BERTScore F1 with this encoder (the bertscore extra)


def is_config(target: Path) -> bool:
    return target.suffix in (".yaml", ".yml")


def evaluate(request: EvalRequest) -> tuple[Path, dict[str, Any]]:
    """Run every requested evaluation; returns the evaluated model directory and the summary."""
    if request.tasks:
        require_harness()  # fail before minutes of loading, not after
    require_bertscore(request.bertscore_model, "--bertscore-model")
    sources = [
        _read_source(path, request.limit, request.columns) for path in request.data
    ]  # bad rows fail before loading
    summary: dict[str, Any] = {"data": {}}
    if is_config(request.target):
        model_dir, model, tokenizer = _evaluate_run(request, summary)
    else:
        model_dir = request.target
        model, tokenizer = load_for_inference(model_dir, request.adapter)
    summary = {
        "model": str(model_dir),
        "adapter": str(request.adapter) if request.adapter else None,
        **summary,
    }
    for path, source in zip(request.data, sources, strict=True):
        summary["data"][str(path)] = _evaluate_source(model, tokenizer, source, request)
    if request.tasks:
        summary["tasks"] = run_harness_tasks(
            model, tokenizer, request.tasks, limit=request.limit, batch_size=request.batch_size
        )
    summary.update(_totals(summary))
    return model_dir, summary


def _evaluate_run(request: EvalRequest, summary: dict[str, Any]) -> tuple[Path, Any, Any]:
    """The run's final/ model on the config's eval data, as the data stage prepares it."""
    from lmforge.config import load_config
    from lmforge.data.run_data import prepare_run_data
    from lmforge.evaluate.perplexity import dataset_perplexity
    from lmforge.run_layout import RunPaths

    if not request.target.is_file():
        raise UserInputError(f"{request.target}: no such config file")
    cfg = load_config(request.target)
    final = RunPaths(cfg.run.dir).final
    if not final.is_dir():
        raise UserInputError(
            f"{final}: the run has no final/ model yet; train it first (lmforge train {request.target})"
        )
    model, tokenizer = load_for_inference(final, request.adapter)
    _, _, data = prepare_run_data(cfg, for_training=False)  # eval never batches by micro_batch_size
    if stage_spec(cfg.train.stage).eval_rows_answer and data.eval is not None and len(data.eval) > 0:  # type: ignore[arg-type]
        summary["run_eval_generations"] = _run_eval_generations(
            model,
            tokenizer,
            data.eval,
            request,
            image_processor=data.image_processor,
            processor=data.processor,
        )
    if data.eval is None or len(data.eval) == 0:  # type: ignore[arg-type]
        note = "the config has no eval data (set data.eval or data.eval_fraction); no run perplexity"
    elif data.conversational_rows:  # preference-style data batched by TRL: no plain next-token loss
        note = f"the run's eval data is {cfg.train.stage} data, which has no plain perplexity"
    else:
        assert data.collator is not None  # conversational_rows is False
        summary["run_eval"] = dataset_perplexity(
            model, data.eval, data.collator, batch_size=request.batch_size, limit=request.limit
        )
        return final, model, tokenizer
    log.warning("%s: %s", request.target, note)
    summary["run_eval"] = None
    summary["notes"] = [note]
    return final, model, tokenizer


def _read_source(path: Path, limit: int | None, columns: dict[str, str] | None) -> tuple[str, Any]:
    """("text", documents) or ("qa", rows), read and checked."""
    if columns is None and data_kind(path) == "text":
        return "text", read_texts(path)
    return "qa", read_qa_rows(path, columns)[:limit]


def _evaluate_source(
    model: Any, tokenizer: Any, source: tuple[str, Any], request: EvalRequest
) -> dict[str, Any]:
    from lmforge.evaluate.accuracy import score_answers
    from lmforge.evaluate.generation import chat_messages, generate_answers
    from lmforge.evaluate.perplexity import answer_perplexity, text_perplexity

    kind, content = source
    if kind == "text":
        block_size = min(TEXT_BLOCK_SIZE, _position_limit(model))
        result = text_perplexity(model, tokenizer, content, block_size=block_size, limit=request.limit)
        return {"kind": "text", **result}
    replies = generate_answers(
        model,
        tokenizer,
        [chat_messages(row["question"]) for row in content],
        max_new_tokens=request.max_new_tokens,
        batch_size=request.batch_size,
    )
    answers = [row["answer"] for row in content]
    answer_ppl = answer_perplexity(model, tokenizer, content, batch_size=request.batch_size)
    return {
        "kind": "qa",
        **score_answers(content, replies, request.scoring),
        "answer_perplexity": answer_ppl["perplexity"],
        "answer_tokens": answer_ppl["tokens"],
        "generation_quality": _quality(replies, answers, request) if replies else None,
    }


def _quality(predictions: list[str], references: list[str], request: EvalRequest) -> dict[str, float]:
    return generation_quality(predictions, references, bertscore_model=request.bertscore_model)


def _run_eval_generations(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    request: EvalRequest,
    *,
    image_processor: Any = None,
    processor: Any = None,
) -> dict[str, Any]:
    """Greedy completions of the run's eval prompts (`--limit` of them, else all) scored against
    the answers the rows carry: what the eval steps of training measured on a few of them (with
    their images, for a vision-language run)."""
    from lmforge.evaluate.accuracy import EXAMPLES_SHOWN
    from lmforge.evaluate.samples import complete_prompts, sample_prompts

    count = request.limit if request.limit is not None else len(dataset)
    prompts = sample_prompts(
        dataset, tokenizer, count, reference_tokens=request.max_new_tokens, processor=processor
    )
    samples = complete_prompts(
        model,
        tokenizer,
        prompts,
        request.max_new_tokens,
        batch_size=request.batch_size,
        image_processor=image_processor,
    )
    scored = [s for s in samples if s.reference is not None]
    quality = (
        _quality([s.completion for s in scored], [s.reference or "" for s in scored], request)
        if scored
        else None
    )
    examples = [
        {"prompt": s.prompt, "expected": s.reference, "got": s.completion} for s in samples[:EXAMPLES_SHOWN]
    ]
    return {
        "prompts": len(samples),
        "scored": len(scored),
        "generation_quality": quality,
        "examples": examples,
    }


def _position_limit(model: Any) -> int:
    """The longest sequence the model's position table takes (no limit found: the block size)."""
    for key in ("max_position_embeddings", "n_positions"):
        limit = getattr(model.config, key, None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return TEXT_BLOCK_SIZE


def _totals(summary: dict[str, Any]) -> dict[str, Any]:
    qa = [r for r in summary["data"].values() if r["kind"] == "qa"]
    correct, total = sum(r["correct"] for r in qa), sum(r["total"] for r in qa)
    perplexity = (summary.get("run_eval") or {}).get("perplexity")
    if perplexity is None and summary["data"]:
        first = next(iter(summary["data"].values()))
        perplexity = first.get("perplexity", first.get("answer_perplexity"))
    return {
        "accuracy": correct / total if total else None,
        "correct": correct if qa else None,
        "total": total if qa else None,
        "perplexity": perplexity,
    }


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats as None, so the summary is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as lines for a terminal (what `lmforge eval` prints without --json)."""
    lines = []
    if "run_eval" in summary:
        run_eval = summary["run_eval"]
        lines.append(
            f"run eval data: none ({'; '.join(summary.get('notes', []))})"
            if run_eval is None
            else f"run eval data: perplexity {_number(run_eval['perplexity'])} over {run_eval['tokens']} tokens"
        )
    generations = summary.get("run_eval_generations")
    if generations is not None:
        lines.append(
            f"run eval data: generation quality over {generations['scored']} of {generations['prompts']} "
            f"prompts: {quality_line(generations['generation_quality'])}"
        )
    for path, result in summary["data"].items():
        if result["kind"] == "text":
            lines.append(f"{path}: perplexity {_number(result['perplexity'])} over {result['tokens']} tokens")
            continue
        lines.append(
            f"{path}: accuracy {_number(result['accuracy'])} ({result['correct']}/{result['total']}, "
            f"{result['scoring']}); answer perplexity {_number(result['answer_perplexity'])}"
        )
        lines.append(f"  generation quality: {quality_line(result.get('generation_quality'))}")
        for example in result["examples"]:
            mark = "ok " if example["correct"] else "BAD"
            lines.append(
                f"  {mark} question: {example['question']!r}  expected: {example['expected']!r}  "
                f"got: {example['got']!r}"
            )
    for task, metrics in summary.get("tasks", {}).items():
        lines.append(f"{task}: {json.dumps(json_safe(metrics), default=str)}")
    return lines


def quality_line(quality: dict[str, float] | None) -> str:
    """ "BLEU 12.34, chrF 40.10, ..." (0-100 scales), or "none" when nothing had a reference."""
    if not quality:
        return "none (no reference answers)"
    return ", ".join(f"{QUALITY_LABELS.get(k, k)} {_score(v)}" for k, v in quality.items())


def _score(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}"


def _number(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3f}"
