"""`lmforge ckpt verify`: is this artifact intact, and does it behave like the model it came from?

Integrity (`lmforge.export.integrity`): the hash manifest when there is one (lmforge seals
checkpoints and exports), else the file structure (safetensors headers and sizes, GGUF and ONNX
parse). Parity: the artifact runs in its own runtime and the reference in transformers, on the
same token ids; the verdict compares logits (max abs diff, top-1 agreement), perplexity and
greedy generations against tolerances chosen by the coarser precision of the two (overridable).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from lmforge.errors import UserInputError
from lmforge.export.convert import EXPORT_RECORD
from lmforge.export.integrity import check_integrity
from lmforge.export.runtimes import (
    FULL,
    HALF,
    INT8,
    Artifact,
    coarsest,
    load_reference,
    open_artifact,
    token_logprob_mean,
)

log = logging.getLogger(__name__)
DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n",
    "Question: what is 12 + 30?\nAnswer: 42. Question: what colour is the sky?\nAnswer: blue.",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
)


@dataclass(frozen=True)
class Tolerances:
    """Pass limits. logit_diff is relative to the reference's largest |logit|; greedy_prefix is the
    mean share of generated tokens before the first one that differs (a near-tie flipped by
    rounding ends agreement early but is no defect, so lower precisions ask for less)."""

    max_logit_diff: float
    min_top1_agreement: float
    max_ppl_rel_diff: float
    min_greedy_prefix: float


DEFAULT_TOLERANCES = {
    # fp32 on both sides: only the order of floating-point operations differs.
    FULL: Tolerances(
        max_logit_diff=1e-4, min_top1_agreement=0.99, max_ppl_rel_diff=1e-4, min_greedy_prefix=0.9
    ),
    # 16-bit weights: bf16 keeps 8 mantissa bits, so logits move by a few percent of their range.
    HALF: Tolerances(
        max_logit_diff=0.1, min_top1_agreement=0.95, max_ppl_rel_diff=1e-2, min_greedy_prefix=0.5
    ),
    # 8-bit blocks with one scale per 32 weights.
    INT8: Tolerances(
        max_logit_diff=0.2, min_top1_agreement=0.9, max_ppl_rel_diff=3e-2, min_greedy_prefix=0.25
    ),
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
    tolerances: dict[str, float] | None = None,
) -> Verdict:
    """Check `path`'s integrity and, with a reference, its behavioural parity."""
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
    verdict.tolerances = limits
    sequences = token_sequences(tokenizer, data, max_tokens)
    verdict.parity = compare(artifact, reference, sequences, prompts=prompts, new_tokens=new_tokens)
    verdict.failures = judge(verdict.parity, limits)
    return verdict


def recorded_source(path: Path) -> Path | None:
    """The model an lmforge conversion was made from, as recorded next to the artifact."""
    record = (path if path.is_dir() else path.parent) / EXPORT_RECORD
    if not record.is_file():
        return None
    source = Path(json.loads(record.read_text())["source"])
    return source if source.exists() else None


def token_sequences(tokenizer: Any, data: Path | None, max_tokens: int) -> list[list[int]]:
    """Token ids to compare on: the data file's texts (or QA rows, chat-rendered) or built-in texts."""
    texts = list(DEFAULT_TEXTS) if data is None else _data_texts(tokenizer, data)
    sequences = [tokenizer(text, add_special_tokens=True)["input_ids"][:max_tokens] for text in texts]
    sequences = [ids for ids in sequences if len(ids) >= 4]
    if not sequences:
        raise UserInputError(f"{data}: no text of at least 4 tokens to compare on")
    return sequences


def _data_texts(tokenizer: Any, data: Path) -> list[str]:
    from lmforge.evaluate.generation import chat_messages, render_prompt
    from lmforge.evaluate.rows import data_kind, read_qa_rows, read_texts

    if data_kind(data) == "text":
        return read_texts(data)
    return [
        render_prompt(tokenizer, chat_messages(row["question"])) + row["answer"] for row in read_qa_rows(data)
    ]


def compare(
    artifact: Artifact, reference: Artifact, sequences: list[list[int]], *, prompts: int, new_tokens: int
) -> dict[str, Any]:
    """Logit, perplexity and greedy-generation agreement of artifact vs reference."""
    max_diff = scale = 0.0
    agree = positions = 0
    nll_artifact, nll_reference = [], []
    for ids in tqdm(sequences, desc="verify logits", unit="seq"):
        ours, ref = artifact.runtime.logits(ids), reference.runtime.logits(ids)
        if ours.shape != ref.shape:
            raise UserInputError(
                f"{artifact.path}: logits of shape {ours.shape} vs the reference's {ref.shape}; "
                "is --against the model this artifact was made from?"
            )
        max_diff = max(max_diff, float(np.abs(ours - ref).max()))
        scale = max(scale, float(np.abs(ref).max()))
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        positions += len(ids)
        nll_artifact.append(token_logprob_mean(ours, ids))
        nll_reference.append(token_logprob_mean(ref, ids))
    ppl_artifact, ppl_reference = float(np.exp(np.mean(nll_artifact))), float(np.exp(np.mean(nll_reference)))
    generations: list[dict[str, Any]] = []
    for ids in tqdm(sequences[:prompts], desc="verify greedy", unit="prompt"):
        prompt = ids[: max(len(ids) // 2, 2)]
        ours_new = artifact.runtime.greedy(prompt, new_tokens)
        ref_new = reference.runtime.greedy(prompt, new_tokens)
        # Tokens before the first difference (a runtime that stopped early differs from there on).
        same = next(
            (i for i, (a, b) in enumerate(zip(ours_new, ref_new, strict=False)) if a != b),
            min(len(ours_new), len(ref_new)),
        )
        generations.append(
            {"prompt_tokens": len(prompt), "agree_tokens": same, "artifact": ours_new, "reference": ref_new}
        )
    return {
        "sequences": len(sequences),
        "positions": positions,
        "logits_max_abs_diff": max_diff,
        "logits_scale": scale,
        "logits_rel_diff": max_diff / scale if scale else 0.0,
        "top1_agreement": agree / positions,
        "ppl_artifact": ppl_artifact,
        "ppl_reference": ppl_reference,
        "ppl_rel_diff": abs(ppl_artifact - ppl_reference) / ppl_reference,
        "greedy_identical": sum(g["agree_tokens"] == new_tokens for g in generations) / len(generations),
        "greedy_prefix": sum(g["agree_tokens"] for g in generations) / (new_tokens * len(generations)),
        "greedy": generations,
    }


def judge(parity: dict[str, Any], limits: dict[str, float]) -> list[str]:
    """One line per failed check, with the measured number and its limit."""
    checks = [
        (
            "logits max diff (relative to the largest |logit|)",
            parity["logits_rel_diff"],
            limits["max_logit_diff"],
            "<=",
        ),
        ("top-1 agreement", parity["top1_agreement"], limits["min_top1_agreement"], ">="),
        ("perplexity relative difference", parity["ppl_rel_diff"], limits["max_ppl_rel_diff"], "<="),
        (
            "greedy agreement (share of tokens before the first difference)",
            parity["greedy_prefix"],
            limits["min_greedy_prefix"],
            ">=",
        ),
    ]
    failures = []
    for name, value, limit, op in checks:
        ok = value <= limit if op == "<=" else value >= limit
        if not ok:
            failures.append(f"{name}: {value:.6g}, needs {op} {limit:g}")
    return failures
