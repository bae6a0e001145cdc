"""The teacher of on-policy distillation (train.stage distill): checked against the student, then loaded.

The distillation loss compares the two models' next-token distributions id by id on token ids the
student's tokenizer produced, which the teacher reads as they are. That is only meaningful when id
i is the same token for both: the same vocabulary. A mismatch does not fail on its own (a teacher
with as many ids trains without an error, on nonsense), so it is refused before any model is built.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lmforge.config import LmforgeConfig
from lmforge.config.schema import ModelConfig
from lmforge.errors import UserInputError
from lmforge.models.build import DTYPES
from lmforge.train.preflight import TEACHER_KEY as KEY
from lmforge.train.preflight import teacher_directory

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_SHOWN = 3  # differing tokens named in a refusal


def check_teacher_vocabulary(cfg: LmforgeConfig, student_tokenizer: PreTrainedTokenizerBase) -> None:
    """UserInputError (exit code 2) unless the teacher's tokenizer maps every token to the id the
    student's does. Run before the models are built: it reads two tokenizers only."""
    path = teacher_directory(cfg.train.distill)
    student = _student_tokenizer_source(cfg, student_tokenizer)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise UserInputError(
            f"{KEY}: {path} has no tokenizer, so whether it shares the student's vocabulary ({student}) "
            "cannot be checked. Fix: save the teacher's tokenizer into it (tokenizer.save_pretrained)"
        )
    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=cfg.model.trust_remote_code
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        reason = _first_line(err)
        raise UserInputError(f"{KEY}: the tokenizer in {path} does not load ({reason})") from None
    difference = vocabulary_difference(teacher_tokenizer.get_vocab(), student_tokenizer.get_vocab())
    if difference is not None:
        raise UserInputError(
            f"{KEY}: the teacher's tokenizer ({path}) does not match the student's ({student}): "
            f"{difference}. Distillation compares the two models' next-token distributions token id by "
            "token id, so both need one vocabulary. Fix: use a teacher of the student's tokenizer family, "
            "or set tokenizer.path to the teacher's tokenizer when the student is built from scratch "
            "(model.preset)"
        )


def vocabulary_difference(teacher: dict[str, int], student: dict[str, int]) -> str | None:
    """Why two token -> id maps differ, in words; None when they are the same."""
    if teacher == student:
        return None
    differing = sorted(
        (token for token in teacher.keys() | student.keys() if teacher.get(token) != student.get(token)),
        # Lowest id first (either side), then by name: the same tokens are named on every run.
        key=lambda token: (min(i for i in (teacher.get(token), student.get(token)) if i is not None), token),
    )
    examples = "; ".join(
        f"{token!r}: teacher {_id_of(teacher, token)}, student {_id_of(student, token)}"
        for token in differing[:_SHOWN]
    )
    return (
        f"the teacher has {len(teacher)} tokens and the student {len(student)}, and {len(differing)} tokens "
        f"have different ids ({examples})"
    )


def load_teacher(cfg: LmforgeConfig, student: Any) -> PreTrainedModel:
    """The teacher in the student's dtype and attention kernel, frozen, in eval mode. Its model code
    runs only with model.trust_remote_code (the config's say for every model of the run)."""
    path = teacher_directory(cfg.train.distill)
    model_cfg: ModelConfig = cfg.model
    try:
        teacher = AutoModelForCausalLM.from_pretrained(
            str(path.resolve()),
            dtype=DTYPES[model_cfg.dtype],
            attn_implementation=model_cfg.attn_implementation,
            trust_remote_code=model_cfg.trust_remote_code,
            use_safetensors=None if model_cfg.allow_bin_weights else True,
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserInputError(
            f"{KEY}: {path} does not load as a causal language model ({_first_line(err)}). Fix: point "
            "it at an HF causal-LM directory with safetensors weights (model.allow_bin_weights for "
            "legacy .bin)"
        ) from None
    _check_logit_widths(teacher, student, path)
    teacher.requires_grad_(False)
    log.info("teacher: %s, %s", path, teacher.config.model_type)
    return teacher.eval()


def _check_logit_widths(teacher: Any, student: Any, path: Path) -> None:
    """Equal tokenizers can still sit on output layers of different widths (one padded to a multiple
    of 64): the divergence needs both distributions over the same ids."""
    teacher_size = teacher.config.get_text_config().vocab_size
    student_size = student.config.get_text_config().vocab_size
    if teacher_size != student_size:
        raise UserInputError(
            f"{KEY}: the teacher ({path}) predicts {teacher_size} token ids and the student {student_size}, "
            "though their tokenizers match. Fix: resize one model's embeddings to the other's vocab_size "
            "(model.resize_token_embeddings) and save it again"
        )


def _student_tokenizer_source(cfg: LmforgeConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """Where the student's tokenizer came from, as the user configured it."""
    if cfg.tokenizer.path is not None:
        return f"tokenizer.path {cfg.tokenizer.path}"
    if cfg.tokenizer.train is not None:
        return "the tokenizer trained for this run (tokenizer.train)"
    if cfg.model.path is not None:
        return f"model.path {cfg.model.path}"
    return str(tokenizer.name_or_path)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _id_of(vocabulary: dict[str, int], token: str) -> str:
    return f"id {vocabulary[token]}" if token in vocabulary else "none"
