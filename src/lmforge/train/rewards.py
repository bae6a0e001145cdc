"""`train.rewards` -> the reward functions TRL's GRPOTrainer and RLOOTrainer call.

TRL calls each function as `f(prompts=..., completions=..., completion_ids=..., answer=[...],
trainer_state=..., log_extra=..., log_metric=..., **other columns)` and wants one float per
completion; it names the metrics `rewards/<f.__name__>/mean`. Each configured reward becomes one
such function, named by its label. Every function, built-in or the user's, goes through one
checker: a reward that raises, or gives None, NaN, infinity or the wrong count, stops the run
with a `RewardFailed` naming the reward, the completion and its prompt, before the policy
update that would have used it. TRL itself would turn None into NaN and train on it. Under
`train.rl.on_reward_error: zero | skip_group` a failed completion gets 0, or no reward (its group
then sits the update out), each failure is logged and counted (rewards/<name>/failed), and the
run stops once more than `max_reward_error_fraction` of a reward's completions have failed.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from lmforge.config.schema import RewardConfig
from lmforge.errors import UserInputError, WorkFailed
from lmforge.train.reward_sources import (
    RewardFn,
    answer_text,
    completion_text,
    content_text,
    model_reward,
    python_reward,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

REFERENCE_COLUMN = "answer"  # the data stage's name for a row's reference answer
NEEDS_REFERENCE = ("exact", "contains", "regex", "math")
# math-verify's own guard against sympy running for ever (it hangs on 9^{9^{9^{9}}}); signal
# based, so only possible in the main thread.
MATH_TIMEOUT_S = 5
_CUT = 60  # characters of a prompt or completion quoted in an error


# What TRL calls: one reward per completion, None where it has none (TRL's unscorable rows).
CheckedReward = Callable[..., list[float | None]]


class RewardFailed(WorkFailed):
    """A reward function raised, or returned something other than one finite float per completion."""


@dataclass
class RewardSet:
    """The reward functions of a run, their weights, and a line to show at start (or None)."""

    functions: list[CheckedReward]
    weights: list[float]
    announcement: str | None = None


def build_reward_functions(
    rewards: list[RewardConfig],
    *,
    has_reference: bool,
    group_size: int,
    tokenizer: PreTrainedTokenizerBase | None,
    device: str = "cpu",
    policy: ErrorPolicy | None = None,
) -> RewardSet:
    """The checked reward functions of `train.rewards`, or exact match against the reference
    when none is configured. Everything that can fail before training fails here: a reward
    that needs reference answers the data lacks, a reward model that does not load, user code
    that does not import. `tokenizer` (the policy's) serves a reward model saved without one."""
    announcement = None
    if not rewards:
        if not has_reference:
            raise UserInputError(
                "train.rewards is needed: the data has no reference answers, so there is no default "
                "exact-match reward. Fix: configure at least one reward, for example "
                "`train: {rewards: [{kind: format, pattern: '<answer>.*</answer>'}]}`, or map a reference "
                "answer column with `columns:` on the data source"
            )
        rewards = [RewardConfig(kind="exact")]
        announcement = (
            f"no train.rewards configured: the reward is exact match against the reference answer "
            f"(column {REFERENCE_COLUMN})"
        )
    for index, reward in enumerate(rewards):
        if reward.kind in NEEDS_REFERENCE and not has_reference:
            raise UserInputError(
                f"train.rewards[{index}].kind: a {reward.kind} reward compares with the row's reference "
                f"answer, and the data needs a reference answer column ({REFERENCE_COLUMN}) for it. Fix: map "
                "it with `columns:` on the data source (e.g. columns: {prompt: question, response: solution}), "
                "or use a reward that needs none (format, length, model, python)"
            )
    names = _unique_names([reward.label for reward in rewards])
    functions = [
        # The first function also puts each row's reference answer in TRL's completion log
        # (rl_samples.jsonl shows it next to the completion and its reward).
        _checked(
            _build_one(index, reward, tokenizer, device),
            name,
            group_size,
            logs_reference=index == 0,
            policy=policy or ErrorPolicy(),
        )
        for index, (reward, name) in enumerate(zip(rewards, names, strict=True))
    ]
    return RewardSet(functions, [reward.weight for reward in rewards], announcement)


def _unique_names(labels: list[str]) -> list[str]:
    """Labels made unique (TRL keys metrics by name): the second `exact` becomes `exact_2`."""
    names: list[str] = []
    for label in labels:
        name, copies = label, 1
        while name in names:
            copies += 1
            name = f"{label}_{copies}"
        names.append(name)
    return names


def _build_one(
    index: int, reward: RewardConfig, tokenizer: PreTrainedTokenizerBase | None, device: str
) -> RewardFn:
    """The unchecked function of one reward (the schema guarantees its kind's settings are set)."""
    if reward.kind == "exact":
        return _against_reference(lambda text, ref: float(_same(text, ref, reward.ignore_case)))
    if reward.kind == "contains":
        return _against_reference(
            lambda text, ref: float(_fold(ref, reward.ignore_case) in _fold(text, reward.ignore_case))
        )
    if reward.kind == "regex":
        return _against_reference(_regex_score(str(reward.pattern), reward.ignore_case))
    if reward.kind == "format":
        return _format_reward(str(reward.pattern))
    if reward.kind == "length":
        return _length_reward(int(reward.max_tokens or 0))
    if reward.kind == "math":
        return _math_reward()
    if reward.kind == "model":
        return model_reward(index, str(reward.path), tokenizer, device)
    return python_reward(index, str(reward.function))


# ---- built-ins over the completion text ------------------------------------------------------


def _fold(text: str, ignore_case: bool) -> str:
    return text.casefold() if ignore_case else text


def _same(answer: str, reference: str, ignore_case: bool) -> bool:
    return _fold(answer, ignore_case) == _fold(reference, ignore_case)


def _reference_text(value: Any) -> str:
    """A row's reference answer as stripped text; a row without one cannot be scored."""
    if value is None:
        raise ValueError("this row has no reference answer (its answer is empty)")
    return str(value).strip()


def _against_reference(score: Callable[[str, str], float]) -> RewardFn:
    """A batch reward from `score(completion text, reference)`, both stripped."""

    def reward(*, completions: list[Any], **kwargs: Any) -> list[float]:
        if REFERENCE_COLUMN not in kwargs:
            raise KeyError(f"the batch has no `{REFERENCE_COLUMN}` column of reference answers")
        references = kwargs[REFERENCE_COLUMN]
        return [
            score(answer_text(c).strip(), _reference_text(r))
            for c, r in zip(completions, references, strict=True)
        ]

    return reward


def _regex_score(pattern: str, ignore_case: bool) -> Callable[[str, str], float]:
    """1 when the pattern's first group (else its whole match) in the completion equals the same
    extract of the reference; a reference the pattern does not match is compared whole (a bare
    "22" as well as a worked "41 - 19 = 22" with the pattern `=\\s*(-?\\d+)`)."""
    compiled = re.compile(pattern)

    def extract(text: str) -> str | None:
        match = compiled.search(text)
        if match is None:
            return None
        found = match.group(1) if compiled.groups else match.group(0)
        return None if found is None else found.strip()

    def score(text: str, reference: str) -> float:
        found = extract(text)
        expected = extract(reference)
        return float(
            found is not None and _same(found, reference if expected is None else expected, ignore_case)
        )

    return score


def _format_reward(pattern: str) -> RewardFn:
    """1 when the completion matches `pattern` anywhere (`.` crossing lines), else 0."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(*, completions: list[Any], **_: Any) -> list[float]:
        return [1.0 if compiled.search(completion_text(c).strip()) else 0.0 for c in completions]

    return reward


def _length_reward(max_tokens: int) -> RewardFn:
    """0 up to `max_tokens` completion tokens, then falling linearly to -1 at twice that."""

    def reward(*, completion_ids: list[Sequence[int]], **_: Any) -> list[float]:
        return [max(-1.0, -max(0, len(ids) - max_tokens) / max_tokens) for ids in completion_ids]

    return reward


def _math_reward() -> RewardFn:
    """1 when math-verify finds the completion's answer equal to the reference."""
    from math_verify import parse, verify

    def parse_reference(reference: str, timeout: int | None) -> list[Any]:
        for candidate in _reference_readings(reference):
            gold = list(parse(candidate, parsing_timeout=timeout))
            if gold:
                return gold
        raise ValueError(
            f"the reference answer {reference!r} cannot be parsed as math (math-verify finds no number "
            "or expression in it); write references as numbers or LaTeX, e.g. 12, \\frac{1}{2}, $x+1$"
        )

    def reward(*, completions: list[Any], **kwargs: Any) -> list[float]:
        if REFERENCE_COLUMN not in kwargs:
            raise KeyError(f"the batch has no `{REFERENCE_COLUMN}` column of reference answers")
        # No timeout off the main thread: math-verify's alarm signal works only there.
        timeout = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
        golds: dict[str, list[Any]] = {}  # a group's completions share one reference: parse it once
        scores = []
        for completion, value in zip(completions, kwargs[REFERENCE_COLUMN], strict=True):
            reference = _reference_text(value)
            if reference not in golds:
                golds[reference] = parse_reference(reference, timeout)
            # An unparseable completion parses to [] and verifies False: the answer is wrong, the reward fine.
            answer = parse(answer_text(completion).strip(), parsing_timeout=timeout)
            scores.append(1.0 if verify(golds[reference], answer, timeout_seconds=timeout) else 0.0)
        return scores

    return reward


# A word of prose: three letters or more that are not a LaTeX command (\frac, \sqrt).
_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")


def _reference_readings(reference: str) -> list[str]:
    """How to read a reference, best first. A bare math answer (2x+3, \\sqrt{2}) reads in math mode:
    outside it math-verify takes the first number it finds (2) or nothing. Prose (a worked
    solution ending in the answer) reads as it is, math-verify picking the answer out of it."""
    if "$" in reference or _PROSE_WORD.search(reference):
        return [reference]
    return [f"${reference}$", reference]


@dataclass(frozen=True)
class ErrorPolicy:
    """What a reward that fails on a completion does (train.rl.on_reward_error), and the share of
    failures over which the run stops anyway (train.rl.max_reward_error_fraction)."""

    on_error: Literal["stop", "zero", "skip_group"] = "stop"
    max_fraction: float = 0.1


MIN_JUDGED = 32  # completions a reward scores before its share of failures can stop the run


def _checked(
    function: RewardFn,
    name: str,
    group_size: int,
    *,
    logs_reference: bool = False,
    policy: ErrorPolicy = ErrorPolicy(),
) -> CheckedReward:
    """`function` under the rules every reward follows, named `name` (TRL's metric name).
    `logs_reference`: also hand the batch's reference answers to TRL's `log_extra`, which keeps
    them in the trainer's completion log next to the prompts (`_logs["extra"]["answer"]`).
    A completion the function fails on stops the run, or under `policy` gets 0 (zero) or None
    (skip_group: TRL leaves a row without a reward out, and the adapter its group)."""
    tally = {"failed": 0, "scored": 0}

    def reward(**kwargs: Any) -> list[float | None]:
        if logs_reference and REFERENCE_COLUMN in kwargs and callable(kwargs.get("log_extra")):
            kwargs["log_extra"](REFERENCE_COLUMN, [_logged_reference(r) for r in kwargs[REFERENCE_COLUMN]])
        try:
            values = function(**kwargs)
            problems: dict[int, str] = {}
        except Exception as err:
            if policy.on_error == "stop":
                raise _failure_of_exception(function, name, group_size, kwargs, err) from err
            values, problems = _scored_alone(function, kwargs)
        numbers = _numbers(values, name, kwargs, problems)
        if problems and policy.on_error == "stop":
            i = min(problems)
            raise RewardFailed(f"{_failure_text(name, i, group_size, kwargs, problems[i])}. {_STOPPED}")
        if policy.on_error != "stop":
            _count_failures(tally, problems, name, group_size, kwargs, policy)
        fallback = 0.0 if policy.on_error == "zero" else None
        scored: list[float | None] = [fallback if i in problems else n for i, n in enumerate(numbers)]
        return scored

    reward.__name__ = reward.__qualname__ = name
    return reward


def _count_failures(
    tally: dict[str, int],
    problems: dict[int, str],
    name: str,
    group_size: int,
    kwargs: dict[str, Any],
    policy: ErrorPolicy,
) -> None:
    """Add a batch's failures to the reward's tally, log their share (rewards/<name>/failed) and the
    first of them; a RewardFailed once the tally's share passes the policy's fraction."""
    count = len(kwargs["completions"])
    tally["failed"] += len(problems)
    tally["scored"] += count
    if callable(kwargs.get("log_metric")):
        kwargs["log_metric"](f"rewards/{name}/failed", len(problems) / max(count, 1))
    if not problems:
        return
    i = min(problems)
    latest = _failure_text(name, i, group_size, kwargs, problems[i])
    counted = "0" if policy.on_error == "zero" else "no reward: its group sits this update out"
    log.warning(
        "%s; %d of this batch's %d completions failed, each counted as %s",
        latest,
        len(problems),
        count,
        counted,
    )
    share = tally["failed"] / tally["scored"]
    if tally["scored"] >= MIN_JUDGED and share > policy.max_fraction:
        raise RewardFailed(
            f"reward {name!r} failed on {tally['failed']} of the {tally['scored']} completions it scored "
            f"({share:.0%}, more than train.rl.max_reward_error_fraction {policy.max_fraction:g}); the latest: "
            f"{latest}. Fix the reward (or raise the fraction). The run stopped before the policy update of "
            "this batch"
        )


def _logged_reference(value: Any) -> str | None:
    return None if value is None else str(value).strip()


def _numbers(values: Any, name: str, kwargs: dict[str, Any], problems: dict[int, str]) -> list[float]:
    """`values` as one float per completion; a value that is no finite number is added to
    `problems` (its index -> what it was) and stands as NaN. A result that is not one value per
    completion stops the run whatever the policy: the function itself is broken."""
    count = len(kwargs["completions"])
    try:
        values = list(values)
    except TypeError:
        raise RewardFailed(
            f"reward {name!r} returned {values!r} ({type(values).__name__}), not a list of one float per "
            f"completion. {_STOPPED}"
        ) from None
    if len(values) != count:
        raise RewardFailed(
            f"reward {name!r} returned {len(values)} rewards for a batch of {count} completions; it must return "
            f"one per completion. {_STOPPED}"
        )
    numbers = []
    for i, value in enumerate(values):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) and i not in problems:
            got = "None" if value is None else f"{value!r} ({type(value).__name__})"
            problems[i] = f"it returned {got}, not a finite number"
        numbers.append(number)
    return numbers


def _scored_alone(function: RewardFn, kwargs: dict[str, Any]) -> tuple[list[Any], dict[int, str]]:
    """A batch the function raised on, scored one completion at a time: each value (None where it
    raised again) and what each failing call raised."""
    count = len(kwargs["completions"])
    values: list[Any] = []
    problems: dict[int, str] = {}
    for i in range(count):
        try:
            alone = list(function(**_one_completion(kwargs, i, count)))
            values.append(alone[0] if len(alone) == 1 else None)
        except Exception as err:
            problems[i] = f"{type(err).__name__}: {err}"
            values.append(None)
    return values, problems


def _failure_of_exception(
    function: RewardFn, name: str, group_size: int, kwargs: dict[str, Any], err: Exception
) -> RewardFailed:
    """A RewardFailed for a reward that raised on a batch, pointing at the first completion that
    fails when scored alone (the run stops anyway, so the extra calls cost nothing that matters)."""
    count = len(kwargs["completions"])
    _, problems = _scored_alone(function, kwargs)
    if problems:
        i = min(problems)
        return RewardFailed(f"{_failure_text(name, i, group_size, kwargs, problems[i])}. {_STOPPED}")
    return RewardFailed(
        f"reward {name!r} failed on a batch of {count} completions ({type(err).__name__}: {err}), though "
        f"it scores each of them alone without error. {_STOPPED}"
    )


def _one_completion(kwargs: dict[str, Any], i: int, count: int) -> dict[str, Any]:
    """The call's arguments cut to completion `i`: every per-completion list, and no logging."""
    alone = {
        key: [value[i]] if isinstance(value, (list, tuple)) and len(value) == count else value
        for key, value in kwargs.items()
    }
    # The probe's values must not reach the completions table or the metrics.
    alone.update(log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None)
    return alone


_STOPPED = "The run stopped before the policy update of this batch (no reward was replaced by 0 or NaN)"


def _failure_text(name: str, i: int, group_size: int, kwargs: dict[str, Any], what: str) -> str:
    """Which reward failed on which completion of which prompt, and how."""
    prompts, completions = kwargs.get("prompts"), kwargs["completions"]
    prompt = _cut(_prompt_text(prompts[i])) if prompts is not None and i < len(prompts) else "?"
    return (
        f"reward {name!r} failed on completion {i} of the batch (prompt {i // group_size} of the batch, "
        f"{group_size} completions per prompt; prompt {prompt}, completion {_cut(completion_text(completions[i]))}): "
        f"{what}"
    )


def skip_failed_groups(rewards_per_func: torch.Tensor, group_size: int) -> torch.Tensor:
    """TRL's rewards (completions x functions, the whole batch) with every row of a group in which
    some reward failed set to NaN: TRL gives rows without any reward no advantage and leaves them
    out of the group baseline, so the group teaches nothing (train.rl.on_reward_error: skip_group)."""
    failed = torch.isnan(rewards_per_func).any(dim=1).view(-1, group_size).any(dim=1)
    rows = failed.repeat_interleave(group_size)
    skipped = rewards_per_func.clone()
    skipped[rows] = torch.nan
    return skipped


def _prompt_text(prompt: Any) -> str:
    """The part of a prompt that tells rows apart: its last message (system prompts repeat)."""
    if isinstance(prompt, str):
        return prompt
    return content_text(prompt[-1].get("content")) if prompt else ""


def _cut(text: str) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= _CUT else flat[: _CUT - 1] + "…")
