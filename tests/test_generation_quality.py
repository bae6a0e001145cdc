"""Generation-quality metrics: the numbers equal what sacrebleu and rouge-score give on the same
strings, and `lmforge eval` reports them for the answers it generated."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import sacrebleu
from rouge_score import rouge_scorer

from lmforge.errors import UserInputError
from lmforge.evaluate.quality import generation_quality, require_bertscore
from lmforge.evaluate.run import quality_line
from tests.conftest import run_cli
from tests.test_eval_generate import QA, models  # noqa: F401  (models: the module's trained model)

CASES = {
    "exact": (["the cat sat on the mat", "Paris"], ["the cat sat on the mat", "Paris"]),
    "partial overlap": (["the cat sat on a red mat", "blue"], ["the cat sat on the mat", "blue sky"]),
    "empty prediction": (["", "five"], ["five apples", "five"]),
    "stems and case": (["Cats are running home", "dogs ran"], ["the cat runs home", "Dogs run"]),
    "non-ascii": (["café au lait", "東京"], ["café noir", "東京"]),
    "one sample": (["a b c d e f"], ["a b c x e f"]),
}


def library_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """sacrebleu and rouge-score called directly, with the settings quality.py documents."""
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    pairs = [scorer.score(r, p) for p, r in zip(predictions, references, strict=True)]
    return {
        "bleu": sacrebleu.corpus_bleu(predictions, [references]).score,
        "chrf": sacrebleu.corpus_chrf(predictions, [references]).score,
        **{
            key: 100 * sum(pair[key].fmeasure for pair in pairs) / len(pairs)
            for key in ("rouge1", "rouge2", "rougeL")
        },
    }


@pytest.mark.parametrize("case", list(CASES))
def test_scores_equal_sacrebleu_and_rouge_score(case: str) -> None:
    predictions, references = CASES[case]
    scores = generation_quality(predictions, references)
    expected = library_scores(predictions, references)
    assert set(scores) == {*expected, "exact_match"}
    for key, value in expected.items():
        assert scores[key] == pytest.approx(value, abs=1e-9), key


def test_known_values() -> None:
    """Values worked out by hand, so that a shared mistake in the comparison cannot hide."""
    exact = generation_quality(*CASES["exact"])
    assert exact == {
        "bleu": pytest.approx(100.0),
        "chrf": pytest.approx(100.0),
        "rouge1": 100.0,
        "rouge2": 50.0,  # "Paris" has no bigram: rouge-score gives it 0 even against itself
        "rougeL": 100.0,
        "exact_match": 100.0,
    }
    # "the cat sat" against "the cat sat on the mat": unigram P 3/3, R 3/6 -> F 2/3; bigram P 2/2,
    # R 2/5 -> F 4/7; the longest common subsequence is 3 tokens -> ROUGE-L = ROUGE-1.
    short = generation_quality(["the cat sat"], ["the cat sat on the mat"])
    assert short["rouge1"] == pytest.approx(200 / 3) and short["rougeL"] == pytest.approx(200 / 3)
    assert short["rouge2"] == pytest.approx(400 / 7) and short["exact_match"] == 0.0
    # An empty prediction scores 0 on ROUGE; rouge-score's tokenizer drops non-ASCII text ("東京" == "東京"
    # scores 0) while exact match and chrF see it.
    assert generation_quality([""], ["five apples"])["rouge1"] == 0.0
    tokyo = generation_quality(["東京"], ["東京"])
    assert tokyo["rouge1"] == 0.0 and tokyo["exact_match"] == 100.0 and tokyo["chrf"] == pytest.approx(100.0)


def test_exact_match_strips_both_ends_and_keeps_case() -> None:
    scores = generation_quality([" Paris\n", "paris", "Rome"], ["Paris", "Paris", " Rome "])
    assert scores["exact_match"] == pytest.approx(200 / 3)


def test_mismatched_or_empty_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        generation_quality(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no predictions"):
        generation_quality([], [])


@pytest.mark.skipif(
    importlib.util.find_spec("bert_score") is not None, reason="the bertscore extra is installed"
)
def test_bertscore_without_its_package_names_the_key_and_the_extra() -> None:
    require_bertscore(None)  # not asked for: nothing to check
    with pytest.raises(UserInputError) as err:
        generation_quality(["a"], ["a"], bertscore_model="/models/roberta")
    message = str(err.value)
    assert "monitor.eval_generations.bertscore_model" in message
    assert "pip install 'lmforge[bertscore]'" in message


@pytest.mark.slow
def test_eval_cli_reports_the_scores_of_the_answers_it_generated(
    models: dict[str, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    # Three answers the model was trained on and two references that differ from what it says.
    rows = [
        QA[1],
        QA[2],
        QA[4],
        {"question": QA[0]["question"], "answer": "the sky is blue"},
        {"question": QA[3]["question"], "answer": "cold"},
    ]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "eval.json"
    result = run_cli("eval", str(models["trained"]), "--data", str(data), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]

    summary = json.loads(out.read_text())
    qa = summary["data"][str(data)]
    assert len(qa["examples"]) == len(rows)  # every generation is in the summary
    got = [example["got"] for example in qa["examples"]]
    expected = [example["expected"] for example in qa["examples"]]
    assert expected == [row["answer"] for row in rows]
    quality = qa["generation_quality"]
    assert quality["exact_match"] == 60.0 and qa["accuracy"] == 0.6  # the three trained answers
    for key, value in library_scores(got, expected).items():
        assert quality[key] == pytest.approx(value, abs=1e-9), key
    # Partly right: neither 0 nor 100 (BLEU is 0: answers of one or two words have no 4-gram).
    assert 0 < quality["chrf"] < 100 and 0 < quality["rouge1"] < 100 and quality["bleu"] == 0.0
    # The printed table shows the same numbers.
    assert f"  generation quality: {quality_line(quality)}" in result.stdout.splitlines()
    assert f"BLEU {quality['bleu']:.2f}, chrF {quality['chrf']:.2f}, ROUGE-1 {quality['rouge1']:.2f}" in (
        result.stdout
    )
