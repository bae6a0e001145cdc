"""Multi-turn tool use in online RL (train.rl.tools): TRL's GRPOTrainer runs the episodes with
lmforge's tools, response templates and checks. The end-to-end test teaches a tiny llama to call
the built-in calculator: after SFT on conversations that call it half the time (and answer
directly, mostly wrong, otherwise), GRPO with an exact-match reward raises the share of episodes
that call the tool and the reward with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers.utils import get_json_schema
from trl.chat_template_utils import parse_response

from lmforge.config import load_config
from lmforge.config.schema import ModelConfig, RlToolsConfig, TokenizerTrainConfig
from lmforge.data.chat_templates import BUILTIN_TEMPLATES, ensure_template_tokens
from lmforge.data.synthetic import (
    CALCULATOR_SCHEMA,
    calculator_sft_rows,
    calculator_task_rows,
    calculator_tokenizer,
    write_jsonl,
)
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import UserInputError
from lmforge.models.build import build_model
from lmforge.train.rl_check import Group, episode_masks
from lmforge.train.runner import run_training
from lmforge.train.tools import TOOL_TEMPLATES, calculator, response_template, tool_arguments
from tests.conftest import run_cli

# 4 heads: two layers of 2 heads did not learn to copy the numbers into the call in 2,000 steps.
TOOL_ARCH = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_the_calculator_computes_and_refuses_anything_but_arithmetic() -> None:
    assert calculator(" 12 * (3 + 4)") == "84"
    assert calculator("7 / 2") == "3.5" and calculator("2 ** 10") == "1024" and calculator("-5 + 2") == "-3"
    assert calculator("1 / 3") == "0.333333333333"
    for bad, reason in [
        ("__import__('os').system('true')", "only numbers"),
        ("a + 1", "only numbers"),
        ("9 ** 9 ** 9", "exponent"),
        ("(10 ** 60) ** 60 * 10 ** 60", "more than 150 digits"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 201, "longer than 200"),
    ]:
        with pytest.raises(ValueError, match=reason):
            calculator(bad)
    # The data stage writes the calculator's schema into the SFT rows without importing train/.
    assert get_json_schema(calculator) == CALCULATOR_SCHEMA


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_each_tool_template_parses_back_the_calls_it_renders(name: str) -> None:
    """What the template writes for an assistant tool call, TRL's response template (the one
    lmforge gives the tokenizer) reads back as the same call."""
    tokenizer = train_tokenizer(
        ["What is 12 + 30? 42"] * 20, TokenizerTrainConfig(vocab_size=300, min_frequency=1)
    )
    ensure_template_tokens(tokenizer, name)
    tokenizer.chat_template = BUILTIN_TEMPLATES[name]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": " 12 + 30"}}}
    prompt = [{"role": "user", "content": "What is 12 + 30?"}]
    before = tokenizer.apply_chat_template(
        prompt, tools=[calculator], add_generation_prompt=True, tokenize=False
    )
    full = tokenizer.apply_chat_template(
        [*prompt, {"role": "assistant", "content": "", "tool_calls": [call]}],
        tools=[calculator],
        tokenize=False,
    )
    assert full.startswith(before)
    tokenizer.response_template = response_template(name)
    written = tokenizer(full[len(before) :], add_special_tokens=False)["input_ids"]
    prefix = tokenizer(before, add_special_tokens=False)["input_ids"]
    parsed = parse_response(tokenizer, written, prefix=prefix, tools=[calculator])  # as GRPOTrainer parses
    assert parsed["tool_calls"] == [call], parsed


def test_tool_settings_are_checked_before_training(tmp_path: Path) -> None:
    """User code needs the opt-in; a template without a tool-call format, a function the model
    cannot be told about, and an environment without reset are refused with the key to fix."""
    with pytest.raises(ValueError, match="run your code; set `run_user_code: true`"):
        RlToolsConfig(functions=["calculator", "my_tools:search"])
    with pytest.raises(ValueError, match="neither a built-in tool"):
        RlToolsConfig(functions=["search"])
    with pytest.raises(ValueError, match="need `functions`"):
        RlToolsConfig()
    tokenizer = train_tokenizer(
        ["What is 1 + 2? 3"] * 20, TokenizerTrainConfig(vocab_size=300, min_frequency=1)
    )
    with pytest.raises(UserInputError, match=r"data.chat_template: .*chatml has none .* qwen2, qwen3"):
        tool_arguments(RlToolsConfig(functions=["calculator"]), tokenizer)  # the tokenizer's ChatML
    tokenizer.chat_template = BUILTIN_TEMPLATES["qwen2"]
    (tmp_path / "my_tools.py").write_text(
        "def search(query: str) -> str:\n    return query\n\nclass Shop:\n    def buy(self, item: str) -> str:\n"
        '        """Buy.\n\n        Args:\n            item: What.\n        """\n        return item\n'
    )
    with pytest.raises(UserInputError, match=r"train.rl.tools.functions\[0\]: search cannot be described"):
        tool_arguments(
            RlToolsConfig(functions=[f"{tmp_path}/my_tools.py:search"], run_user_code=True), tokenizer
        )
    with pytest.raises(UserInputError, match=r"train.rl.tools.environment: .*Shop has no reset method"):
        tool_arguments(
            RlToolsConfig(environment=f"{tmp_path}/my_tools.py:Shop", run_user_code=True), tokenizer
        )
    arguments = tool_arguments(RlToolsConfig(functions=["calculator"]), tokenizer)
    assert arguments["tools"] == [calculator] and tokenizer.response_template is not None

    config = tmp_path / "rloo.yaml"
    config.write_text(
        "model: {path: base}\ndata: {train: [{path: rows.jsonl}]}\n"
        "train: {stage: rloo, rl: {tools: {functions: [calculator]}}}\n"
    )
    refused = run_cli("config", "show", str(config))
    assert refused.returncode == 2 and "train.rl.tools" in refused.stderr
    assert "run on TRL's GRPOTrainer" in refused.stderr and "Traceback" not in refused.stderr


def test_the_episode_mask_check_fails_when_a_tool_result_carries_loss() -> None:
    """rl check's comparison of the trainer's loss mask with the chat template's: an episode whose
    tool result carries loss (a tool loop that forgot to mask it) fails, naming the tokens."""
    tokenizer = calculator_tokenizer(calculator_sft_rows(20, tool_share=1.0, seed=0))
    turns = calculator_sft_rows(1, tool_share=1.0, seed=0)[0]["messages"]
    prompt, episode = turns[:1], turns[1:]
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)["input_ids"]
    rendered = tokenizer.apply_chat_template(
        turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = rendered["input_ids"][len(prompt_ids) :]
    right = list(rendered["assistant_masks"][len(prompt_ids) :])
    assert 0 in right and 1 in right  # the tool result is masked, the model's turns are not

    def check(mask: list[int]) -> Any:
        group = Group({"prompt": prompt}, prompt_ids, [ids], [], [""], episodes=[episode], loss_masks=[mask])
        return episode_masks(tokenizer, [group], None)

    assert check(right).status == "pass"
    wrong = check([1] * len(ids))
    assert wrong.status == "fail" and "in 1 of 1 tool-use episodes" in wrong.summary
    assert episode[1]["content"] in wrong.summary  # the tool's result is among the tokens named


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_grpo_teaches_a_tiny_model_to_call_the_calculator(tmp_path: Path) -> None:
    """SFT (2,000 steps) on conversations that call the calculator half the time; `rl check` on
    the result rolls out tool-use episodes and finds the loss on the model's turns only; then 30
    GRPO steps with the exact-match reward and the built-in calculator: the share of episodes
    that call the tool and the reward both rise (measured over the first 5 and the last 10 steps:
    calls 0.63 -> 0.91 per episode, exact-match reward 0.56 -> 0.70). The reward functions see
    the whole episode, the tool's results included; the run directory records the tools and the
    turn limit."""
    sft_rows = calculator_sft_rows(2000, tool_share=0.5, seed=3)
    write_jsonl(tmp_path / "sft.jsonl", sft_rows)
    write_jsonl(tmp_path / "questions.jsonl", calculator_task_rows(400, seed=4))
    tokenizer = calculator_tokenizer(sft_rows)
    torch.manual_seed(0)
    build_model(
        ModelConfig(preset="llama-tiny", config=TOOL_ARCH), tokenizer, max_length=128
    ).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    sft = run_training(
        load_config(
            None,
            base={
                "run": {"name": "sft", "output_dir": str(tmp_path / "runs"), "seed": 0},
                "model": {"path": str(tmp_path / "base")},
                "data": {"train": [{"path": str(tmp_path / "sft.jsonl")}], "max_length": 96},
                "train": {
                    "stage": "sft",
                    "max_steps": 2000,
                    "micro_batch_size": 16,
                    "lr": 3e-3,
                    "schedule": "cosine",
                    "warmup_steps": 10,
                    "precision": "fp32",
                    "log_every": 500,
                },
            },
        )
    )
    (tmp_path / "episode.py").write_text(EPISODE_REWARD)
    config = {
        "run": {"name": "grpo-tools", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"path": str(sft.final_dir)},
        "data": {"train": [{"path": str(tmp_path / "questions.jsonl")}], "max_length": 96},
        "train": {
            "stage": "grpo",
            "max_steps": 30,
            "micro_batch_size": 16,
            "lr": 1e-3,
            "schedule": "constant",
            "precision": "fp32",
            "log_every": 1,
            "rl": {
                "group_size": 8,
                "max_completion_length": 64,
                "tools": {"functions": ["calculator"], "max_turns": 2},
            },
            "rewards": [
                {"kind": "exact"},
                {
                    "kind": "python",
                    "function": f"{tmp_path / 'episode.py'}:results_follow_calls",
                    "run_user_code": True,
                    "weight": 0.0,
                },
            ],
        },
    }
    # rl check rolls out episodes with TRL's tool loop and finds the loss on the model's turns only.
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(config))
    checked = run_cli("rl", "check", str(tmp_path / "grpo.yaml"), "--json")
    assert checked.returncode == 0, checked.stderr[-2000:]
    report = {c["name"]: c for c in json.loads(checked.stdout)["checks"]}
    assert report["episode_mask"]["status"] == "pass", report["episode_mask"]
    assert (
        report["episode_mask"]["figures"]["episodes"] >= 32
        and report["episode_mask"]["figures"]["masked_tokens"] > 0
    )
    example = json.loads(checked.stdout)["example"]
    assert any(not loss and "ipython" in text for text, loss in example["runs"])  # the tool turn, masked
    outcome = run_training(load_config(None, base=config))
    rows = [json.loads(line) for line in (outcome.run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward" in r]
    assert len(rows) == 30
    calls = [r["tools/call_frequency"] for r in rows]
    rewards = [r["rewards/exact/mean"] for r in rows]
    assert mean(calls[-10:]) >= mean(calls[:5]) + 0.15, calls
    assert mean(rewards[-10:]) >= mean(rewards[:5]) + 0.05, rewards
    # Every tool call an episode went on after was followed by the calculator's result, as the reward saw it.
    assert all(r["rewards/results_follow_calls/mean"] == 1.0 for r in rows)
    samples = [json.loads(line) for line in (outcome.run_dir / "rl_samples.jsonl").read_text().splitlines()]
    assert any(s["completion"].startswith('calculator({"expression"') for s in samples)
    settings = json.loads((outcome.run_dir / "rl_settings.json").read_text())
    assert settings["tools"] == ["calculator"] and settings["max_tool_calling_iterations"] == 2


EPISODE_REWARD = """
from lmforge.train.tools import calculator

def results_follow_calls(completions, **kwargs):
    # 1.0 when each tool call the episode goes on after is followed by the tool message with its
    # result (a call in the last turn is not run: the turn limit, or no token budget left for it).
    scores = []
    for episode in completions:
        ok = True
        for i, message in enumerate(episode[:-1]):
            for call in message.get("tool_calls") or []:
                following = episode[i + 1]
                try:
                    expected = calculator(**call["function"]["arguments"])
                except Exception as err:
                    expected = str({"error": str(err)})
                ok = ok and following.get("role") == "tool" and str(following.get("content")) == expected
        scores.append(1.0 if ok else 0.0)
    return scores
"""
