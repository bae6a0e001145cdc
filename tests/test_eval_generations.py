"""monitor.eval_generations: at each eval step of a tiny SFT run, greedy completions of eval prompts
are scored into metrics.jsonl (the numbers sacrebleu / rouge-score give on the stored samples), shown
as text in TensorBoard and every other sink, kept in eval_samples.jsonl for the report, and leave
training exactly as it would be without them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmforge.config import load_config
from lmforge.config.schema import MonitorConfig, TokenizerTrainConfig
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.evaluate.run import EvalRequest, evaluate
from lmforge.monitor.metrics import read_metrics
from lmforge.monitor.run_artifacts import Sample
from lmforge.monitor.sinks import open_sinks, samples_markdown
from lmforge.report.generation_section import generation_section
from lmforge.report.load import load_run
from lmforge.run_layout import RunPaths
from lmforge.train.runner import run_training
from tests.conftest import ROOT, save_tiny_llama
from tests.test_generation_quality import library_scores

ALPACA = ROOT / "examples" / "data" / "arithmetic_alpaca.jsonl"
QUALITY = ("eval_bleu", "eval_chrf", "eval_rouge1", "eval_rouge2", "eval_rougeL", "eval_exact_match")
EVERY = 30
EVAL_STEPS = [0, EVERY, 2 * EVERY]  # eval_on_start, then every EVERY steps
PROMPTS = 3


def sft_config(tmp: Path, base: Path, name: str, **monitor: Any) -> Path:
    config = {
        "run": {"name": name, "output_dir": str(tmp / "runs"), "seed": 0},
        "model": {"path": str(base)},
        "data": {"train": [{"path": str(ALPACA)}], "max_length": 128, "eval_fraction": 0.1},
        "train": {
            "stage": "sft",
            "max_steps": 2 * EVERY,
            "eval_every": EVERY,
            "micro_batch_size": 4,
            "lr": 3e-3,
            "precision": "fp32",
            "log_every": 1,
            "save_every": None,
        },
        "monitor": {"eval_generations": {"prompts": PROMPTS, "max_new_tokens": 12}, **monitor},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = ALPACA.read_text().splitlines()
    tokenizer = train_tokenizer(texts * 3, TokenizerTrainConfig(vocab_size=400, min_frequency=1))
    return save_tiny_llama(tokenizer, tmp_path_factory.mktemp("base") / "model")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, base: Path) -> dict[str, Path]:
    """The same run twice: with eval generations ("on") and without ("off"); and its config."""
    tmp = tmp_path_factory.mktemp("evalgen")
    on = sft_config(tmp, base, "on")
    off = sft_config(tmp, base, "off", eval_generations=None)
    return {
        "on": run_training(load_config(on)).run_dir,
        "off": run_training(load_config(off)).run_dir,
        "config": on,
    }


def samples_by_step(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    by_step: dict[int, list[dict[str, Any]]] = {}
    for line in RunPaths(run_dir).eval_samples.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], []).append(record)
    return by_step


@pytest.mark.slow
def test_eval_steps_record_the_libraries_scores_of_their_samples(runs: dict[str, Path]) -> None:
    samples = samples_by_step(runs["on"])
    assert sorted(samples) == EVAL_STEPS
    evals = {r["step"]: r for r in read_metrics(RunPaths(runs["on"]).metrics) if "eval_loss" in r}
    assert sorted(evals) == EVAL_STEPS
    for step in EVAL_STEPS:
        rows = samples[step]
        assert len(rows) == PROMPTS
        for row in rows:  # SFT prompts: the rendered user turn; references: the dataset's answers
            assert row["prompt"].endswith("<|im_start|>assistant\n") and "What is" in row["prompt"]
            assert " = " in row["reference"]
        expected = library_scores([r["completion"] for r in rows], [r["reference"] for r in rows])
        record = evals[step]
        for key, value in expected.items():
            assert record[f"eval_{key}"] == pytest.approx(value, abs=1e-9), (step, key)
        exact = sum(r["completion"].strip() == r["reference"].strip() for r in rows)
        assert record["eval_exact_match"] == pytest.approx(100 * exact / PROMPTS)
    # The model learns the answers' shape ("a + b = c"): its completions come to share characters.
    assert evals[2 * EVERY]["eval_chrf"] > evals[0]["eval_chrf"]
    # Only eval steps carry the scores; each is in the one record of its step.
    assert all(
        k not in r
        for r in read_metrics(RunPaths(runs["on"]).metrics)
        if r["step"] not in evals
        for k in QUALITY
    )


@pytest.mark.slow
def test_generations_leave_training_unchanged(runs: dict[str, Path]) -> None:
    def curve(run_dir: Path) -> list[tuple[Any, ...]]:
        return [
            (r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(RunPaths(run_dir).metrics)
        ]

    assert curve(runs["on"]) == curve(runs["off"])  # same losses to the last bit
    assert not RunPaths(runs["off"]).eval_samples.exists()
    assert all(k not in r for r in read_metrics(RunPaths(runs["off"]).metrics) for k in QUALITY)


@pytest.mark.slow
def test_tensorboard_holds_the_samples_as_text(runs: dict[str, Path]) -> None:
    from tensorboard import plugin_util
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator

    events = EventAccumulator(str(RunPaths(runs["on"]).tensorboard), size_guidance={TENSORS: 0})
    events.Reload()
    texts = events.Tensors("eval_samples/text_summary")
    assert [t.step for t in texts] == EVAL_STEPS
    assert events.SummaryMetadata("eval_samples/text_summary").plugin_data.plugin_name == "text"
    samples = samples_by_step(runs["on"])
    for text in texts:
        markdown = text.tensor_proto.string_val[0].decode()
        rows = [Sample(r["prompt"], r["completion"], r["reference"]) for r in samples[text.step]]
        assert markdown == samples_markdown(rows)
    assert [s.step for s in events.Scalars("eval_bleu")] == EVAL_STEPS  # the scores as scalars too
    # What TensorBoard shows: a table, the chat markup as text (escaped), never as tags.
    html = plugin_util.markdown_to_safe_html(texts[-1].tensor_proto.string_val[0].decode())
    assert html.count("<tr>") == PROMPTS + 1 and "&lt;|im_start|&gt;user" in html


@pytest.mark.slow
def test_report_section_shows_scores_and_latest_samples(runs: dict[str, Path]) -> None:
    section = generation_section(load_run(runs["on"]))
    assert section.startswith("<h2>Generation quality</h2>")
    assert 'data-metric="generation_quality"' in section  # the chart
    last = max(r["step"] for r in read_metrics(RunPaths(runs["on"]).metrics) if "eval_bleu" in r)
    assert f"<h3>Samples at step {2 * EVERY}</h3>" in section and last == 2 * EVERY
    for row in samples_by_step(runs["on"])[2 * EVERY]:
        assert f"<td>{row['reference']}</td>" in section  # "a + b = c": nothing to escape
    assert section.count("&lt;|im_start|&gt;assistant") == PROMPTS
    assert generation_section(load_run(runs["off"])) == ""


@pytest.mark.slow
def test_eval_of_the_run_config_scores_its_eval_answers(runs: dict[str, Path]) -> None:
    _, summary = evaluate(EvalRequest(target=runs["config"], limit=4, max_new_tokens=12, batch_size=1))
    generations = summary["run_eval_generations"]
    assert generations["prompts"] == generations["scored"] == 4
    examples = generations["examples"]
    expected = library_scores([e["got"] for e in examples], [e["expected"] for e in examples])
    for key, value in expected.items():
        assert generations["generation_quality"][key] == pytest.approx(value, abs=1e-9), key
    # The final model on the first eval prompts: what the last eval step generated for the first 3.
    last = samples_by_step(runs["on"])[2 * EVERY]
    assert [e["got"] for e in examples[:PROMPTS]] == [r["completion"] for r in last]


@pytest.mark.skipif(
    importlib.util.find_spec("bert_score") is not None, reason="the bertscore extra is installed"
)
def test_bertscore_without_its_package_stops_before_training(tmp_path: Path, base: Path) -> None:
    config = sft_config(tmp_path, base, "bert")
    cfg = load_config(config, ["monitor.eval_generations.bertscore_model=/models/roberta-large"])
    with pytest.raises(UserInputError) as err:
        run_training(cfg)
    assert "monitor.eval_generations.bertscore_model" in str(err.value)
    assert "pip install 'lmforge[bertscore]'" in str(err.value)
    assert not (tmp_path / "runs" / "bert").exists()  # refused before the run directory was made


def test_every_sink_shows_the_samples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sink's own files read back: W&B's table, MLflow's JSON table, SwanLab's text; a step at
    or below a resumed run's floor is not shown again."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI", "SWANLAB_MODE", "SWANLAB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(sys, "argv", ["lmforge"])
    samples = [Sample("2 + 3 = |x|", "5 <b>five</b>\nthen", "5"), Sample("hi *there*", "", None)]
    loggers = ["tensorboard", "wandb", "mlflow", "swanlab"]
    sinks = open_sinks(MonitorConfig(loggers=loggers), tmp_path, "demo", {}, resume_step=None)  # type: ignore[arg-type]
    for sink in sinks:
        sink.log({"step": 1, "loss": 2.0})
        sink.log_samples(3, samples)  # type: ignore[attr-defined]
        sink.close()
    rows = [[3, "2 + 3 = |x|", "5 <b>five</b>\nthen", "5"], [3, "hi *there*", "", None]]
    (wandb_table,) = (tmp_path / "wandb").glob("offline-run-*/files/media/table/eval_samples_*.table.json")
    assert json.loads(wandb_table.read_text()) == {
        "columns": ["step", "prompt", "completion", "reference"],
        "data": rows,
    }
    (mlflow_table,) = (tmp_path / "mlruns").glob("*/*/artifacts/eval_samples/step-3.json")
    assert json.loads(mlflow_table.read_text())["data"] == rows
    swan_texts = sorted(p.read_text() for p in (tmp_path / "swanlog").glob("run-*/media/text/003-*.txt"))
    assert swan_texts == sorted(
        [
            "prompt: 2 + 3 = |x|\n\ncompletion: 5 <b>five</b>\nthen\n\nreference: 5",
            "prompt: hi *there*\n\ncompletion: ",
        ]
    )

    # Resumed from step 3: the samples of step 3 were shown before and are not shown again.
    (tensorboard,) = open_sinks(MonitorConfig(loggers=["tensorboard"]), tmp_path, "demo", {}, resume_step=3)
    tensorboard.log_samples(3, samples)  # type: ignore[attr-defined]
    tensorboard.log_samples(4, samples[:1])  # type: ignore[attr-defined]
    tensorboard.close()
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator

    events = EventAccumulator(str(RunPaths(tmp_path).tensorboard), size_guidance={TENSORS: 0})
    events.Reload()
    assert [t.step for t in events.Tensors("eval_samples/text_summary")] == [3, 4]
