"""Rewards of online RL (train/rewards.py): each built-in on hand-written completions, the user's
python rewards, a tiny reward model, the default, and the one checker that stops a run on a reward
that raises or returns None, NaN or the wrong count."""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from lmforge.config.schema import RewardConfig
from lmforge.errors import UserInputError, WorkFailed
from lmforge.train import rewards as rewards_module
from lmforge.train.rewards import (
    ErrorPolicy,
    RewardFailed,
    RewardSet,
    build_reward_functions,
    completion_text,
    skip_failed_groups,
)

GROUP = 2


def as_messages(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def call(
    function: Any,
    completions: list[Any],
    answers: list[Any] | None = None,
    prompts: list[Any] | None = None,
    **extra: Any,
) -> list[float]:
    """Call a reward as TRL's GRPOTrainer does: keywords only, one prompt per completion, groups of GROUP."""
    if prompts is None:
        prompts = [[{"role": "user", "content": f"question {i // GROUP}"}] for i in range(len(completions))]
    kwargs: dict[str, Any] = {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": [[7] * len(completion_text(c).split()) for c in completions],
        "trainer_state": None,
        "log_extra": lambda *a, **k: None,
        "log_metric": lambda *a, **k: None,
        **extra,
    }
    if answers is not None:
        kwargs["answer"] = answers
    return function(**kwargs)


def build(*configs: dict[str, Any], has_reference: bool = True, tokenizer: Any = None) -> RewardSet:
    return build_reward_functions(
        [RewardConfig(**c) for c in configs],
        has_reference=has_reference,
        group_size=GROUP,
        tokenizer=tokenizer,
    )


def only(**config: Any) -> Any:
    """The single checked function of one reward."""
    return build(config).functions[0]


def test_completion_text_of_strings_and_messages() -> None:
    assert completion_text("plain") == "plain"
    assert completion_text(as_messages("hello")) == "hello"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "a"}]}]) == "a"


def test_exact_compares_stripped_text_with_and_without_case() -> None:
    completions = [
        as_messages(" Paris \n"),
        as_messages("paris"),
        as_messages("Paris."),
        as_messages("London"),
    ]
    answers = ["Paris"] * 4
    assert call(only(kind="exact"), completions, answers) == [1.0, 1.0, 0.0, 0.0]
    assert call(only(kind="exact", ignore_case=False), completions, answers) == [1.0, 0.0, 0.0, 0.0]


def test_exact_on_plain_string_completions() -> None:
    prompts = ["Q: capital of France? A:", "Q: capital of France? A:"]
    assert call(only(kind="exact"), [" Paris", "Lyon"], ["Paris", "Paris"], prompts=prompts) == [1.0, 0.0]


def test_a_numeric_reference_is_compared_as_text() -> None:
    assert call(only(kind="exact"), ["12", "13"], [12, 12]) == [1.0, 0.0]


def test_contains_finds_the_reference_anywhere() -> None:
    completions = [as_messages("so the answer is 42."), as_messages("4 2"), as_messages("1420")]
    assert call(only(kind="contains"), completions, ["42"] * 3) == [1.0, 0.0, 1.0]
    assert call(only(kind="contains", ignore_case=False), ["The CAT", "the cat"], ["cat", "cat"]) == [
        0.0,
        1.0,
    ]


def test_regex_compares_the_first_group_or_the_whole_match() -> None:
    completions = ["<answer> 7 </answer>", "<answer>8</answer>", "no tags: 7", "<ANSWER>x</ANSWER>"]
    answers = ["7", "7", "7", "X"]
    grouped = only(kind="regex", pattern=r"<answer>(.*?)</answer>")
    assert call(grouped, completions, answers) == [1.0, 0.0, 0.0, 0.0]
    whole = only(kind="regex", pattern=r"\d+")
    assert call(whole, ["it is 7 or 8", "it is 17", "none"], ["7", "7", "7"]) == [1.0, 0.0, 0.0]
    # ignore_case applies to the comparison, not to the search
    assert call(only(kind="regex", pattern=r"<ANSWER>(.*)</ANSWER>"), ["<ANSWER>x</ANSWER>"], ["X"]) == [1.0]


def test_format_matches_across_lines_and_needs_no_reference() -> None:
    reward = build(
        {"kind": "format", "pattern": r"^<think>.*</think>\s*<answer>.*</answer>$"}, has_reference=False
    )
    completions = [
        as_messages("<think>step 1\nstep 2</think>\n<answer>4</answer>\n"),
        as_messages("<answer>4</answer>"),
        as_messages("<think>x</think><answer>4</answer> and more"),
    ]
    assert call(reward.functions[0], completions) == [1.0, 0.0, 0.0]


def test_length_penalises_tokens_past_max_linearly_down_to_minus_one() -> None:
    reward = build({"kind": "length", "max_tokens": 4}, has_reference=False).functions[0]
    completions = [" ".join(["w"] * n) for n in (1, 4, 5, 6, 8, 20)]
    assert call(reward, completions) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_math_equivalence_of_numbers_and_latex() -> None:
    reward = only(kind="math")
    completions = ["12", "12.0", "$12$", "The answer is \\boxed{12}", "13", "I don't know", ""]
    assert call(reward, completions, ["12"] * len(completions)) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert call(reward, ["$12$", "0.5"], ["$12.0$", "$\\frac{1}{2}$"]) == [1.0, 1.0]
    # A bare expression as the reference reads in math mode (outside it, 2x+3 would read as 2).
    assert call(reward, ["$x + 1$", "$x+2$"], ["x+1", "x+1"]) == [1.0, 0.0]
    assert call(reward, ["so $2x + 3$", "2", "\\boxed{\\sqrt 2}"], ["2x+3", "2x+3", "\\sqrt{2}"]) == [
        1.0,
        0.0,
        1.0,
    ]
    # A worked solution as the reference (GSM8K) gives its final number.
    solution = "She sold 48/2 = 24 clips in May, so 48+24 = 72 in all. #### 72"
    assert call(reward, ["72", "24"], [solution, solution]) == [1.0, 0.0]


def test_math_with_a_reference_that_is_no_math_fails_naming_it() -> None:
    with pytest.raises(
        RewardFailed, match=r"prompt 0 .*the reference answer 'the capital of France' cannot be parsed"
    ):
        call(only(kind="math"), ["Paris", "Paris"], ["the capital of France"] * 2)


def test_math_times_out_on_a_runaway_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rewards_module, "MATH_TIMEOUT_S", 1)
    started = time.monotonic()
    assert call(only(kind="math"), ["$9^{9^{9^{9}}}$"], ["2"]) == [0.0]  # sympy alone would run for ever
    assert time.monotonic() - started < 10


def test_default_is_exact_match_and_says_so() -> None:
    reward_set = build_reward_functions([], has_reference=True, group_size=GROUP, tokenizer=None)
    assert reward_set.weights == [1.0]
    assert reward_set.functions[0].__name__ == "exact"
    assert reward_set.announcement == (
        "no train.rewards configured: the reward is exact match against the reference answer (column answer)"
    )
    assert call(reward_set.functions[0], ["4", "5"], ["4", "4"]) == [1.0, 0.0]
    assert build({"kind": "exact"}).announcement is None


def test_no_rewards_and_no_reference_is_a_user_error() -> None:
    with pytest.raises(UserInputError, match=r"train.rewards is needed.*kind: format"):
        build_reward_functions([], has_reference=False, group_size=GROUP, tokenizer=None)


def test_a_reward_needing_the_reference_without_one_names_its_key() -> None:
    with pytest.raises(UserInputError, match=r"train.rewards\[1\].kind.*reference answer column.*columns:"):
        build({"kind": "format", "pattern": "x"}, {"kind": "contains"}, has_reference=False)


def test_names_are_labels_made_unique_and_weights_kept() -> None:
    reward_set = build(
        {"kind": "exact"},
        {"kind": "exact", "weight": 0.5},
        {"kind": "format", "pattern": "x", "name": "tags"},
        {"kind": "exact", "weight": 2.0},
        {"kind": "contains", "name": "exact_4"},
        {"kind": "exact"},
    )
    names = [f.__name__ for f in reward_set.functions]
    assert names == ["exact", "exact_2", "tags", "exact_3", "exact_4", "exact_5"]
    assert reward_set.weights == [1.0, 0.5, 1.0, 2.0, 1.0, 1.0]


# ---- the user's python rewards ---------------------------------------------------------------

USER_CODE = """
import math

seen = {}


def score(prompts, completions, completion_ids, answer, **kwargs):
    seen.update(kwargs, prompts=prompts, answer=answer)
    return [float(len(c[0]["content"])) for c in completions]


def explode(completions, **kwargs):
    return [1.0 / (0 if "boom" in c[0]["content"] else 1) for c in completions]


def nan(completions, **kwargs):
    return [math.nan if "bad" in c[0]["content"] else 1.0 for c in completions]


def none(completions, **kwargs):
    return [None if "bad" in c[0]["content"] else 1.0 for c in completions]


def short(completions, **kwargs):
    return [1.0]


def words(completions, **kwargs):
    return ["one" for c in completions]


def logs_then_explodes(completions, log_metric, **kwargs):
    log_metric("calls", 1.0)
    if any("boom" in c[0]["content"] for c in completions):
        raise RuntimeError("no luck")
    return [0.0 for c in completions]
"""


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_CODE)
    return path


def user(path: Path, name: str) -> Any:
    return only(kind="python", function=f"{path}:{name}", run_user_code=True)


def test_python_reward_from_a_file_gets_every_argument(
    user_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="lmforge.train.rewards"):
        reward = user(user_file, "score")
    assert f"train.rewards[0]: running your code {user_file}:score (run_user_code: true)" in caplog.text
    assert reward.__name__ == "score"
    assert call(reward, [as_messages("ab"), as_messages("abcd")], ["x", "y"], difficulty=[1, 2]) == [2.0, 4.0]
    module = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(user_file))
    assert module.seen["answer"] == ["x", "y"]
    assert module.seen["difficulty"] == [1, 2]
    assert {"trainer_state", "log_extra", "log_metric"} <= set(module.seen)


def test_python_reward_by_module_name(user_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(user_file.parent))
    reward = only(kind="python", function="my_rewards:score", run_user_code=True, name="chars")
    assert reward.__name__ == "chars"
    assert call(reward, [as_messages("abc")], ["x"]) == [3.0]


def test_python_reward_needs_run_user_code() -> None:
    with pytest.raises(ValidationError, match="run_user_code: true"):
        RewardConfig(kind="python", function="my_rewards:score")


def test_a_missing_module_or_function_is_a_user_error(user_file: Path) -> None:
    with pytest.raises(
        UserInputError, match=r"train.rewards\[0\].function: no module named 'no_such_rewards'.*PYTHONPATH"
    ):
        only(kind="python", function="no_such_rewards:score", run_user_code=True)
    with pytest.raises(UserInputError, match=r"train.rewards\[0\].function: no file"):
        only(kind="python", function=f"{user_file.parent}/absent.py:score", run_user_code=True)
    with pytest.raises(UserInputError, match=r"has no 'absent'"):
        user(user_file, "absent")


def test_a_raising_reward_stops_the_run_naming_reward_prompt_and_exception(user_file: Path) -> None:
    completions = [as_messages(t) for t in ("fine", "fine", "fine", "fine", "fine", "it goes boom")]
    with pytest.raises(RewardFailed) as failure:
        call(user(user_file, "explode"), completions, ["x"] * 6)
    message = str(failure.value)
    assert "reward 'explode' failed on completion 5 of the batch (prompt 2 of the batch" in message
    assert "'question 2'" in message and "'it goes boom'" in message
    assert "ZeroDivisionError: float division by zero" in message
    assert "stopped before the policy update" in message
    assert isinstance(failure.value, WorkFailed)
    assert isinstance(failure.value.__cause__, ZeroDivisionError)


def test_finding_the_failing_completion_logs_nothing(user_file: Path) -> None:
    logged: list[tuple[str, float]] = []
    completions = [as_messages("fine"), as_messages("boom"), as_messages("fine")]
    with pytest.raises(RewardFailed, match=r"completion 1 .*prompt 0 .*RuntimeError: no luck"):
        call(
            user(user_file, "logs_then_explodes"),
            completions,
            ["x"] * 3,
            log_metric=lambda *a: logged.append(a),
        )
    assert logged == [("calls", 1.0)]  # the batch's call only, none from scoring each completion alone


@pytest.mark.parametrize(
    ("name", "returned"),
    [("nan", "it returned nan"), ("none", "it returned None"), ("words", "it returned 'one'")],
)
def test_none_nan_or_text_stops_the_run(user_file: Path, name: str, returned: str) -> None:
    completions = [as_messages("ok"), as_messages("ok"), as_messages("bad")]
    with pytest.raises(RewardFailed, match=rf"reward '{name}' failed on completion [02] .*{returned}"):
        call(user(user_file, name), completions, ["x"] * 3)


def test_the_wrong_count_stops_the_run(user_file: Path) -> None:
    with pytest.raises(RewardFailed, match=r"returned 1 rewards for a batch of 3 completions"):
        call(user(user_file, "short"), [as_messages("a")] * 3, ["x"] * 3)


# ---- a reward model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Any:
    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.tokenizer import train_tokenizer

    text = ["the cat sat on the mat and the answer is 12\n", "what is two plus two? four\n"] * 50
    return train_tokenizer(text, TokenizerTrainConfig(vocab_size=300, min_frequency=1))


def _tiny_config(tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any) -> Path:
    from transformers import LlamaForSequenceClassification

    out = tmp_path_factory.mktemp("reward_model")
    torch.manual_seed(0)
    LlamaForSequenceClassification(_tiny_config(tiny_tokenizer)).save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


def own_score(directory: Path, tokenizer: Any, text: str) -> float:
    """The model's logits[:, 0] on one unpadded text, computed here without lmforge."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        return float(model(**ids).logits[0, 0])


def test_model_reward_scores_prompt_and_completion(reward_model_dir: Path, tiny_tokenizer: Any) -> None:
    reward = only(kind="model", path=str(reward_model_dir))
    assert reward.__name__ == "model"
    prompt = [{"role": "user", "content": "what is two plus two?"}]
    completions = [as_messages("four"), as_messages("the cat sat on the mat and the answer is 12")]
    scores = call(reward, completions, prompts=[prompt, prompt])
    assert all(math.isfinite(s) for s in scores)
    assert scores[0] != scores[1]
    # the shorter text was padded on the right in the batch: its score is still its own
    for completion, score in zip(completions, scores, strict=True):
        text = tiny_tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        assert score == pytest.approx(own_score(reward_model_dir, tiny_tokenizer, text), abs=1e-5)


def test_model_reward_on_plain_text_with_the_policy_tokenizer(
    tmp_path: Path, reward_model_dir: Path, tiny_tokenizer: Any
) -> None:
    from transformers import AutoModelForSequenceClassification

    bare = tmp_path / "no_tokenizer"
    AutoModelForSequenceClassification.from_pretrained(reward_model_dir).save_pretrained(bare)
    reward = build(
        {"kind": "model", "path": str(bare), "name": "rm"}, has_reference=False, tokenizer=tiny_tokenizer
    )
    scores = call(reward.functions[0], [" four", " the mat"], prompts=["two plus two is", "two plus two is"])
    assert scores[0] == pytest.approx(own_score(bare, tiny_tokenizer, "two plus two is four"), abs=1e-5)
    assert scores[0] != scores[1]


def test_a_reward_model_path_that_is_no_reward_model_names_the_key(
    tmp_path: Path, tiny_tokenizer: Any
) -> None:
    from transformers import LlamaForCausalLM

    with pytest.raises(UserInputError, match=r"train.rewards\[0\].path: .* is not a directory"):
        only(kind="model", path=str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        UserInputError, match=r"train.rewards\[0\].path: .* does not load as a sequence-classification"
    ):
        only(kind="model", path=str(tmp_path / "empty"))
    LlamaForCausalLM(_tiny_config(tiny_tokenizer)).save_pretrained(tmp_path / "causal")
    with pytest.raises(
        UserInputError, match=r"train.rewards\[0\].path: .* no trained sequence-classification head"
    ):
        only(kind="model", path=str(tmp_path / "causal"))


def test_the_first_reward_logs_each_rows_reference_for_the_samples() -> None:
    """TRL keeps what rewards pass to `log_extra` next to the completions; rl_samples.jsonl then shows
    each completion's reference answer (it showed "reference": null)."""
    from lmforge.train.rl_samples import latest_samples

    logged: list[tuple[str, list[Any]]] = []
    rewards = build({"kind": "exact"}, {"kind": "format", "pattern": "x"})
    completions = [as_messages("animal"), as_messages("fruit")]
    for function in rewards.functions:
        call(
            function,
            completions,
            [" animal ", 7],
            log_extra=lambda column, values: logged.append((column, values)),
        )
    assert logged == [("answer", ["animal", "7"])]  # once per batch, from the first reward only
    trl_logs = {
        "prompt": [
            [{"role": "user", "content": "What group is cat in?"}],
            [{"role": "user", "content": "7?"}],
        ],
        "completion": completions,
        "rewards": {"exact": [1.0, 0.0], "format": [0.0, 0.0]},
        "extra": {"answer": ["animal", "7"]},
    }
    samples = latest_samples(trl_logs, 2, rewards.weights)
    assert [(s.prompt, s.reference, s.reward) for s in samples] == [
        ("What group is cat in?", "animal", 1.0),
        ("7?", "7", 0.0),
    ]


def guarded(user_file: Path, name: str, on_error: str, max_fraction: float = 0.5) -> Any:
    """A user reward under train.rl.on_reward_error `on_error`."""
    return build_reward_functions(
        [RewardConfig(kind="python", function=f"{user_file}:{name}", run_user_code=True)],
        has_reference=True,
        group_size=GROUP,
        tokenizer=None,
        policy=ErrorPolicy(on_error, max_fraction),  # type: ignore[arg-type]
    ).functions[0]


def test_a_failing_completion_counts_zero_or_none_and_is_logged(
    user_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The batch call raises on "boom": each completion is scored alone, the one that fails gets 0
    (zero) or no reward (skip_group), the share of failures goes to TRL's log_metric, and the
    failure is logged naming the completion and its prompt."""
    completions = [as_messages(t) for t in ("fine", "boom", "fine", "fine")]
    for on_error, fallback in (("zero", 0.0), ("skip_group", None)):
        logged: dict[str, float] = {}
        with caplog.at_level(logging.WARNING, logger="lmforge.train.rewards"):
            got = call(guarded(user_file, "explode", on_error), completions, log_metric=logged.__setitem__)
        assert got == [1.0, fallback, 1.0, 1.0]
        assert logged == {"rewards/explode/failed": 0.25}
        assert "reward 'explode' failed on completion 1 of the batch (prompt 0" in caplog.text
        assert "ZeroDivisionError" in caplog.text
    # A value that is no number (None, NaN) is a failure of that completion too.
    bad = [as_messages(t) for t in ("bad", "ok")]
    assert call(guarded(user_file, "nan", "zero"), bad) == [0.0, 1.0]
    assert call(guarded(user_file, "none", "skip_group"), bad) == [None, 1.0]


def test_failures_past_the_fraction_stop_the_run_and_a_broken_function_always_does(user_file: Path) -> None:
    reward = guarded(user_file, "explode", "zero", max_fraction=0.3)
    half_boom = [as_messages(t) for t in ("boom", "fine") * 4]
    for _ in range(3):  # 24 completions scored: under MIN_JUDGED, so counted and zeroed
        assert call(reward, half_boom) == [0.0, 1.0] * 4
    with pytest.raises(
        RewardFailed,
        match=r"failed on 16 of the 32 completions it scored \(50%, more than "
        r"train.rl.max_reward_error_fraction 0.3\); the latest: reward 'explode' failed on completion 0",
    ):
        call(reward, half_boom)
    with pytest.raises(RewardFailed, match=r"returned 1 rewards for a batch of 3 completions"):
        call(guarded(user_file, "short", "zero"), [as_messages("a")] * 3)


def test_skip_group_leaves_every_row_of_a_failed_group_without_reward() -> None:
    nan = float("nan")
    rewards = torch.tensor([[1.0, 0.5], [0.0, nan], [1.0, 1.0], [0.0, 0.0], [nan, nan], [1.0, 0.0]])
    skipped = skip_failed_groups(rewards, group_size=2)
    assert torch.isnan(skipped[:2]).all() and torch.isnan(skipped[4:]).all()  # groups 0 and 2
    assert torch.equal(skipped[2:4], rewards[2:4])
    assert not torch.isnan(rewards[0]).any()  # TRL's tensor is left as it was
