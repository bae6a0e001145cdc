"""Build or load the causal LM a run trains.

Three sources (ModelConfig): a named preset, an inline architecture config, or a local
HF directory. Weights load from safetensors; legacy .bin only with allow_bin_weights,
and transformers then reads them with weights_only (never full unpickling).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BitsAndBytesConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from lmforge.config.hub_names import not_here_and_no_hub
from lmforge.config.model_kind import VISION_PRESET_NAMES, vision_model_type
from lmforge.config.schema import ModelConfig
from lmforge.errors import UserInputError
from lmforge.models.methods import Head
from lmforge.models.moe import apply_router_settings
from lmforge.models.presets import POSITION_KEYS, preset_kwargs
from lmforge.verbosity import load_report_to_log

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(
    cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    head: Head = "causal",
    quantization: BitsAndBytesConfig | None = None,
) -> PreTrainedModel:
    """The model to train: loaded from `cfg.path`, or freshly initialised from a preset / inline config.

    `head="score"` gives a one-logit sequence-scoring head (reward models) on the same body.
    Call `transformers.set_seed` first: fresh weights come from the global RNG.
    """
    auto = AutoModelForSequenceClassification if head == "score" else AutoModelForCausalLM
    if vision_model_type(cfg.path) is not None:
        auto = _vision_auto_class(head)
    if cfg.preset in VISION_PRESET_NAMES:
        model = _vision_preset_model(cfg, tokenizer, head)
    elif cfg.path:
        model = _load_pretrained(cfg, auto, quantization)
        if quantization is None:
            _fit_vocab(model, tokenizer)
    else:
        model = _init_from_config(cfg, tokenizer, auto, max_length=max_length)
    if head == "score":
        model.config.pad_token_id = tokenizer.pad_token_id  # the head reads the last non-pad token
    _check_positions(model, max_length)
    return model


def _vision_preset_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, head: Head) -> PreTrainedModel:
    """A vision preset built fresh around the run's tokenizer (its image tokens already added by
    the data stage); model.config does not reshape it."""
    from lmforge.models.vision import build_vision_model

    _vision_auto_class(head)  # refuses the sequence-scoring head
    if cfg.config:
        raise UserInputError(
            f"model.config: a vision preset ({cfg.preset}) is built as it is defined; its fields are not "
            "overridden. Fix: remove model.config, or save a model of your own shapes and set model.path"
        )
    model, _ = build_vision_model(
        str(cfg.preset), tokenizer, dtype=DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation
    )
    return model


def architecture_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """AutoConfig kwargs of a preset, with `cfg.config` applied on top."""
    kwargs = preset_kwargs(cfg.preset) if cfg.preset else {}
    kwargs.update(cfg.config or {})
    return kwargs


def architecture_config(cfg: ModelConfig) -> PretrainedConfig:
    """The architecture a run will build, without a tokenizer or weights: what layout checks need
    (heads, KV heads, layers, experts, the tp_plan). The vocabulary is the family's default."""
    if cfg.path:
        path = Path(cfg.path)
        try:
            return AutoConfig.from_pretrained(
                str(path.resolve()) if path.exists() else str(cfg.path),
                trust_remote_code=cfg.trust_remote_code,
            )
        except OSError as err:
            raise UserInputError(f"model.path: cannot read the config of {cfg.path!r}: {err}") from None
    if cfg.preset in VISION_PRESET_NAMES:
        from lmforge.models.vision import vision_preset_config

        return vision_preset_config(cfg.preset)
    kwargs = architecture_kwargs(cfg)
    model_type = kwargs.pop("model_type")
    return config_for_model(model_type, kwargs)


def config_for_model(model_type: str, kwargs: dict[str, Any]) -> Any:
    """`AutoConfig.for_model`, with transformers' refusal of a bad architecture as a config error."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, TypeError, StrictDataclassError) as err:
        reason = str(getattr(err, "__cause__", None) or err).strip()
        raise UserInputError(
            f"model.config: transformers cannot build a {model_type!r} config: {reason}"
        ) from None


def _init_from_config(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, auto: Any, *, max_length: int
) -> PreTrainedModel:
    kwargs = architecture_kwargs(cfg)
    model_type = kwargs.pop("model_type")
    kwargs["vocab_size"] = len(tokenizer)
    for key in POSITION_KEYS:
        if key in kwargs:
            kwargs[key] = max(kwargs[key], max_length)
    kwargs.update(_special_token_ids(tokenizer))
    if auto is AutoModelForSequenceClassification:
        kwargs["num_labels"] = 1
    config = config_for_model(model_type, kwargs)
    apply_router_settings(config, cfg.moe)
    return auto.from_config(
        config,
        dtype=DTYPES[cfg.dtype],
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code,
    )


def _load_pretrained(cfg: ModelConfig, auto: Any, quantization: BitsAndBytesConfig | None) -> PreTrainedModel:
    path = Path(cfg.path or "")
    if path.exists() and not (path / "config.json").is_file():
        raise UserInputError(f"model.path: {path} has no config.json; point it at a HF model directory")
    offline = not_here_and_no_hub(
        "model.path",
        str(cfg.path),
        "make that directory first (a previous step's run), or point model.path at "
        "a HF model directory (config.json and safetensors weights).",
    )
    if offline:
        raise UserInputError(offline)
    only_bin = path.is_dir() and not any(path.glob("*.safetensors")) and any(path.glob("*.bin"))
    if only_bin and not cfg.allow_bin_weights:
        raise UserInputError(
            f"model.path: {path} has only legacy .bin weights; convert them to safetensors, or set "
            "model.allow_bin_weights=true to load them (read with weights_only, never unpickled in full)"
        )
    extra: dict[str, Any] = {"num_labels": 1} if auto is AutoModelForSequenceClassification else {}
    if quantization is not None:
        extra["quantization_config"] = quantization
    # Absolute, so that adapters trained on it record a base path that loads from anywhere.
    source = str(path.resolve()) if path.exists() else str(cfg.path)
    try:
        if cfg.moe is not None:  # the router settings go into the config the weights load under
            labels = {"num_labels": extra.pop("num_labels")} if "num_labels" in extra else {}
            extra["config"] = AutoConfig.from_pretrained(
                source, trust_remote_code=cfg.trust_remote_code, **labels
            )
            apply_router_settings(extra["config"], cfg.moe)
        load = functools.partial(
            auto.from_pretrained,
            source,
            **extra,
            dtype=DTYPES[cfg.dtype],
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
            use_safetensors=None if cfg.allow_bin_weights else True,
        )
        if auto is not AutoModelForSequenceClassification:
            return load()
        with load_report_to_log():
            model, info = load(output_loading_info=True)
    except OSError as err:
        raise UserInputError(f"model.path: cannot load {cfg.path!r}: {err}") from None
    _say_what_the_score_head_load_left(model, info, cfg.path)
    return model


def _say_what_the_score_head_load_left(model: PreTrainedModel, info: dict[str, Any], path: Any) -> None:
    """A reward model usually starts from a causal LM, whose weights hold no score head: one line for
    that expected case, a warning naming any other weight the directory lacks (those start random)."""
    body = model.base_model_prefix
    head = sorted(name for name, _ in model.named_children() if name != body)
    missing = sorted(info["missing_keys"])
    not_head = [key for key in missing if key.split(".", 1)[0] not in head]
    if not_head:
        shown = ", ".join(not_head[:3]) + (f" and {len(not_head) - 3} more" if len(not_head) > 3 else "")
        log.warning(
            "model.path: %s lacks %d weight(s) of the model besides its score head (%s): they start "
            "random (transformers' load report is in train.log)",
            path,
            len(not_head),
            shown,
        )
    if len(missing) > len(not_head):
        log.info("model: a new score head (%s, one output) on %s; this run trains it", ", ".join(head), path)


def _special_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    # Without a BOS token the EOS id doubles as BOS (GPT-2's convention); otherwise
    # architectures like GPT-2 keep a default BOS id outside a small vocabulary.
    ids = {
        "bos_token_id": tokenizer.bos_token_id
        if tokenizer.bos_token_id is not None
        else tokenizer.eos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return {k: v for k, v in ids.items() if v is not None}


def _fit_vocab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Grow the embedding table when the tokenizer has more tokens than the model (never shrink it)."""
    rows = int(model.get_input_embeddings().weight.shape[0])  # type: ignore[index]
    if len(tokenizer) > rows:
        log.warning("resizing embeddings from %d to %d rows to fit the tokenizer", rows, len(tokenizer))
        model.resize_token_embeddings(len(tokenizer))


def _vision_auto_class(head: Head) -> Any:
    """A vision-language model trains through AutoModelForImageTextToText (its text model and
    vision tower together); it has no sequence-scoring head."""
    from transformers import AutoModelForImageTextToText

    if head != "causal":
        raise UserInputError(
            "model.path is a vision-language model; reward models (train.stage rm) are text-only. "
            "Fix: use a causal LM for the reward model"
        )
    return AutoModelForImageTextToText


def _check_positions(model: PreTrainedModel, max_length: int) -> None:
    config = getattr(model.config, "text_config", None) or model.config  # a VLM's text model
    for key in POSITION_KEYS:
        limit = getattr(config, key, None)
        if isinstance(limit, int) and limit < max_length:
            raise UserInputError(
                f"data.max_length={max_length} exceeds the model's {key}={limit}; lower data.max_length"
            )


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once), whole: a DTensor by its global size, a
    DeepSpeed ZeRO-3 partition by the size of the parameter it is part of (`ds_numel`)."""
    distinct = {id(p): p for p in model.parameters()}.values()
    return sum(getattr(p, "ds_numel", None) or p.numel() for p in distinct)
