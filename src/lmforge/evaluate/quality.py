"""Generation quality: greedy completions scored against their references with the libraries
papers report, so that a number here equals the one `sacrebleu` or `rouge-score` gives on the same
strings.

Every metric is on a 0-100 scale, as sacrebleu reports BLEU and chrF:
- `bleu`, `chrf`: `sacrebleu.corpus_bleu` / `corpus_chrf` with their defaults (13a tokenizer,
  exponential smoothing; chrF with character 6-grams, beta 2), one reference per prediction;
- `rouge1`, `rouge2`, `rougeL`: `rouge_score.rouge_scorer.RougeScorer` with `use_stemmer=True`
  (Porter stemming, as ROUGE-1.5.5's `-m` option that most papers use), the F-measure of each
  sample averaged over the samples, times 100. rouge-score's default tokenizer lowercases and keeps
  only ASCII letters and digits, so text in other scripts scores 0 on ROUGE (BLEU and chrF see it);
- `exact_match`: the share of predictions equal to their reference once both are stripped of
  leading and trailing whitespace, times 100;
- `bertscore`: BERTScore F1 averaged over the samples, times 100, only when a model is named
  (needs the `bertscore` extra).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

from lmforge.errors import UserInputError

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
METRIC_NAMES = ("bleu", "chrf", *ROUGE_TYPES, "exact_match", "bertscore")
BERTSCORE_KEY = "monitor.eval_generations.bertscore_model"


def generation_quality(
    predictions: list[str], references: list[str], *, bertscore_model: str | None = None
) -> dict[str, float]:
    """BLEU, chrF, ROUGE-1/2/L and exact match of `predictions` against `references` (one each),
    plus BERTScore F1 with `bertscore_model`; every value on 0-100."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not predictions:
        raise ValueError("no predictions to score")
    scores = {**sacrebleu_scores(predictions, references), **rouge_scores(predictions, references)}
    scores["exact_match"] = exact_match(predictions, references)
    if bertscore_model is not None:
        scores["bertscore"] = bertscore_f1(predictions, references, bertscore_model)
    return scores


def sacrebleu_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Corpus BLEU and chrF: sacrebleu's defaults, one reference stream."""
    import sacrebleu

    return {
        "bleu": float(sacrebleu.corpus_bleu(predictions, [references]).score),
        "chrf": float(sacrebleu.corpus_chrf(predictions, [references]).score),
    }


def rouge_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean ROUGE F-measures, times 100 (rouge-score scores one pair at a time; it has no corpus form)."""
    scorer = _rouge_scorer()
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for prediction, reference in zip(predictions, references, strict=True):
        scored = scorer.score(reference, prediction)  # rouge-score's order: (target, prediction)
        for key in ROUGE_TYPES:
            totals[key] += scored[key].fmeasure
    return {key: 100.0 * total / len(predictions) for key, total in totals.items()}


@functools.cache
def _rouge_scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def exact_match(predictions: list[str], references: list[str]) -> float:
    """Percent of predictions equal to their reference after stripping both ends (case kept)."""
    matches = sum(p.strip() == r.strip() for p, r in zip(predictions, references, strict=True))
    return 100.0 * matches / len(predictions)


def require_bertscore(model: str | None, where: str = BERTSCORE_KEY) -> None:
    """UserInputError naming `where` (the config key or option that asked) when BERTScore is asked
    for but bert-score is not installed: checked before a run or an evaluation starts, not at its
    first score."""
    if model is not None and importlib.util.find_spec("bert_score") is None:
        raise UserInputError(
            f"{where}: {model!r} asks for BERTScore, which needs the bert-score package; "
            f"install it with `pip install 'lmforge[bertscore]'` or remove {where}"
        )


def bertscore_f1(predictions: list[str], references: list[str], model: str) -> float:
    """Mean BERTScore F1 (times 100) with the encoder in `model` (a local directory or hub name)."""
    require_bertscore(model)
    _, _, f1 = _bert_scorer(model).score(predictions, references)
    return 100.0 * float(f1.mean())


@functools.cache
def _bert_scorer(model: str) -> Any:
    """One scorer per model for the whole process: evaluations during training reuse the encoder.

    bert-score picks the layer of the models it knows (its tuned `model2layers`, looked up by the
    directory's name); for any other model it needs a layer, and the last one is used."""
    from bert_score import BERTScorer
    from bert_score.utils import model2layers
    from transformers import AutoConfig

    layers = model2layers.get(Path(model).name)
    if layers is None:
        layers = int(AutoConfig.from_pretrained(model).num_hidden_layers)
    return BERTScorer(model_type=model, num_layers=layers)
