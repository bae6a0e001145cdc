"""The offline preference stages, dpo, kto and rm, bound to TRL's trainers.

DPOTrainer runs dpo's sigmoid and ipo losses; train.dpo.loss orpo and simpo select TRL's ORPO
and CPO trainers, which need no reference model. Each is fed the data stage's validated
conversational rows (data/preference.py).
"""

from __future__ import annotations

from collections.abc import Callable

from lmforge.config import LmforgeConfig
from lmforge.config.stages import stage_spec
from lmforge.train.stages.binding import TrlStage, trl_stage


def dpo_stage(cfg: LmforgeConfig) -> TrlStage:
    """dpo, by train.dpo.loss: DPOTrainer (sigmoid, ipo), ORPOTrainer (orpo) or CPOTrainer (simpo)."""
    dpo, max_length = cfg.train.dpo, cfg.data.max_length
    if dpo.loss == "orpo":
        return trl_stage(
            "trl.experimental.orpo:ORPOTrainer",
            "trl.experimental.orpo:ORPOConfig",
            {"beta": dpo.beta, "max_length": max_length},
            takes_reference=False,
        )
    if dpo.loss == "simpo":
        return trl_stage(
            "trl.experimental.cpo:CPOTrainer",
            "trl.experimental.cpo:CPOConfig",
            {
                "loss_type": "simpo",
                "cpo_alpha": 0.0,  # pure SimPO: no behaviour-cloning term
                "simpo_gamma": dpo.simpo_gamma,
                "beta": dpo.beta,
                "max_length": max_length,
            },
            takes_reference=False,
        )
    spec = stage_spec("dpo")
    return trl_stage(
        spec.trainer,
        spec.arguments,
        {
            "loss_type": [dpo.loss],
            "beta": dpo.beta,
            "max_length": max_length,
            "truncation_mode": "keep_start",
        },
        takes_reference=True,
    )


def kto_stage(cfg: LmforgeConfig) -> TrlStage:
    """kto through TRL's KTOTrainer."""
    kto, spec = cfg.train.kto, stage_spec("kto")
    return trl_stage(
        spec.trainer,
        spec.arguments,
        {
            "beta": kto.beta,
            "desirable_weight": kto.desirable_weight,
            "undesirable_weight": kto.undesirable_weight,
            "max_length": cfg.data.max_length,
        },
        takes_reference=True,
    )


def rm_stage(cfg: LmforgeConfig) -> TrlStage:
    """rm through TRL's RewardTrainer (a score head over preference pairs)."""
    spec = stage_spec("rm")
    return trl_stage(spec.trainer, spec.arguments, {"max_length": cfg.data.max_length}, takes_reference=False)


# Every stage whose spec is offline_preference, by name.
PREFERENCE_STAGES: dict[str, Callable[[LmforgeConfig], TrlStage]] = {
    "dpo": dpo_stage,
    "kto": kto_stage,
    "rm": rm_stage,
}
