"""`lmforge ckpt verify`: is this artifact intact, and does it behave like the model it came from?

Integrity (`lmforge.export.integrity`): the hash manifest when there is one (lmforge seals
checkpoints and exports), else the file structure (safetensors headers and sizes, GGUF and ONNX
parse). Behaviour: the artifact runs in its own runtime and the reference in transformers, on the
same token ids. The gates, what a user ships on, are the perplexity increase, the top-1 agreement
of next-token predictions and, on question/answer data, the drop in greedy task accuracy; at 8 bits
and above the logits and greedy generations must also agree (parity). Every limit has a default per
precision class (stricter at 8 bits than at 4), overridable (`export.gates`, `ckpt verify --max-*`).

A vision-language reference is compared on images: the data's conversation rows with their image
files (`vision_verify.py`), pixels made by each side's own processor. An artifact whose runtime
takes token ids only is compared on text, and the verdict says the images were not checked.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.errors import UserInputError
from lmforge.export.convert import EXPORT_RECORD
from lmforge.export.integrity import check_integrity
from lmforge.export.reference_texts import rendered_texts
from lmforge.export.runtimes import (
    BITS4,
    BITS6,
    FULL,
    HALF,
    INT8,
    Artifact,
    coarsest,
    load_reference,
    log_softmax,
    open_artifact,
    token_logprob_mean,
)
from lmforge.export.vision_verify import Scored, image_rows, images_checked
from lmforge.verbosity import progress_bar

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tolerances:
    """Pass limits. The gates: max_ppl_increase is relative (0.05: perplexity at most 5% above the
    reference's), max_accuracy_drop absolute (0.02: two points of task accuracy, QA data only).
    Parity, checked where it is set: logit_diff is relative to the reference's largest |logit|;
    greedy_prefix is the mean share of generated tokens before the first one that differs (a
    near-tie flipped by rounding ends agreement early but is no defect, so lower precisions ask
    for less, and quantized below 8 bits for none)."""

    max_ppl_increase: float
    min_top1_agreement: float
    max_accuracy_drop: float
    max_logit_diff: float | None = None
    min_greedy_prefix: float | None = None


DEFAULT_TOLERANCES = {
    # fp32 on both sides: only the order of floating-point operations differs.
    FULL: Tolerances(
        max_ppl_increase=1e-4,
        min_top1_agreement=0.99,
        max_accuracy_drop=0.01,
        max_logit_diff=1e-4,
        min_greedy_prefix=0.9,
    ),
    # 16-bit weights: bf16 keeps 8 mantissa bits, so logits move by a few percent of their range.
    HALF: Tolerances(
        max_ppl_increase=1e-2,
        min_top1_agreement=0.95,
        max_accuracy_drop=0.02,
        max_logit_diff=0.1,
        min_greedy_prefix=0.5,
    ),
    # 8-bit blocks with one scale per 32 weights (GGUF q8_0) or per row (ONNX int8, whose
    # activations are quantized too: its largest logit difference was 0.58 of the scale on the
    # quickstart model with perplexity +2% and no answer changed, so no logit limit here).
    INT8: Tolerances(
        max_ppl_increase=3e-2,
        min_top1_agreement=0.9,
        max_accuracy_drop=0.03,
        min_greedy_prefix=0.25,
    ),
    # k-quants: the model is meant to change a little; only what a user measures is gated.
    BITS6: Tolerances(max_ppl_increase=0.05, min_top1_agreement=0.85, max_accuracy_drop=0.05),
    BITS4: Tolerances(max_ppl_increase=0.15, min_top1_agreement=0.75, max_accuracy_drop=0.08),
}


@dataclass
class Verdict:
    path: str
    format: str = ""
    runtime: str = ""
    precision: str = ""
    integrity: dict[str, Any] = field(default_factory=dict)
    reference: str | None = None
    parity: dict[str, Any] = field(default_factory=dict)
    tolerances: dict[str, float] = field(default_factory=dict)
    # A vision-language model's: {"checked": True, "rows", "rows_with_images", "images"} or
    # {"checked": False, "why"}; empty for a text model.
    images: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def verify(
    path: Path,
    *,
    against: Path | None = None,
    data: Path | None = None,
    runtime: str = "auto",
    prompts: int = 4,
    new_tokens: int = 16,
    max_tokens: int = 128,
    max_rows: int = 64,
    max_questions: int = 32,
    tolerances: dict[str, float] | None = None,
) -> Verdict:
    """Check `path`'s integrity and, with a reference, its behaviour: the gates and parity, on the
    first `max_rows` texts or QA rows of `data` (default: built-in texts), task accuracy on the
    first `max_questions` of its QA rows."""
    if not path.exists():
        raise UserInputError(f"{path}: no such file or directory")
    verdict = Verdict(str(path))
    verdict.integrity = check_integrity(path)
    if verdict.integrity["status"] != "ok":
        verdict.failures.append(f"integrity: {verdict.integrity['problem']}")
        return verdict  # a damaged artifact is not worth running
    against = against or recorded_source(path)
    if against is None:
        verdict.parity = {"skipped": "no reference: pass --against REF to compare behaviour"}
        return verdict
    reference, tokenizer = load_reference(against)
    artifact = open_artifact(path, runtime)
    verdict.format, verdict.runtime, verdict.precision = (
        artifact.format,
        artifact.runtime_name,
        artifact.precision,
    )
    verdict.reference = str(against)
    limits = asdict(DEFAULT_TOLERANCES[coarsest(artifact.precision, reference.precision)]) | (
        tolerances or {}
    )
    texts, questions, verdict.images = compared_on(reference, artifact, tokenizer, data, max_tokens, max_rows)
    image_floor = getattr(artifact.runtime, "image_logit_diff_floor", None)
    if image_floor is not None and verdict.images.get("checked") and limits.get("max_logit_diff") is not None:
        limits["max_logit_diff"] = max(limits["max_logit_diff"], image_floor)
    verdict.tolerances = limits
    verdict.parity = compare(artifact, reference, texts, prompts=prompts, new_tokens=new_tokens)
    verdict.parity["data"] = str(data) if data else "built-in texts"
    if questions:
        verdict.parity["accuracy"] = task_accuracy(artifact, reference, tokenizer, questions[:max_questions])
    verdict.failures = judge(verdict.parity, limits)
    return verdict


def recorded_source(path: Path) -> Path | None:
    """The model an lmforge conversion was made from, as recorded next to the artifact."""
    record = (path if path.is_dir() else path.parent) / EXPORT_RECORD
    if not record.is_file():
        return None
    source = Path(json.loads(record.read_text())["source"])
    return source if source.exists() else None


def compared_on(
    reference: Artifact, artifact: Artifact, tokenizer: Any, data: Path | None, max_tokens: int, max_rows: int
) -> tuple[list[Scored], list[dict[str, Any]], dict[str, Any]]:
    """The sequences and questions to compare on, and what the verdict says about images: a text
    model's texts; a vision-language model's rows with their images, when the data has rows and the
    artifact's runtime takes images, else text with the reason the images were not checked."""
    from lmforge.evaluate.rows import data_kind

    processor = getattr(reference.runtime, "processor", None)
    rows = data is not None and data_kind(data) == "qa"
    why = None
    if processor is None:
        pass
    elif not getattr(artifact.runtime, "takes_images", False):
        why = (
            f"{artifact.runtime_name} here takes token ids only, so the model's images could not be fed; "
            f"compared on {'the built-in texts' if rows else 'text'} alone"
        )
        data = None if rows else data
    elif not rows:
        why = (
            "no rows with images to compare on: give rows with images (the run's eval rows, say) as "
            "`ckpt verify --data` or export.verify_data"
        )
    else:
        assert data is not None
        scored, questions = image_rows(processor, tokenizer, data, max_rows)
        return scored, questions, images_checked(scored)
    pairs, questions = held_out(tokenizer, data, max_tokens, max_rows)
    images = {} if processor is None else {"checked": False, "why": why}
    return [(ids, start, ()) for ids, start in pairs], questions, images


def held_out(
    tokenizer: Any, data: Path | None, max_tokens: int, max_rows: int
) -> tuple[list[tuple[list[int], int]], list[dict[str, Any]]]:
    """Token ids to compare on, each with the position its scored tokens start at, and the
    questions to answer when `data` holds QA rows.

    Texts: the data file's texts or built-in texts, every token scored; QA rows: chat-rendered with
    their answers, the answer's tokens scored. Cut to `max_tokens`. Questions: each QA row's chat
    prompt ids and its expected answer."""
    texts, prompts, rows = rendered_texts(tokenizer, data, max_rows)
    questions: list[dict[str, Any]] = []
    for prompt, row in zip(prompts, rows, strict=True):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_tokens = len(tokenizer(row["answer"], add_special_tokens=False)["input_ids"])
        questions.append({"prompt_ids": ids, "answer": row["answer"], "new_tokens": answer_tokens + 8})
    sequences = [tokenizer(text, add_special_tokens=True)["input_ids"][:max_tokens] for text in texts]
    if questions:  # perplexity of the answers, what the model was trained to write, not of the prompts
        scored = [
            (ids, min(len(tokenizer(prompt, add_special_tokens=True)["input_ids"]), len(ids) - 1))
            for ids, prompt in zip(sequences, prompts, strict=True)
        ]
    else:
        scored = [(ids, 1) for ids in sequences]
    scored = [(ids, start) for ids, start in scored if len(ids) >= 4]
    if not scored:
        raise UserInputError(f"{data}: no text of at least 4 tokens to compare on")
    return scored, questions


def task_accuracy(
    artifact: Artifact, reference: Artifact, tokenizer: Any, questions: list[dict[str, Any]]
) -> dict[str, Any]:
    """Greedy answers of both models to the questions, scored exact (whitespace-normalised)
    against the expected answers: each model's accuracy and the drop from reference to artifact."""
    from lmforge.data.chat import stop_token_ids
    from lmforge.evaluate.accuracy import is_correct
    from lmforge.evaluate.generation import until_stop

    stops = stop_token_ids(tokenizer) | {tokenizer.pad_token_id}
    correct = {"artifact": 0, "reference": 0}
    examples: list[dict[str, str]] = []
    for question in progress_bar(questions, desc="verify accuracy", unit="question"):
        answers = {}
        for side, model in (("artifact", artifact), ("reference", reference)):
            ids = _greedy(
                model,
                question["prompt_ids"],
                question["new_tokens"],
                question.get("images", ()),
                cache=side == "reference",
            )
            answers[side] = str(tokenizer.decode(until_stop(ids, stops), skip_special_tokens=True))
            correct[side] += is_correct(answers[side], question["answer"], "exact")
        if len(examples) < 5:
            examples.append({"expected": question["answer"], **answers})
    total = len(questions)
    accuracy = {side: count / total for side, count in correct.items()}
    return {
        "questions": total,
        "artifact": accuracy["artifact"],
        "reference": accuracy["reference"],
        "drop": accuracy["reference"] - accuracy["artifact"],
        "examples": examples,
    }


def compare(
    artifact: Artifact,
    reference: Artifact,
    scored: list[Scored],
    *,
    prompts: int,
    new_tokens: int,
) -> dict[str, Any]:
    """Logit, perplexity and greedy-generation agreement of artifact vs reference (with each
    sequence's images, when it has any)."""
    max_diff = scale = 0.0
    agree = positions = 0
    nll_artifact, nll_reference = [], []
    for ids, start, images in progress_bar(scored, desc="verify logits", unit="seq"):
        ours, ref = _logits(artifact, ids, images), _logits(reference, ids, images)
        if getattr(artifact.runtime, "normalized", False):  # vLLM reports log-probabilities
            ref = log_softmax(ref)
        if ours.shape != ref.shape:
            raise UserInputError(
                f"{artifact.path}: logits of shape {ours.shape} vs the reference's {ref.shape}; "
                "is --against the model this artifact was made from?"
            )
        # llama.cpp has no logits where image embeddings sit (NaN rows): compared at the text positions.
        text = ~np.isnan(ours).any(axis=-1)
        max_diff = max(max_diff, float(np.abs(ours[text] - ref[text]).max()))
        scale = max(scale, float(np.abs(ref[text]).max()))
        agree += int((ours[text].argmax(-1) == ref[text].argmax(-1)).sum())
        positions += int(text.sum())
        nll_artifact.append(token_logprob_mean(ours, ids, start))
        nll_reference.append(token_logprob_mean(ref, ids, start))
    ppl_artifact, ppl_reference = float(np.exp(np.mean(nll_artifact))), float(np.exp(np.mean(nll_reference)))
    generations: list[dict[str, Any]] = []
    for ids, start, images in progress_bar(scored[:prompts], desc="verify greedy", unit="prompt"):
        # A row with images is prompted up to its answer: half of it could cut an image's tokens.
        prompt = ids[:start] if images else ids[: max(len(ids) // 2, 2)]
        ours_new = _greedy(artifact, prompt, new_tokens, images, cache=False)
        ref_new = _greedy(reference, prompt, new_tokens, images, cache=False)
        # Tokens before the first difference (a runtime that stopped early differs from there on).
        same = next(
            (i for i, (a, b) in enumerate(zip(ours_new, ref_new, strict=False)) if a != b),
            min(len(ours_new), len(ref_new)),
        )
        generations.append(
            {"prompt_tokens": len(prompt), "agree_tokens": same, "artifact": ours_new, "reference": ref_new}
        )
    return {
        "sequences": len(scored),
        "ppl_of": "every token" if all(start == 1 for _, start, _ in scored) else "the answers' tokens",
        "positions": positions,
        "logits_max_abs_diff": max_diff,
        "logits_scale": scale,
        "logits_rel_diff": max_diff / scale if scale else 0.0,
        "top1_agreement": agree / positions,
        "ppl_artifact": ppl_artifact,
        "ppl_reference": ppl_reference,
        "ppl_rel_diff": abs(ppl_artifact - ppl_reference) / ppl_reference,
        "ppl_increase": ppl_artifact / ppl_reference - 1.0,
        "greedy_identical": sum(g["agree_tokens"] == new_tokens for g in generations) / len(generations),
        "greedy_prefix": sum(g["agree_tokens"] for g in generations) / (new_tokens * len(generations)),
        "greedy": generations,
    }


# The reference's greedy answers, kept while one process verifies several exports of one model.
_REFERENCE_ANSWERS: dict[tuple[str, tuple[int, ...], int, tuple[str, ...]], list[int]] = {}


def _logits(model: Artifact, ids: list[int], images: tuple[str, ...]) -> np.ndarray:
    # Only a runtime that takes images is given any (compared_on sees to that).
    return model.runtime.logits(ids, images) if images else model.runtime.logits(ids)  # type: ignore[call-arg]


def _greedy(
    model: Artifact, prompt_ids: list[int], new_tokens: int, images: tuple[str, ...] = (), *, cache: bool
) -> list[int]:
    def run() -> list[int]:
        if images:
            return model.runtime.greedy(prompt_ids, new_tokens, images)  # type: ignore[call-arg]
        return model.runtime.greedy(prompt_ids, new_tokens)

    if not cache:
        return run()
    key = (model_fingerprint(Path(model.path)), tuple(prompt_ids), new_tokens, tuple(images))
    if key not in _REFERENCE_ANSWERS:
        _REFERENCE_ANSWERS[key] = run()
    return _REFERENCE_ANSWERS[key]


def model_fingerprint(path: Path) -> str:
    """The path and the newest modification time of its files: a model rewritten in place is
    another model."""
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return f"{path.resolve()}@{max((f.stat().st_mtime_ns for f in files), default=0)}"


def judge(parity: dict[str, Any], limits: dict[str, Any]) -> list[str]:
    """One line per failed gate or parity check, with the measured number and its limit."""
    checks: list[tuple[str, float, float | None, str]] = [
        ("perplexity increase", parity["ppl_increase"], limits["max_ppl_increase"], "<="),
        ("top-1 agreement", parity["top1_agreement"], limits["min_top1_agreement"], ">="),
        (
            "logits max diff (relative to the largest |logit|)",
            parity["logits_rel_diff"],
            limits["max_logit_diff"],
            "<=",
        ),
        (
            "greedy agreement (share of tokens before the first difference)",
            parity["greedy_prefix"],
            limits["min_greedy_prefix"],
            ">=",
        ),
    ]
    if "accuracy" in parity:
        checks.insert(
            2, ("task accuracy drop", parity["accuracy"]["drop"], limits["max_accuracy_drop"], "<=")
        )
    failures = []
    for name, value, limit, op in checks:
        if limit is None:
            continue  # not checked at this precision
        ok = value <= limit if op == "<=" else value >= limit
        if not ok:
            failures.append(f"{name}: {value:.6g}, needs {op} {limit:g}")
    return failures
