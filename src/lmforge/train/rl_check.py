"""`lmforge rl check CONFIG`: whether an online-RL run (train.stage grpo / rloo) can learn, before
any update.

On a sample of the run's prompts, with the run's model, tokenizer, chat template, generation
settings and rewards:

- the group signal: `group_size` completions per prompt, scored by the rewards; the reward
  distribution and the share of groups whose rewards are all equal (GRPO / RLOO learn nothing
  from such a group); each reward's score of the reference answer itself, flagged when a
  sampled completion scored higher (the reward does not recognise a right answer);
- the template round trip: each prompt rendered by the chat template and tokenized as TRL does
  equals the rendered text tokenized again; the assistant's end-of-turn token is a stop token
  of generation; the completion tokens alone carry loss (shown like `prepare --show`);
- train / rollout agreement: the log-probabilities of the sampled tokens as generation computed
  them against the trainer's forward over the same tokens (temperature applied, as TRL does),
  per completion position.

Generation is transformers' `generate` with TRL's settings (do_sample, temperature, top_p,
top_k, min_p, repetition_penalty, the tokenizer's EOS as stop). A check fails (exit 1) when no
group has a signal, the template round trip breaks, the end of turn does not stop generation,
or the log-probabilities disagree by more than LOGPROB_TOLERANCE (of the model's dtype).
"""

from __future__ import annotations

import copy
import logging
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase, set_seed

from lmforge.config.schema import LmforgeConfig
from lmforge.config.stages import stage_spec
from lmforge.errors import UserInputError
from lmforge.run_layout import RunPaths
from lmforge.train.reward_sources import completion_text
from lmforge.train.rewards import REFERENCE_COLUMN, RewardFailed, RewardSet
from lmforge.train.rl_stage import build_rl_rewards

# nats; transformers' generate and a forward agree to ~1e-6 in fp32. In bf16 / fp16 the cached and
# the full forward round differently: about 1e-2 on log-probs near -5.
LOGPROB_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
LOGPROB_TOLERANCE_16_BIT = 0.1
ZERO_STD = 1e-8  # a group whose rewards spread less than this has no signal
START_PROMPTS = 4  # prompts checked at the start of a run (train.rl.check_at_start)

log = logging.getLogger(__name__)


@dataclass
class Check:
    """One check's verdict: passed, failed (exit 1) or a warning, a line saying why, its figures."""

    name: str
    status: str  # "pass" | "fail" | "warn"
    summary: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class RlCheckReport:
    checks: list[Check]
    seconds: float
    example: dict[str, Any]  # one prompt + completion with the tokens that carry loss

    @property
    def failed(self) -> bool:
        return any(check.status == "fail" for check in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": not self.failed,
            "seconds": round(self.seconds, 2),
            "checks": [asdict(check) for check in self.checks],
            "example": self.example,
        }


def run_rl_check(cfg: LmforgeConfig, *, prompts: int = 8) -> RlCheckReport:
    """Every check on the first `prompts` prompts of the run's training data."""
    if not stage_spec(cfg.train.stage).online_rl:
        raise UserInputError(
            f"train.stage: rl check is for online RL (grpo, rloo); this config's stage is {cfg.train.stage}"
        )
    started = time.perf_counter()
    from lmforge.upstream import route_deepspeed_logs

    # Upstream notices (deprecations, DeepSpeed's CPU accelerator line) go through logging, where
    # the command's console filter keeps the ones without an action off the screen.
    route_deepspeed_logs()
    logging.captureWarnings(True)
    try:
        return _run_rl_check(cfg, prompts, started)
    finally:
        logging.captureWarnings(False)


def _run_rl_check(cfg: LmforgeConfig, prompts: int, started: float) -> RlCheckReport:
    from lmforge.data.run_data import prepare_data_for_run
    from lmforge.models.build import build_model

    set_seed(cfg.run.seed)
    with tempfile.TemporaryDirectory(prefix="lmforge-rl-check-") as scratch:
        tokenizer, data = prepare_data_for_run(
            cfg, RunPaths(Path(scratch)), write_report=False, for_training=False
        )
        model = build_model(cfg.model, tokenizer, max_length=cfg.data.max_length)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()  # type: ignore[arg-type]
    rows = [data.train[i] for i in range(min(prompts, len(data.train)))]  # type: ignore[arg-type]
    rewards = build_rl_rewards(cfg.train, data.train, tokenizer)
    with tempfile.TemporaryDirectory(prefix="lmforge-rl-check-") as scratch:
        trainer = (
            _episode_trainer(cfg, model, tokenizer, rewards, rows, scratch) if cfg.train.rl.tools else None
        )
        checks, groups = _checks(cfg, model, tokenizer, rewards, rows, trainer)
    return RlCheckReport(checks, time.perf_counter() - started, loss_example(tokenizer, groups))


def _episode_trainer(
    cfg: LmforgeConfig,
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    rewards: RewardSet,
    rows: list[dict[str, Any]],
    scratch: str,
) -> Any:
    """The run's TRL trainer (its tools, response template, generation and tool loop), built to
    roll out the check's tool-use episodes; it never trains."""
    from datasets import Dataset

    from lmforge.train.stages.online_rl import online_rl_stage

    stage = online_rl_stage(cfg.train, rewards, tokenizer, use_vllm=False)
    values = {
        **stage.values,
        "output_dir": scratch,
        "report_to": "none",
        "per_device_train_batch_size": cfg.train.rl.group_size,
        "use_cpu": not torch.cuda.is_available(),
    }
    return stage.trainer(
        model=model,
        args=stage.config(**values),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        **stage.extra,
    )


def warn_before_updates(
    cfg: LmforgeConfig,
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    rewards: RewardSet,
    dataset: Any,
    trainer: Any = None,
) -> list[Check]:
    """The checks on the run's first START_PROMPTS prompts with the model and reward functions as
    training starts (the trainer's own: a reward model is not loaded twice), each one that does not
    pass logged as a warning. The random state is restored afterwards, so the run trains exactly as
    it would without the check."""
    rows = [dataset[i] for i in range(min(START_PROMPTS, len(dataset)))]
    devices = [model.device.index or 0] if model.device.type == "cuda" else []
    was_training = model.training
    with torch.random.fork_rng(devices=devices):
        model.eval()
        try:
            checks = _checks(cfg, model, tokenizer, rewards, rows, trainer)[0]
        finally:
            model.train(was_training)
    for check in checks:
        if check.status != "pass":
            log.warning("rl check (%s, %s): %s", check.name, check.status, check.summary)
    return checks


def _checks(
    cfg: LmforgeConfig,
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    rewards: RewardSet,
    rows: list[dict[str, Any]],
    trainer: Any = None,
) -> tuple[list[Check], list[Group]]:
    """Every check on `rows`, and the sampled groups (for the loss-mask example). With tools, the
    groups are whole episodes rolled out by `trainer` (TRL's tool loop); the log-probability check
    samples first turns, which the same model generates in the same way."""
    tools = _tool_functions(trainer)
    stops = stop_ids(model, tokenizer)
    checks = [template_round_trip(tokenizer, rows, tools), stop_tokens(tokenizer, stops)]
    groups = sample_groups(model, tokenizer, rows, cfg, tools)
    checks.append(agreement(model, groups, cfg.train.rl.temperature))
    if cfg.train.rl.tools is not None and trainer is not None:
        groups = tool_episodes(trainer, rows, cfg.train.rl.group_size)
        checks.append(episode_masks(tokenizer, groups, tools))
    checks += reward_checks(cfg, rewards, tokenizer, groups)
    return checks, groups


def _tool_functions(trainer: Any) -> list[Any] | None:
    """The tools the trainer renders into its prompts (TRL's GRPOTrainer.tools), or None."""
    return list(getattr(trainer, "tools", None) or []) or None


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: Any, tools: list[Any] | None = None) -> list[int]:
    """The prompt's ids as TRL's GRPOTrainer makes them (the chat template, generation prompt on,
    the tools' schemas in it)."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    rendered: Any = tokenizer.apply_chat_template(
        prompt, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(rendered["input_ids"])


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Any,
    *,
    generation_prompt: bool,
    tools: list[Any] | None = None,
) -> str:
    return str(
        tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )
    )


def template_round_trip(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]], tools: list[Any] | None = None
) -> Check:
    """Each prompt's ids equal its rendered text tokenized again (no special token split or merged
    at the seams), and the text ends with the template's generation prompt."""
    broken = []
    for number, row in enumerate(rows):
        prompt = row["prompt"]
        if isinstance(prompt, str):
            continue
        text = _render(tokenizer, prompt, generation_prompt=True, tools=tools)
        bare = _render(tokenizer, prompt, generation_prompt=False, tools=tools)
        again = tokenizer(text, add_special_tokens=False)["input_ids"]
        if _prompt_ids(tokenizer, prompt, tools) != list(again) or not text.startswith(bare) or text == bare:
            broken.append(number)
    if broken:
        return Check(
            "template",
            "fail",
            f"prompts {broken} do not survive render -> tokenize -> render: the chat template and the tokenizer "
            "disagree (a special token split, or no generation prompt); fix tokenizer.chat_template",
            {"broken_prompts": broken},
        )
    return Check("template", "pass", f"{len(rows)} prompts render and re-tokenize identically", {})


def stop_tokens(tokenizer: PreTrainedTokenizerBase, stops: list[int]) -> Check:
    """The token the template closes an assistant turn with must stop generation (TRL stops at the
    tokenizer's EOS and the model's generation-config EOS ids): otherwise every completion runs to
    max_completion_length."""
    probe = "The answer is 42."
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": probe}]
    text = _render(tokenizer, messages, generation_prompt=False)
    after = text[text.rindex(probe) + len(probe) :]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    end = next((i for i in ids if i in tokenizer.all_special_ids), None)
    figures = {
        "end_of_turn": tokenizer.convert_ids_to_tokens(end) if end is not None else None,
        "stops": tokenizer.convert_ids_to_tokens(stops),
    }
    if end is None:
        return Check("stop", "warn", "the template closes an assistant turn with no special token", figures)
    if end not in stops:
        return Check(
            "stop",
            "fail",
            f"the template ends an assistant turn with {figures['end_of_turn']!r} but generation stops only at "
            f"{figures['stops']}: completions will not end; add it to the model's generation_config.eos_token_id "
            "(or make it the tokenizer's eos_token)",
            figures,
        )
    return Check(
        "stop", "pass", f"the end of an assistant turn ({figures['end_of_turn']!r}) stops generation", figures
    )


def stop_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids generation stops at, as TRL's GRPOTrainer collects them: the model's generation
    config's EOS ids, with the tokenizer's EOS first when missing."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


@dataclass
class Group:
    """One prompt's sampled completions: ids, the generation's log-probabilities, decoded text."""

    row: dict[str, Any]
    prompt_ids: list[int]
    completions: list[list[int]]  # up to and including EOS
    logprobs: list[list[float]]  # of each completion token, as generation computed them
    texts: list[str]
    # A tool-use episode's turns (the model's messages and the tool results, as the rewards get
    # them) and which completion tokens carry the loss (TRL's tool_mask); None for one turn.
    episodes: list[list[dict[str, Any]]] | None = None
    loss_masks: list[list[int]] | None = None


@torch.no_grad()
def sample_groups(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    cfg: LmforgeConfig,
    tools: list[Any] | None = None,
) -> list[Group]:
    """`group_size` completions per prompt with the run's generation settings (TRL's)."""
    rl = cfg.train.rl
    device = next(model.parameters()).device
    settings = {
        "do_sample": True,
        "max_new_tokens": rl.max_completion_length,
        "temperature": rl.temperature,
        "top_p": rl.top_p,
        "top_k": rl.top_k,
        "min_p": rl.min_p,
        "repetition_penalty": rl.repetition_penalty,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": stop_ids(model, tokenizer),
    }
    stops = set(settings["eos_token_id"])
    groups = []
    for row in rows:
        prompt_ids = _prompt_ids(tokenizer, row["prompt"], tools)
        inputs = torch.tensor([prompt_ids] * rl.group_size, device=device)
        out = model.generate(
            input_ids=inputs,
            attention_mask=torch.ones_like(inputs),
            output_logits=True,
            return_dict_in_generate=True,
            **settings,
        )
        new = out.sequences[:, len(prompt_ids) :]
        # The raw logits at temperature: the distribution the trainer's forward computes (TRL
        # divides its logits by the temperature too); top-k / top-p only cut where it samples.
        logps = torch.stack(out.logits, dim=1).float().div(rl.temperature).log_softmax(-1)
        picked = logps.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        completions, logprobs = [], []
        for ids, lps in zip(new.tolist(), picked.tolist(), strict=True):
            length = next((i + 1 for i, token in enumerate(ids) if token in stops), len(ids))
            completions.append(ids[:length])
            logprobs.append(lps[:length])
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        groups.append(Group(row, prompt_ids, completions, logprobs, texts))
    return groups


def tool_episodes(trainer: Any, rows: list[dict[str, Any]], group_size: int) -> list[Group]:
    """`group_size` tool-use episodes per prompt, rolled out by TRL's GRPOTrainer itself: its
    generation, tool calls, tool results and the tool_mask its loss applies. What the trainer logs
    and counts while doing so is put back: the check leaves no trace in a run's metrics."""
    saved = _trainer_logs(trainer)
    groups = []
    try:
        for row in rows:
            out = trainer._generate_and_score_completions([row] * group_size)
            episodes = [list(turns) for turns in list(trainer._logs["completion"])[-group_size:]]
            groups.append(_episode_group(row, out, episodes))
    finally:
        _restore_trainer_logs(trainer, saved)
    return groups


def _episode_group(row: dict[str, Any], out: dict[str, Any], episodes: list[list[dict[str, Any]]]) -> Group:
    prompt_ids = out["prompt_ids"][0][out["prompt_mask"][0].bool()].tolist()
    completions, masks = [], []
    tool_mask = out.get("tool_mask")
    for i in range(len(episodes)):
        length = int(out["completion_mask"][i].sum())
        completions.append(out["completion_ids"][i][:length].tolist())
        mask = tool_mask[i][:length] if tool_mask is not None else torch.ones(length)
        masks.append([int(m) for m in mask.tolist()])
    texts = [completion_text(turns) for turns in episodes]
    return Group(row, prompt_ids, completions, [], texts, episodes=episodes, loss_masks=masks)


def _trainer_logs(trainer: Any) -> dict[str, Any]:
    return {
        "metrics": {
            mode: {k: list(v) for k, v in values.items()} for mode, values in trainer._metrics.items()
        },
        "logs": {
            k: (copy.copy(v) if not isinstance(v, dict) else {n: copy.copy(d) for n, d in v.items()})
            for k, v in trainer._logs.items()
        },
    }


def _restore_trainer_logs(trainer: Any, saved: dict[str, Any]) -> None:
    for mode, values in trainer._metrics.items():
        values.clear()
        values.update(saved["metrics"][mode])
    for key, value in saved["logs"].items():
        target = trainer._logs[key]
        target.clear()
        if isinstance(value, dict):
            target.update(value)
        else:
            target.extend(value)


def episode_masks(tokenizer: PreTrainedTokenizerBase, groups: list[Group], tools: list[Any] | None) -> Check:
    """Only the model's own tokens carry the loss in a tool-use episode: TRL's tool_mask over each
    finished episode against the chat template's own assistant mask (its {% generation %} markers,
    what SFT trains on) over the same conversation rendered whole. A tool result with loss would
    teach the model to write the tool's answers; a turn of its own without loss, to learn nothing
    from it. Compared character by character (whitespace aside): the rollout tokenizes its pieces
    one by one, the template the whole text, and a BPE may cut the seams differently."""
    compared = tool_tokens = disagree = unfinished = 0
    example: str | None = None
    for group in groups:
        for ids, mask, turns in zip(
            group.completions, group.loss_masks or [], group.episodes or [], strict=True
        ):
            messages = [*group.row["prompt"], *turns]
            prompt = _render(tokenizer, group.row["prompt"], generation_prompt=True, tools=tools)
            whole = _render(tokenizer, messages, generation_prompt=False, tools=tools)
            rollout_text, rollout = _characters_with_loss(tokenizer, ids, mask)
            marked = _template_characters_with_loss(tokenizer, whole, messages, tools)
            if marked is None or not whole.startswith(prompt) or whole[len(prompt) :] != rollout_text:
                unfinished += 1  # cut at max_completion_length: the template would close the turn
                continue
            template = marked[len(prompt) :]
            compared += 1
            tool_tokens += mask.count(0)
            wrong = [
                i
                for i, (a, b) in enumerate(zip(rollout, template, strict=True))
                if a != b and not rollout_text[i].isspace()
            ]
            if wrong:
                disagree += 1
                example = example or "".join(rollout_text[i] for i in wrong[:80])
    figures = {
        "episodes": compared,
        "not_compared": unfinished,
        "masked_tokens": tool_tokens,
        "disagree": disagree,
    }
    if disagree:
        return Check(
            "episode_mask",
            "fail",
            f"in {disagree} of {compared} tool-use episodes the text that carries loss is not the model's own "
            f"turns (e.g. {example!r}): the chat template's tool format and TRL's tool loop disagree; use a "
            "catalogue tool template (data.chat_template)",
            figures,
        )
    if not compared:
        return Check(
            "episode_mask",
            "warn",
            f"no finished episode to compare ({unfinished} cut at train.rl.max_completion_length): raise "
            "max_completion_length or sample more prompts",
            figures,
        )
    return Check(
        "episode_mask",
        "pass",
        f"{compared} tool-use episodes: the loss falls on the model's turns only ({tool_tokens} tool-result and "
        "template tokens masked), as the chat template marks them",
        figures,
    )


@torch.no_grad()
def agreement(model: Any, groups: list[Group], temperature: float) -> Check:
    """Generation's log-probabilities of the sampled tokens against one forward over prompt +
    completion (what the trainer computes): max and mean absolute difference, and the largest
    difference at each completion position."""
    device = next(model.parameters()).device
    by_position: dict[int, float] = {}
    differences: list[float] = []
    for group in groups:
        for ids, generated in zip(group.completions, group.logprobs, strict=True):
            if not ids:
                continue
            sequence = torch.tensor([group.prompt_ids + ids], device=device)
            logits = model(input_ids=sequence).logits[0, len(group.prompt_ids) - 1 : -1]
            forward = (
                logits.float()
                .div(temperature)
                .log_softmax(-1)
                .gather(-1, sequence[0, len(group.prompt_ids) :, None])
            )
            for position, (a, b) in enumerate(zip(forward.squeeze(-1).tolist(), generated, strict=True)):
                gap = abs(a - b)
                differences.append(gap)
                by_position[position] = max(by_position.get(position, 0.0), gap)
    figures: dict[str, Any] = {
        "engine": "transformers",
        "tokens": len(differences),
        "max_abs_diff": max(differences, default=0.0),
        "mean_abs_diff": statistics.fmean(differences) if differences else 0.0,
        "max_abs_diff_by_position": [round(by_position[p], 8) for p in sorted(by_position)],
    }
    line = (
        f"generation vs trainer log-probs over {figures['tokens']} tokens: max |diff| {figures['max_abs_diff']:.2e}, "
        f"mean {figures['mean_abs_diff']:.2e} (transformers generation: zero up to float rounding)"
    )
    tolerance = LOGPROB_TOLERANCE.get(next(model.parameters()).dtype, LOGPROB_TOLERANCE_16_BIT)
    figures["tolerance"] = tolerance
    if figures["max_abs_diff"] > tolerance:
        return Check("agreement", "fail", line + f"; over the tolerance {tolerance:g}", figures)
    return Check("agreement", "pass", line, figures)


def reward_checks(
    cfg: LmforgeConfig, rewards: RewardSet, tokenizer: PreTrainedTokenizerBase, groups: list[Group]
) -> list[Check]:
    """The group signal and each reward's score of the reference answers."""
    group_size = cfg.train.rl.group_size
    names = [function.__name__ for function in rewards.functions]
    totals: list[list[float]] = []
    best: dict[str, float] = {}
    try:
        for group in groups:
            scores = [
                _score(f, group, group.completions, group.texts, group_size, group.episodes)
                for f in rewards.functions
            ]
            for name, values in zip(names, scores, strict=True):
                best[name] = max([best.get(name, float("-inf")), *values])
            totals.append(
                [
                    sum(w * s[i] for w, s in zip(rewards.weights, scores, strict=True))
                    for i in range(len(group.texts))
                ]
            )
        reference = _reference_scores(rewards, names, groups, tokenizer)
    except RewardFailed as failure:
        return [Check("rewards", "fail", str(failure), {})]
    return [_group_signal(totals, cfg), _reference_check(reference, best)]


def _score(
    function: Any,
    group: Group,
    ids: list[list[int]],
    texts: list[str],
    group_size: int,
    episodes: list[list[dict[str, Any]]] | None = None,
) -> list[float]:
    """TRL's call of a reward function on one group's completions (a tool-use episode's turns)."""
    count = len(texts)
    prompt = group.row["prompt"]
    conversational = not isinstance(prompt, str)
    completions: list[Any] = (
        [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    )
    if episodes is not None:
        completions = episodes
    extra = {k: [v] * count for k, v in group.row.items() if k != "prompt"}
    values = function(
        prompts=[prompt] * count,
        completions=completions,
        completion_ids=ids,
        trainer_state=None,
        log_extra=lambda *a, **k: None,
        log_metric=lambda *a, **k: None,
        **extra,
    )
    return [float(v) if v is not None else float("nan") for v in values]


def _reference_scores(
    rewards: RewardSet, names: list[str], groups: list[Group], tokenizer: PreTrainedTokenizerBase
) -> dict[str, list[float]]:
    """Each reward's score of each prompt's reference answer, given as the completion."""
    scores: dict[str, list[float]] = {name: [] for name in names}
    for group in groups:
        answer = group.row.get(REFERENCE_COLUMN)
        if answer is None:
            continue
        ids = [tokenizer(str(answer), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
        for name, function in zip(names, rewards.functions, strict=True):
            scores[name] += _score(function, group, ids, [str(answer)], 1)
    return scores


def _group_signal(totals: list[list[float]], cfg: LmforgeConfig) -> Check:
    flat = [value for group in totals for value in group]
    flat_groups = [i for i, group in enumerate(totals) if max(group) - min(group) < ZERO_STD]
    share = len(flat_groups) / max(len(totals), 1)
    counts = Counter(f"{value:g}" for value in flat)
    figures = {
        "prompts": len(totals),
        "group_size": cfg.train.rl.group_size,
        "reward_mean": statistics.fmean(flat) if flat else 0.0,
        "reward_min": min(flat, default=0.0),
        "reward_max": max(flat, default=0.0),
        "reward_counts": dict(sorted(counts.items(), key=lambda kv: float(kv[0]))),
        "zero_variance_groups": share,
    }
    line = (
        f"{len(totals)} prompts x {cfg.train.rl.group_size} completions: mean reward {figures['reward_mean']:.3g} "
        f"(min {figures['reward_min']:g}, max {figures['reward_max']:g}); {share:.0%} of the groups have zero "
        "reward variance"
    )
    if totals and share == 1.0:
        return Check(
            "group_signal",
            "fail",
            line
            + ": no group can teach anything (every advantage is 0). Levers: a higher train.rl.temperature, "
            "a larger train.rl.group_size, a denser reward (partial credit, a format reward), or more SFT first "
            "so that some completions succeed",
            figures,
        )
    status = "warn" if share > 0.5 else "pass"
    return Check("group_signal", status, line, figures)


def _reference_check(reference: dict[str, list[float]], best: dict[str, float]) -> Check:
    figures = {
        name: {
            "reference_mean": statistics.fmean(values),
            "reference_min": min(values),
            "best_sampled": best[name],
        }
        for name, values in reference.items()
        if values
    }
    below = [name for name, f in figures.items() if f["reference_min"] < f["best_sampled"]]
    if not figures:
        return Check("reference", "warn", "the data has no reference answers to score", {})
    if below:
        return Check(
            "reference",
            "warn",
            f"reward(s) {below} give some reference answer less than a sampled completion got: such a reward "
            "may not recognise a right answer (check its pattern or its scale)",
            figures,
        )
    return Check("reference", "pass", "every reward gives the reference answers its top score", figures)


def _characters_with_loss(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], mask: list[int]
) -> tuple[str, list[int]]:
    """The decoded completion and, per character, whether its token carries loss. Decoded a prefix
    at a time: a byte-level token may hold part of a character."""
    text, flags = "", []
    for end in range(1, len(ids) + 1):
        decoded = str(tokenizer.decode(ids[:end]))
        flags += [mask[end - 1]] * (len(decoded) - len(text))
        text = decoded
    return text, flags


def _template_characters_with_loss(
    tokenizer: PreTrainedTokenizerBase, text: str, messages: list[dict[str, Any]], tools: list[Any] | None
) -> list[int] | None:
    """Per character of the rendered conversation, whether the chat template marks it as the
    assistant's (the token mask it gives SFT, spread over each token's characters)."""
    rendered: Any = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    flags = [0] * len(text)
    if len(offsets) != len(rendered["assistant_masks"]):
        return None  # the template tokenized another text than it rendered: nothing to compare
    for (start, end), flag in zip(offsets, rendered["assistant_masks"], strict=True):
        flags[start:end] = [flag] * (end - start)
    return flags


def loss_example(tokenizer: PreTrainedTokenizerBase, groups: list[Group]) -> dict[str, Any]:
    """One prompt and completion as (text, carries loss) runs: the completion's tokens carry the
    policy loss, the prompt's none, and in a tool-use episode the tool results none (TRL's tool_mask)."""
    if not groups or not groups[0].completions:
        return {}
    from lmforge.data.run_data import supervised_runs

    group = next((g for g in groups if g.loss_masks and any(0 in m for m in g.loss_masks)), groups[0])
    pick = _example_index(group)
    completion = group.completions[pick]
    mask = group.loss_masks[pick] if group.loss_masks is not None else [1] * len(completion)
    ids = group.prompt_ids + completion
    labels = [-100] * len(group.prompt_ids) + [
        t if m else -100 for t, m in zip(completion, mask, strict=True)
    ]
    return {
        "runs": supervised_runs(tokenizer, ids, labels),
        "tokens": len(ids),
        "with_loss": sum(mask),
    }


def _example_index(group: Group) -> int:
    """The first episode that called a tool (the mask worth seeing), else the first completion."""
    masks = group.loss_masks or []
    return next((i for i, mask in enumerate(masks) if 0 in mask), 0)
