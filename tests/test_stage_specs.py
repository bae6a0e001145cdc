"""One StageSpec per train.stage (config/stages.py), bound to its trainer in train/stages/, and
no stage decided by comparing its name anywhere else. Fast: imports TRL, trains nothing."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, get_args

import pytest
from transformers import Trainer, TrainingArguments

from lmforge.config import LmforgeConfig
from lmforge.config.schema import DpoConfig, TrainConfig
from lmforge.config.stages import (
    DISTILL_METRIC_PREFIXES,
    PREFERENCE_METRIC_PREFIXES,
    RL_METRIC_PREFIXES,
    RM_METRIC_PREFIXES,
    STAGE_SPECS,
    stage_spec,
)
from lmforge.train.rewards import RewardSet
from lmforge.train.stages.binding import resolve_class
from lmforge.train.stages.online_rl import online_rl_stage
from lmforge.train.stages.preference import PREFERENCE_STAGES

SOURCE = Path(__file__).resolve().parents[1] / "src" / "lmforge"
# The spec table and the modules that bind each spec to its trainer may name stages.
SPEC_MODULES = {SOURCE / "config" / "stages.py", *(SOURCE / "train" / "stages").glob("*.py")}
MAX_STAGE_COMPARISONS = 10
STAGES = get_args(TrainConfig.model_fields["stage"].annotation)


def config(stage: str, **train: Any) -> LmforgeConfig:
    """A config of `stage` for binding only (no files are read)."""
    return LmforgeConfig.model_validate(
        {
            "model": {"path": "model"},
            "data": {"train": [{"path": "rows.jsonl"}]},
            "train": {"stage": stage, "micro_batch_size": 2, **train},
        }
    )


def test_every_stage_of_the_schema_has_a_spec() -> None:
    assert list(STAGE_SPECS) == list(STAGES)
    assert all(stage_spec(name).name == name for name in STAGES)


@pytest.mark.parametrize("stage", STAGES)
def test_a_spec_names_a_trainer_and_its_arguments_class(stage: str) -> None:
    spec = stage_spec(stage)
    assert issubclass(resolve_class(spec.trainer), Trainer)
    assert issubclass(resolve_class(spec.arguments), TrainingArguments)


def test_the_spec_table_agrees_with_what_each_stage_is() -> None:
    """Online RL never gets the loss-spike rule and always the RL guard and its metrics; only the
    language-model stages have a token-level next-token loss; only rm has a score head (and its
    pairwise metrics); the preference stages with a reference (dpo, kto) keep TRL's implicit rewards;
    the on-policy stages (online RL, distillation) read prompts, and only
    distillation loads a teacher (and logs TRL's distillation metrics)."""
    for spec in STAGE_SPECS.values():
        assert "nonfinite" in spec.guardrails
        assert ("spike" in spec.guardrails) is not spec.online_rl
        assert ("rl" in spec.guardrails) is spec.online_rl
        own = (
            RL_METRIC_PREFIXES
            if spec.online_rl
            else RM_METRIC_PREFIXES
            if spec.head == "score"
            else DISTILL_METRIC_PREFIXES
            if spec.teacher
            else PREFERENCE_METRIC_PREFIXES
            if spec.reference == "in_memory"
            else ()
        )
        assert spec.metric_prefixes == own
        assert spec.language_model_loss is (spec.data_kind in ("text", "chat"))
        assert spec.online_rl is (spec.reference == "on_disk")
        assert spec.on_policy is (spec.data_kind == "prompts") is (spec.online_rl or spec.teacher)
        assert not (spec.teacher and (spec.online_rl or spec.reference != "none"))
        assert not (spec.eval_generations and spec.online_rl)
    assert [s.name for s in STAGE_SPECS.values() if s.head == "score"] == ["rm"]
    assert [s.name for s in STAGE_SPECS.values() if s.language_model_loss] == ["pretrain", "sft"]
    assert [s.name for s in STAGE_SPECS.values() if s.reference == "in_memory"] == ["dpo", "kto"]
    assert [s.name for s in STAGE_SPECS.values() if s.teacher] == ["distill"]


def test_every_preference_stage_is_bound_to_its_spec_trainer() -> None:
    preference = [s.name for s in STAGE_SPECS.values() if s.offline_preference]
    assert sorted(PREFERENCE_STAGES) == sorted(preference)
    for name in preference:
        spec, bound = stage_spec(name), PREFERENCE_STAGES[name](config(name))
        assert f"{bound.trainer.__module__.split('.')[0]}:{bound.trainer.__name__}" == spec.trainer
        assert bound.takes_reference is (spec.reference == "in_memory")


@pytest.mark.parametrize("loss", get_args(DpoConfig.model_fields["loss"].annotation))
def test_dpo_losses_bind_a_trl_trainer(loss: str) -> None:
    """orpo and simpo run TRL's reference-free ORPO / CPO trainers, the others DPOTrainer."""
    bound = PREFERENCE_STAGES["dpo"](config("dpo", dpo={"loss": loss}))
    assert issubclass(bound.trainer, Trainer) and issubclass(bound.config, TrainingArguments)
    assert bound.takes_reference is (loss not in ("orpo", "simpo"))


@pytest.mark.parametrize("stage", [s.name for s in STAGE_SPECS.values() if s.online_rl])
def test_online_rl_stages_bind_their_spec_trainer(stage: str) -> None:
    rewards = RewardSet(functions=[], weights=[])
    bound = online_rl_stage(config(stage).train, rewards, None, use_vllm=False)  # type: ignore[arg-type]
    assert bound.trainer is resolve_class(stage_spec(stage).trainer)
    assert bound.config is resolve_class(stage_spec(stage).arguments)
    assert bound.values["num_generations"] == config(stage).train.rl.group_size


def stage_comparisons(tree: ast.AST) -> list[int]:
    """Lines of each comparison of a stage name (`x.stage == "sft"`, `"kto" != stage`,
    `stage in ("grpo", "rloo")`, `cfg.train.stage not in RL_STAGES`): a `stage` or `*_stage`
    name or attribute against string constants or a *STAGES constant. Read from the syntax
    tree, so spacing, line breaks and operand order do not hide one; `zero_stage == 3` and a
    pipeline `stage == 0` compare numbers and are not stage names."""

    def named_stage(node: ast.expr) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            return (
                bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "stage"
            )
        if isinstance(node, ast.Subscript):  # metadata["stage"]
            return isinstance(node.slice, ast.Constant) and node.slice.value == "stage"
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name == "stage" or name.endswith("_stage")

    def stage_names(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(stage_names(item) for item in node.elts)
        if isinstance(node, ast.BinOp):
            return stage_names(node.left) or stage_names(node.right)
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name.isupper() and name.endswith("STAGES")  # a constant: RL_STAGES, not a count `stages`

    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if any(named_stage(o) for o in operands) and any(stage_names(o) for o in operands):
            lines.append(node.lineno)
    return lines


def test_the_comparison_scan_cannot_be_fooled_by_spacing_or_operand_order() -> None:
    source = """
a = cfg.train.stage=="sft"
b = "kto"  !=  stage
c = (cfg.train.stage
     in ("grpo",
         "rloo"))
d = train.stage not in RL_STAGES
e = dist.zero_stage == 3
f = self.stage == 0
g = spec.data_kind == "chat"
h = stage == stages - 1
i = run.model_metadata.get("stage") == "rm"
j = metadata["stage"] in ("dpo", "kto")
k = key == "stage"
"""
    assert stage_comparisons(ast.parse(source)) == [2, 3, 4, 7, 12, 13]


def test_at_most_ten_stage_comparisons_remain_outside_the_specs() -> None:
    found = {
        f"{path.relative_to(SOURCE)}:{line}": line
        for path in sorted(SOURCE.rglob("*.py"))
        if path not in SPEC_MODULES
        for line in stage_comparisons(ast.parse(path.read_text(encoding="utf-8")))
    }
    assert len(found) <= MAX_STAGE_COMPARISONS, (
        f"{len(found)} comparisons of train.stage outside config/stages.py and train/stages/ "
        f"(at most {MAX_STAGE_COMPARISONS}): ask the stage's spec instead: {sorted(found)}"
    )
