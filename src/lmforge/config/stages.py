"""One `StageSpec` per `train.stage`: the facts about a stage that the rest of lmforge decides by.

Config rules, data preparation, the layout checks, the guardrails, the reports and the trainer
ask a stage's spec what it is (`stage_spec(cfg.train.stage).online_rl`), not which stage it is,
so a new stage is one entry here, its Literal value in config/schema.py and its binding to a
trainer in train/stages/. The trainer and its arguments class are named as "module:Class" import
strings: config is the bottom of the import stack and stays free of transformers and TRL.

Guardrails (monitor/guard.py, monitor/rl_guard.py), and which fit which loss:
- nonfinite: a NaN/inf loss or gradient norm is never a healthy update, whatever the stage.
- spike: a z-score of the loss over a rolling window. It fits a loss that is positive and
  falls smoothly: the next-token loss of pretrain and sft, and the preference losses, which are
  log-sigmoid shaped (DPO, RM and KTO start near ln 2 = 0.69 and descend; ORPO adds an NLL
  term; SimPO and IPO are positive too), so a jump of many sigmas is a divergence there as well.
  It does not fit online RL: GRPO's and RLOO's policy loss is an advantage-weighted ratio whose
  advantages are centred per group, so it sits near zero and changes sign by design; a step of
  2e-5 after a window of 2e-6 is "11 sigma" and yet an ordinary update. Their health is
  judged from the reward and the policy (`monitor.guard.rl`) instead.
- rl: the online-RL signals (reward hacking, entropy collapse, no reward variance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Guardrail = Literal["nonfinite", "spike", "rl"]

# What one training row of the stage is (data/run_data.py, data/preference.py):
# text: raw text packed into blocks; chat: conversations; pairs: preference pairs (prompt,
# chosen, rejected); labelled: KTO's rows (a conversation with a good/bad label, or a preference
# pair read as one good and one bad row); prompts: a prompt with a reference answer (online RL;
# on-policy distillation reads the prompt only: the conversation before its last assistant turn).
DataKind = Literal["text", "chat", "pairs", "labelled", "prompts"]

# Where the frozen copy of the starting model that the loss compares with comes from:
# none: the loss needs none; in_memory: a deep copy handed to the trainer (unless an adapter can be
# switched off, or the loss variant is reference-free); on_disk: TRL loads it from the run's
# reference/ directory, written when the KL term is on (train.rl.beta > 0).
Reference = Literal["none", "in_memory", "on_disk"]

# Online RL's metrics under the names TRL logs them (GRPOTrainer / RLOOTrainer): the total and
# per-function rewards, the share of groups without reward variance, KL to the reference, token
# entropy, completion lengths and clipped shares, and the ratio-clipping fractions.
# A reward model's pairwise figures as TRL's RewardTrainer logs them (train and eval_): the share of
# pairs whose chosen answer scores above the rejected one, the mean score difference, the scores.
RM_METRIC_PREFIXES = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")
# Offline preference optimisation's figures as TRL's DPO / KTO (and ORPO / CPO for train.dpo.loss
# orpo / simpo) trainers log them: the implicit rewards of the chosen and rejected answers (beta times
# the policy's log-probability ratio to the reference), the share of pairs ranked right and the mean
# margin, the answers' summed log-probabilities and mean logits, KTO's KL estimate, ORPO's odds ratio
# and the SFT term's loss. Whether DPO learns is read from rewards/accuracies and rewards/margins.
PREFERENCE_METRIC_PREFIXES = ("rewards/", "logps/", "logits/", "kl", "nll_loss", "log_odds")
# On-policy distillation's own figures as TRL's DistillationTrainer logs them: the student's token entropy
# and its completions' lengths and clipped share.
DISTILL_METRIC_PREFIXES = ("entropy", "completions/")
RL_METRIC_PREFIXES = (
    "reward",
    "rewards/",
    "frac_reward_zero_std",
    "kl",
    "entropy",
    "completions/",
    "clip_ratio",
    "tools/",  # tool-use episodes: calls per completion, the share of calls that failed
)

# The monitor.guard keys of the loss-spike rule (refused for a stage it does not apply to).
SPIKE_KEYS = ("spike", "spike_sigma", "spike_window", "spike_warmup")

_LANGUAGE_MODEL_GUARDRAILS: frozenset[Guardrail] = frozenset({"nonfinite", "spike"})
_ONLINE_RL_GUARDRAILS: frozenset[Guardrail] = frozenset({"nonfinite", "rl"})


@dataclass(frozen=True)
class StageSpec:
    """What a training stage is, in the terms the code decides by."""

    name: str
    data_kind: DataKind
    # A token-level next-token loss over the labels (pretrain, sft): what the chunked loss, the
    # context-parallel split and the pipeline step compute; the other stages compute their own.
    language_model_loss: bool
    # Generates completions and learns from their rewards while it trains (TRL's RL trainers).
    online_rl: bool
    reference: Reference
    head: Literal["causal", "score"]  # score: one number per sequence (a reward model)
    guardrails: frozenset[Guardrail]
    metric_prefixes: tuple[str, ...]  # the stage's own metrics kept from the trainer's logs
    # The monitor's eval generations fit: the model generates, and its eval rows are text to
    # continue (online RL logs its own completions and rewards instead, train/rl_samples.py).
    eval_generations: bool
    # Its eval rows end in an answer that `lmforge eval` can score generations against.
    eval_rows_answer: bool
    trainer: str  # "module:Class" of the trainer, resolved by train/stages/
    arguments: str  # "module:Class" of its TrainingArguments subclass
    # Its trainer runs multi-turn tool-use episodes (train.rl.tools): TRL's GRPOTrainer has the tool loop.
    tool_rollouts: bool = False
    # Its loss compares the model with a second, frozen model loaded from train.distill.teacher (not a
    # copy of the starting model, so `reference` stays none): on-policy distillation.
    teacher: bool = False

    @property
    def offline_preference(self) -> bool:
        """Learns from preference data prepared before training (dpo, kto, rm)."""
        return self.data_kind in ("pairs", "labelled")

    @property
    def on_policy(self) -> bool:
        """Generates its completions from prompt rows while it trains (online RL, on-policy
        distillation): a micro-batch is rows the trainer turns into tokens, with shapes that change
        from step to step, not a batch of token ids lmforge prepared."""
        return self.data_kind == "prompts"


def _language_model(name: str, data_kind: DataKind, *, eval_rows_answer: bool) -> StageSpec:
    return StageSpec(
        name,
        data_kind,
        language_model_loss=True,
        online_rl=False,
        reference="none",
        head="causal",
        guardrails=_LANGUAGE_MODEL_GUARDRAILS,
        metric_prefixes=(),
        eval_generations=True,
        eval_rows_answer=eval_rows_answer,
        trainer="transformers:Trainer",
        arguments="transformers:TrainingArguments",
    )


def _preference(
    name: str,
    data_kind: DataKind,
    reference: Reference,
    trainer: str,
    arguments: str,
    *,
    head: Literal["causal", "score"] = "causal",
    metric_prefixes: tuple[str, ...] = (),
) -> StageSpec:
    generates = head == "causal"
    return StageSpec(
        name,
        data_kind,
        language_model_loss=False,
        online_rl=False,
        reference=reference,
        head=head,
        guardrails=_LANGUAGE_MODEL_GUARDRAILS,  # log-sigmoid shaped losses: see the module docstring
        metric_prefixes=metric_prefixes,
        eval_generations=generates,
        eval_rows_answer=generates,
        trainer=trainer,
        arguments=arguments,
    )


def _online_rl(name: str, trainer: str, arguments: str, *, tool_rollouts: bool = False) -> StageSpec:
    return StageSpec(
        name,
        "prompts",
        language_model_loss=False,
        online_rl=True,
        reference="on_disk",
        head="causal",
        guardrails=_ONLINE_RL_GUARDRAILS,
        metric_prefixes=RL_METRIC_PREFIXES,
        eval_generations=False,
        eval_rows_answer=False,
        trainer=trainer,
        arguments=arguments,
        tool_rollouts=tool_rollouts,
    )


def _distillation(name: str, trainer: str, arguments: str) -> StageSpec:
    return StageSpec(
        name,
        "prompts",
        language_model_loss=False,
        online_rl=False,
        reference="none",
        head="causal",
        # The loss is a divergence from the teacher on the student's own samples: positive, and it
        # falls as the student comes closer, so a jump of many sigmas is a divergence as for sft.
        guardrails=_LANGUAGE_MODEL_GUARDRAILS,
        metric_prefixes=DISTILL_METRIC_PREFIXES,
        eval_generations=True,
        eval_rows_answer=False,  # the rows' last assistant turns are not what the student is taught
        trainer=trainer,
        arguments=arguments,
        teacher=True,
    )


# Every value of train.stage (config/schema.py's TrainConfig.stage), in the order the docs list them.
STAGE_SPECS: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        _language_model("pretrain", "text", eval_rows_answer=False),
        _language_model("sft", "chat", eval_rows_answer=True),
        # dpo's default class; train.dpo.loss orpo / simpo select TRL's ORPO / CPO trainers and
        # run without a reference (train/stages/preference.py).
        _preference(
            "dpo",
            "pairs",
            "in_memory",
            "trl:DPOTrainer",
            "trl:DPOConfig",
            metric_prefixes=PREFERENCE_METRIC_PREFIXES,
        ),
        _preference(
            "kto",
            "labelled",
            "in_memory",
            "trl:KTOTrainer",
            "trl:KTOConfig",
            metric_prefixes=PREFERENCE_METRIC_PREFIXES,
        ),
        _preference(
            "rm",
            "pairs",
            "none",
            "trl:RewardTrainer",
            "trl:RewardConfig",
            head="score",
            metric_prefixes=RM_METRIC_PREFIXES,
        ),
        _online_rl("grpo", "trl:GRPOTrainer", "trl:GRPOConfig", tool_rollouts=True),
        _online_rl("rloo", "trl:RLOOTrainer", "trl:RLOOConfig"),
        # TRL's maintained on-policy distillation trainer (GKDTrainer, in trl.experimental, defers to it).
        _distillation("distill", "trl:DistillationTrainer", "trl:DistillationConfig"),
    )
}

# The guardrails of each stage, by name (tests and docs read the table whole).
STAGE_GUARDRAILS: dict[str, frozenset[Guardrail]] = {
    name: spec.guardrails for name, spec in STAGE_SPECS.items()
}


def stage_spec(stage: str) -> StageSpec:
    """The spec of `stage`, a value of train.stage."""
    return STAGE_SPECS[stage]


def stage_guardrails(stage: str) -> frozenset[Guardrail]:
    """The guardrails that judge `stage`'s steps."""
    return STAGE_SPECS[stage].guardrails
