"""On-policy distillation (train.stage distill) through TRL's DistillationTrainer: a tiny teacher
fine-tuned on the word-group task, an untrained student of the same tokenizer, and an independent
measurement of how far the student's next-token distribution is from the teacher's on held-out
conversations, before and after. A teacher of another vocabulary is refused before training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DistillationConfig

from lmforge.config import load_config
from lmforge.config.schema import DistillConfig, TokenizerTrainConfig
from lmforge.data.synthetic import category_task_rows, write_jsonl
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.train.preflight import check_machine_requirements
from lmforge.train.runner import run_training
from lmforge.train.stages.distill import distill_config_values
from lmforge.train.teacher import vocabulary_difference
from tests.conftest import run_cli, save_tiny_llama


def as_messages(rows: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Question/answer rows as the conversations SFT reads (OpenAI `messages`)."""
    return [
        {
            "messages": [
                {"role": "user", "content": r["question"]},
                {"role": "assistant", "content": r["answer"]},
            ]
        }
        for r in rows
    ]


def tokenizer_of(texts: list[str], vocab_size: int) -> Any:
    return train_tokenizer(texts, TokenizerTrainConfig(vocab_size=vocab_size, min_frequency=1))


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Conversations of the word-group task (train and held-out), an untrained tiny llama (the
    student) and the same llama after 100 SFT steps on them (the teacher)."""
    out = tmp_path_factory.mktemp("distill")
    train, test = category_task_rows(held_out=48, seed=0)
    rows = write_jsonl(out / "train.jsonl", as_messages(train))
    held_out = write_jsonl(out / "test.jsonl", as_messages(test))
    tokenizer = tokenizer_of([f"{r['question']} {r['answer']}" for r in train] * 3, vocab_size=300)
    base = save_tiny_llama(tokenizer, out / "base")
    teacher = run_training(
        load_config(
            None,
            base={
                "run": {"name": "teacher", "output_dir": str(out / "runs"), "seed": 0},
                "model": {"path": str(base)},
                "data": {"train": [{"path": str(rows)}], "max_length": 48},
                "train": {
                    "stage": "sft",
                    "max_steps": 100,
                    "micro_batch_size": 16,
                    "lr": 3e-3,
                    "schedule": "constant",
                    "precision": "fp32",
                    "log_every": 10,
                },
            },
        )
    )
    return {"rows": rows, "held_out": held_out, "student": base, "teacher": teacher.final_dir}


def distill_config(out: Path, task: dict[str, Path], teacher: Path, **train: Any) -> dict[str, Any]:
    return {
        "run": {"name": "distill", "output_dir": str(out / "runs"), "seed": 0},
        "model": {"path": str(task["student"])},
        "data": {"train": [{"path": str(task["rows"])}], "max_length": 48},
        "train": {
            "stage": "distill",
            "distill": {"teacher": str(teacher), "max_new_tokens": 8},
            "max_steps": 40,
            "micro_batch_size": 16,
            "lr": 3e-3,
            "schedule": "constant",
            "precision": "fp32",
            "log_every": 1,
            **train,
        },
    }


def answer_kl(teacher_dir: Path, student_dir: Path, rows: Path) -> float:
    """Mean per-token KL(teacher || student) over the answer tokens of `rows`' conversations (the
    last assistant turn, as the chat template renders it), measured here, not by the trainer."""
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    total, tokens = 0.0, 0
    for line in rows.read_text().splitlines():
        messages = json.loads(line)["messages"]
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=True)
        full = tokenizer.apply_chat_template(messages, return_dict=True)["input_ids"]
        start, ids = len(prompt["input_ids"]), torch.tensor([full])
        with torch.no_grad():  # the logits at i - 1 predict token i: the answer's tokens only
            log_t = teacher(ids).logits[0, start - 1 : len(full) - 1].log_softmax(-1)
            log_s = student(ids).logits[0, start - 1 : len(full) - 1].log_softmax(-1)
        total += float((log_t.exp() * (log_t - log_s)).sum())
        tokens += log_t.shape[0]
    return total / tokens


@pytest.mark.slow
def test_distillation_brings_the_student_to_the_teacher(tmp_path: Path, task: dict[str, Path]) -> None:
    """40 steps of on-policy distillation (16 prompts a step, 8 generated tokens each, reverse KL)
    from the untrained base towards its SFT'd copy. On the 48 held-out conversations, the mean
    per-token KL(teacher || student) on the answers falls by more than 40% (measured: 5.21 ->
    2.30); the logged loss, TRL's divergence on the student's own samples, falls too (5.32 at step 1,
    1.19 at step 40), and metrics.jsonl holds the student's entropy and completion lengths."""
    before = answer_kl(task["teacher"], task["student"], task["held_out"])
    outcome = run_training(load_config(None, base=distill_config(tmp_path, task, task["teacher"])))
    after = answer_kl(task["teacher"], outcome.final_dir, task["held_out"])
    assert after < 0.6 * before, (before, after)
    logged = [json.loads(line) for line in (outcome.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    first, last = sum(r["loss"] for r in steps[:5]) / 5, sum(r["loss"] for r in steps[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert all("entropy" in r and r["completions/mean_length"] > 0 and r["tokens_per_s"] > 0 for r in steps)


def test_a_teacher_with_another_vocabulary_is_refused_before_training(tmp_path: Path) -> None:
    """Through the CLI: exit code 2, no traceback, a message naming the key, both tokenizers' places
    and how they differ; refused after the tokenizers load and before any model is built."""
    questions = category_task_rows(held_out=0, seed=0)[0]
    texts = [f"{r['question']} {r['answer']}" for r in questions]
    student = save_tiny_llama(tokenizer_of(texts, vocab_size=300), tmp_path / "student")
    teacher = save_tiny_llama(tokenizer_of([t.upper() for t in texts], vocab_size=300), tmp_path / "teacher")
    rows = write_jsonl(tmp_path / "rows.jsonl", as_messages(questions[:32]))
    config = distill_config(tmp_path, {"student": student, "rows": rows}, teacher)
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_cli("train", str(path))  # the data cache: this test's own (conftest's LMFORGE_CACHE)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    message = " ".join(result.stderr.split())  # the console wraps long lines
    assert (
        f"train.distill.teacher: the teacher's tokenizer ({teacher}) does not match the student's" in message
    )
    assert f"(model.path {student})" in message
    assert "tokens have different ids" in message
    assert "M parameters" not in result.stderr  # the runner's line once the student is built
    assert not (tmp_path / "runs" / "distill" / "metrics.jsonl").exists()


def test_a_missing_teacher_is_refused_before_any_work(tmp_path: Path) -> None:
    """The preflight (before the training stack loads) names the key and the path."""
    config = distill_config(
        tmp_path, {"student": tmp_path, "rows": tmp_path / "rows.jsonl"}, tmp_path / "gone"
    )
    with pytest.raises(UserInputError, match=r"train\.distill\.teacher: '.*gone' is not a directory"):
        check_machine_requirements(load_config(None, base=config))


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"stage": "distill"}, "train.distill.teacher: on-policy distillation needs a teacher"),
        ({"stage": "sft", "distill": {"teacher": "t"}}, "train.distill.teacher: a teacher is the model"),
        ({"stage": "distill", "distill": {"teacher": "t"}, "compile": True}, "train.compile: online RL and"),
    ],
)
def test_distill_config_rules(train: dict[str, Any], message: str) -> None:
    config = {"model": {"path": "m"}, "data": {"train": [{"path": "rows.jsonl"}]}, "train": train}
    with pytest.raises(UserInputError, match=message):
        load_config(None, base=config)


def test_distill_settings_reach_trl_distillation_config(tmp_path: Path) -> None:
    """beta selects TRL's divergence (0 forward KL, 1 reverse KL), temperature both sampling and
    the loss, max_new_tokens TRL's max_completion_length."""
    settings = DistillConfig(teacher=Path("t"), beta=0.5, temperature=0.7, max_new_tokens=12)
    args = DistillationConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        activation_checkpointing=False,
        **distill_config_values(settings),
    )
    assert (args.beta, args.temperature, args.max_completion_length) == (0.5, 0.7, 12)
    assert DistillConfig().beta == DistillationConfig.beta  # the default divergence is TRL's (reverse KL)


def test_vocabulary_difference_names_the_first_differing_tokens() -> None:
    assert vocabulary_difference({"a": 0, "b": 1}, {"a": 0, "b": 1}) is None
    reason = vocabulary_difference({"a": 0, "b": 1, "c": 2}, {"a": 0, "c": 1})
    assert reason == (
        "the teacher has 3 tokens and the student 2, and 2 tokens have different ids "
        "('b': teacher id 1, student none; 'c': teacher id 2, student id 1)"
    )
