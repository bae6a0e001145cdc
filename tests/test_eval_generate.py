"""`lmforge eval` and `lmforge generate` on a tiny llama this file trains to answer and stop.

Real parts throughout: a trained tokenizer, a model built from a preset, a short fine-tune
on fixed question/answer pairs, a PEFT LoRA adapter with perturbed weights, the real CLI.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.chat import end_of_turn_ids, resolve_template, tokenize_conversation
from lmforge.data.examples import Conversation, Message, Origin
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.evaluate.accuracy import answer_accuracy, is_correct
from lmforge.evaluate.generation import chat_messages, generate_ids
from lmforge.evaluate.loading import load_for_inference
from lmforge.evaluate.perplexity import text_perplexity
from lmforge.evaluate.rows import read_qa_rows
from lmforge.evaluate.run import EvalRequest, evaluate, summary_lines
from lmforge.models.build import build_model
from tests.conftest import SMALL_ARCH, run_cli

QA = [
    {"question": "What colour is the sky?", "answer": "blue sky"},
    {"question": "Capital of France?", "answer": "Paris"},
    {"question": "Two plus three?", "answer": "five"},
    {"question": "Opposite of hot?", "answer": "cold water"},
    {"question": "Largest planet?", "answer": "Jupiter"},
    {"question": "Animal that barks?", "answer": "dog"},
]
TRAIN_STEPS = 100
pytestmark = pytest.mark.slow  # CLI subprocesses: about a minute in all


def _conversation(row: dict[str, str], number: int) -> Conversation:
    messages = [Message("user", row["question"]), Message("assistant", row["answer"])]
    return Conversation(messages, Origin("qa", number))


def _rendered_text(tokenizer: PreTrainedTokenizerBase) -> str:
    chats = [
        [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
        for r in QA
    ]
    return "".join(str(tokenizer.apply_chat_template(chat, tokenize=False)) for chat in chats)


def _fine_tune(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
    """Full fine-tune on every token of the QA chats until the model answers and stops."""
    template = resolve_template(tokenizer, None)
    samples = [
        tokenize_conversation(
            _conversation(row, i),
            tokenizer,
            template=template,
            train_on="all",
            max_length=128,
            over_length="error",
        )
        for i, row in enumerate(QA)
    ]
    longest = max(len(s.input_ids) for s in samples)  # type: ignore[union-attr]
    ids = torch.full((len(samples), longest), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)  # type: ignore[union-attr]
        ids[row, :n] = torch.as_tensor(sample.input_ids, dtype=torch.long)  # type: ignore[union-attr]
        labels[row, :n] = torch.as_tensor(sample.labels, dtype=torch.long)  # type: ignore[union-attr]
        mask[row, :n] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(TRAIN_STEPS):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """base/ (untrained), trained/ (fine-tuned on QA), adapter/ (LoRA on trained, no tokenizer),
    final/ (a run's final: tokenizer + adapter/), plus the data files."""
    root = tmp_path_factory.mktemp("evalgen")
    texts = [f"{r['question']} {r['answer']}" for r in QA] * 20 + [
        "the quick brown fox jumps over the lazy dog"
    ] * 20
    tokenizer = train_tokenizer(texts, TokenizerTrainConfig(vocab_size=400, min_frequency=1))
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="llama-tiny", config=SMALL_ARCH), tokenizer, max_length=256)
    for name in ("base", "trained"):
        if name == "trained":
            _fine_tune(model, tokenizer)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)

    trained = AutoModelForCausalLM.from_pretrained(root / "trained")
    peft_model = get_peft_model(trained, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # B starts at zero (a no-op adapter); make it change outputs
                param.copy_(torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(root / "adapter")
    (root / "final").mkdir()
    shutil.copytree(root / "adapter", root / "final" / "adapter")
    tokenizer.save_pretrained(root / "final")

    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA))
    (root / "train.txt").write_text(_rendered_text(tokenizer))
    return {name: root / name for name in ("base", "trained", "adapter", "final", "qa.jsonl", "train.txt")}


def test_generate_cli_prints_the_reply_on_model_adapter_and_final_dirs(models: dict[str, Path]) -> None:
    outputs = {}
    for name in ("trained", "adapter", "final"):
        result = run_cli(  # the first in a fresh interpreter: notices printed while libraries import
            "generate",
            str(models[name]),
            "--prompt",
            QA[1]["question"],
            "--max-new-tokens",
            "12",
            fresh=name == "trained",
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Warning" not in result.stderr, result.stderr[-3000:]  # upstream notices stay off the console
        outputs[name] = result.stdout.strip()
    assert outputs["trained"] == "Paris"  # the end-of-turn token is not printed
    assert outputs["adapter"] and outputs["adapter"] == outputs["final"]  # same adapter, two layouts
    assert outputs["adapter"] != outputs["trained"]


def test_adapter_changes_logits(models: dict[str, Path]) -> None:
    base, tokenizer = load_for_inference(models["trained"])
    adapted, _ = load_for_inference(models["trained"], adapter=models["adapter"])
    ids = tokenizer("Capital of France?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, adapted(ids).logits, atol=1e-3)


def test_generation_stops_at_end_of_turn(models: dict[str, Path]) -> None:
    model, tokenizer = load_for_inference(models["trained"])
    stops = end_of_turn_ids(tokenizer)
    for row in QA:
        ids = generate_ids(model, tokenizer, chat_messages(row["question"]), max_new_tokens=20)
        assert len(ids) < 20 and ids[-1] in stops
        assert not stops & set(ids[:-1])
        assert tokenizer.decode(ids, skip_special_tokens=True) == row["answer"]


def test_accuracy_before_and_after_training(models: dict[str, Path]) -> None:
    untrained, tokenizer = load_for_inference(models["base"])
    assert answer_accuracy(untrained, tokenizer, QA, max_new_tokens=8)["accuracy"] == 0
    trained, tokenizer = load_for_inference(models["trained"])
    result = answer_accuracy(trained, tokenizer, QA, max_new_tokens=8, batch_size=4)  # two batches, padded
    assert result["accuracy"] >= 0.9 and result["total"] == len(QA)
    assert result["examples"][0] == {
        "question": QA[0]["question"],
        "expected": "blue sky",
        "got": "blue sky",
        "correct": True,
    }


def test_contains_and_exact_scoring_differ(models: dict[str, Path]) -> None:
    model, tokenizer = load_for_inference(models["trained"])
    partial = [{"question": "What colour is the sky?", "answer": "blue"}]  # the model says "blue sky"
    assert answer_accuracy(model, tokenizer, partial, scoring="exact")["accuracy"] == 0
    assert answer_accuracy(model, tokenizer, partial, scoring="contains")["accuracy"] == 1
    assert is_correct("  Paris \n", "Paris", "exact") and not is_correct("paris", "Paris", "exact")


def test_trained_perplexity_is_lower_on_its_training_text(models: dict[str, Path]) -> None:
    texts = [models["train.txt"].read_text()]
    ppl = {}
    for name in ("base", "trained"):
        model, tokenizer = load_for_inference(models[name])
        ppl[name] = text_perplexity(model, tokenizer, texts, block_size=64)["perplexity"]
    assert math.isfinite(ppl["base"]) and ppl["trained"] < ppl["base"] / 2


def test_eval_cli_json_on_qa_and_text(models: dict[str, Path]) -> None:
    result = run_cli(
        "eval",
        str(models["trained"]),
        "--data",
        str(models["qa.jsonl"]),
        "--data",
        str(models["train.txt"]),
        "--json",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)  # nothing but the JSON document on stdout
    assert summary["accuracy"] >= 0.9 and summary["total"] == len(QA)
    qa = summary["data"][str(models["qa.jsonl"])]
    assert (
        qa["kind"] == "qa" and qa["examples"][1]["got"] == "Paris" and math.isfinite(qa["answer_perplexity"])
    )
    text = summary["data"][str(models["train.txt"])]
    assert text["kind"] == "text" and math.isfinite(text["perplexity"]) and text["tokens"] > 0
    assert json.loads((models["trained"] / "eval.json").read_text()) == summary  # the default --out
    lines = summary_lines(summary)  # what eval prints without --json
    assert any(
        line.endswith("accuracy 1.000 (6/6, exact); answer perplexity " + f"{qa['answer_perplexity']:.3f}")
        for line in lines
    )


def test_tasks_without_lm_eval_exit_2_naming_the_extra(models: dict[str, Path]) -> None:
    pytest.importorskip("lmforge")  # always there; lm_eval must not be
    with pytest.raises(ImportError):
        import lm_eval  # noqa: F401
    result = run_cli("eval", str(models["trained"]), "--tasks", "hellaswag")
    assert result.returncode == 2 and "lm-eval" in result.stderr


def test_bad_input_exits_2_with_where(models: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = run_cli("generate", str(missing), "--prompt", "hi")
    assert result.returncode == 2 and str(missing) in result.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(QA[0]) + "\n" + json.dumps({"question": "no answer here"}) + "\n")
    result = run_cli("eval", str(models["trained"]), "--data", str(bad))
    assert result.returncode == 2 and f"{bad}:2" in result.stderr
    with pytest.raises(UserInputError, match="bad.jsonl:2"):
        read_qa_rows(bad)


def test_read_qa_rows_accepts_alpaca_and_chat_rows(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    rows = [
        {"instruction": "Add", "input": "2 + 3", "output": "5"},
        {"messages": [*chat, {"role": "assistant", "content": "4"}]},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert read_qa_rows(path) == [
        {"question": "Add\n\n2 + 3", "answer": "5"},
        {"question": "2 + 2?", "answer": "4"},
    ]
    path.write_text(json.dumps({"messages": chat}) + "\n")
    with pytest.raises(UserInputError, match="rows.jsonl:1: 'messages' must end with"):
        read_qa_rows(path)


@pytest.mark.parametrize("eval_fraction", [0.3, 0.0])
def test_eval_of_a_run_config_uses_final_and_the_runs_eval_data(
    models: dict[str, Path], tmp_path: Path, eval_fraction: float
) -> None:
    config = {
        "run": {"name": "pt", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"path": str(models["trained"])},
        "data": {
            "train": [{"path": str(models["train.txt"])}],
            "eval_fraction": eval_fraction,
            "max_length": 32,
        },
        "train": {"max_steps": 1},
    }
    path = tmp_path / "pt.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(UserInputError, match="final"):
        evaluate(EvalRequest(target=path))
    shutil.copytree(models["trained"], tmp_path / "runs" / "pt" / "final")
    model_dir, summary = evaluate(EvalRequest(target=path))
    assert model_dir == tmp_path / "runs" / "pt" / "final"
    if eval_fraction:
        assert math.isfinite(summary["run_eval"]["perplexity"]) and summary["run_eval"]["tokens"] > 0
        assert summary["perplexity"] == summary["run_eval"]["perplexity"]
    else:
        assert summary["run_eval"] is None and "no eval data" in summary["notes"][0]
        assert "run eval data: none" in summary_lines(summary)[0]


def test_eval_reads_prompt_response_rows_and_named_columns(models: dict[str, Path], tmp_path: Path) -> None:
    """{prompt, response}-style rows are recognised as QA rows; any other pair is named with
    `--columns`, and a row missing a named column is reported with its file:line."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": r["question"], "response": r["answer"]}) + "\n" for r in QA)
    )
    assert read_qa_rows(pairs) == [{"question": r["question"], "answer": r["answer"]} for r in QA]
    odd = tmp_path / "odd.jsonl"
    odd.write_text("".join(json.dumps({"ask": r["question"], "gold": r["answer"]}) + "\n" for r in QA))
    result = run_cli(
        "eval", str(models["trained"]), "--data", str(odd), "--columns", "question=ask,answer=gold", "--json"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["accuracy"] >= 0.9
    wrong = run_cli(
        "eval", str(models["trained"]), "--data", str(odd), "--columns", "question=ask,answer=gld"
    )
    assert wrong.returncode == 2 and f"{odd}:1: row has no 'gld'" in wrong.stderr
    bad_flag = run_cli("eval", str(models["trained"]), "--data", str(odd), "--columns", "ask")
    assert bad_flag.returncode == 2 and "--columns question=prompt,answer=response" in bad_flag.stderr
