"""Typed config: schema, loading with overrides and precise errors, redaction."""

from lmforge.config.load import load_config
from lmforge.config.redact import redact
from lmforge.config.schema import LmforgeConfig
from lmforge.config.stages import stage_guardrails, stage_spec

__all__ = ["LmforgeConfig", "load_config", "redact", "dump_config"]


def dump_config(cfg: LmforgeConfig) -> dict:
    """The resolved config as plain data with secrets redacted (for config.yaml and `config show`),
    written so that it loads again and runs the same (a run's config.yaml can be run again)."""
    data = cfg.model_dump(mode="json")
    _as_it_runs(cfg, data)
    return redact(data)


def _as_it_runs(cfg: LmforgeConfig, data: dict) -> None:
    """Settings whose mere presence the config's rules read, written as the run used them: the
    loss-spike rule of a stage it does not judge (online RL) is off; RLOO leaves GRPO's loss
    variant out, and its reward scaling unless it was given (TRL's own default applies then); vLLM's
    settings appear where they apply."""
    if "spike" not in stage_guardrails(cfg.train.stage):
        data["monitor"]["guard"]["spike"] = "off"
    if cfg.train.stage == "rloo":
        data["train"]["rl"].pop("loss")
        if "scale_rewards" not in cfg.train.rl.model_fields_set:
            data["train"]["rl"].pop("scale_rewards")
    # vLLM's settings are written only where they apply (or were given): transformers generation
    # reads none of them, and the importance-sampling correction is GRPOTrainer's alone.
    vllm, given = data["train"]["rl"]["vllm"], cfg.train.rl.vllm.model_fields_set
    if cfg.train.rl.generation == "transformers" and not given:
        data["train"]["rl"].pop("vllm")
    elif stage_spec(cfg.train.stage).trainer != "trl:GRPOTrainer":
        for key in ("importance_sampling", "importance_sampling_max", "importance_sampling_min"):
            if key not in given:
                vllm.pop(key)
