"""distill, on-policy distillation, bound to TRL's DistillationTrainer.

The student generates an answer to each prompt (the conversation before its last assistant turn,
data/preference.py), and the loss is TRL's generalized Jensen-Shannon divergence between the
student's and the teacher's next-token distributions at every token of that answer: the teacher's
log-probabilities on the student's own samples. lmforge supplies the teacher (train/teacher.py,
checked against the student's vocabulary before any model was built) and the settings of
`train.distill`; generation, the loss and its logging are TRL's.
"""

from __future__ import annotations

from typing import Any

from lmforge.config import LmforgeConfig
from lmforge.config.schema import DistillConfig
from lmforge.config.stages import stage_spec
from lmforge.train.stages.binding import TrlStage, trl_stage
from lmforge.train.teacher import load_teacher


def distill_config_values(settings: DistillConfig) -> dict[str, Any]:
    """DistillationConfig values from `train.distill`."""
    return {
        "beta": settings.beta,
        "temperature": settings.temperature,
        "max_completion_length": settings.max_new_tokens,
        # TRL's own completion printer writes rich tables to the console and parquet files.
        "log_completions": False,
    }


def distill_stage(cfg: LmforgeConfig, student: Any) -> TrlStage:
    """distill through TRL's DistillationTrainer, with the teacher of train.distill.teacher loaded."""
    spec = stage_spec(cfg.train.stage)
    return trl_stage(
        spec.trainer,
        spec.arguments,
        distill_config_values(cfg.train.distill),
        takes_reference=False,  # the teacher is another model, not a frozen copy of the student
        extra={"teacher_model": load_teacher(cfg, student)},
    )
