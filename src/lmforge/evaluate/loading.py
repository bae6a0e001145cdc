"""Load a trained model for inference: a plain HF directory, a PEFT adapter, or a run's final/.

Safe defaults throughout: safetensors only, no remote code. The model comes back in eval
mode, float32 on CPU or bfloat16 on CUDA.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.errors import UserInputError

if TYPE_CHECKING:  # torch and transformers load lazily: a wrong path fails in a blink, not seconds
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EXPECTED = (
    "expected a HF model directory (config.json + *.safetensors), a PEFT adapter directory "
    "(adapter_config.json) or a run's final/ directory"
)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PICKLED_ADAPTER_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_for_inference(
    model_dir: str | Path, adapter: str | Path | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (eval mode, adapter applied) and tokenizer for `model_dir`.

    `model_dir` is a full model, an adapter directory (its base is read from
    `base_model_name_or_path`), or a run's `final/` holding an `adapter/` subdirectory;
    `adapter` puts an adapter directory on top of a full model. Raises UserInputError
    naming the path when there is nothing loadable there.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise UserInputError(f"{path}: no such directory; {EXPECTED}")
    if adapter is not None:
        if not is_full_model(path):
            raise UserInputError(f"{path}: --adapter needs a full model here; {EXPECTED}")
        base, adapter_dir, tokenizer_dir = str(path), _check_adapter(Path(adapter)), path
    elif (path / "adapter_config.json").is_file():
        adapter_dir = path
        base = adapter_base(path)
        tokenizer_dir = path if _has_tokenizer(path) else Path(base)
    elif is_full_model(path):
        base, adapter_dir, tokenizer_dir = str(path), None, path
    elif (path / "adapter" / "adapter_config.json").is_file():
        adapter_dir = path / "adapter"
        base = adapter_base(adapter_dir)
        tokenizer_dir = next((d for d in (path, adapter_dir) if _has_tokenizer(d)), Path(base))
    else:
        raise UserInputError(f"{path}: no model found; {EXPECTED}")
    if adapter_dir is not None:
        check_adapter_weights(adapter_dir)  # before any model loads: a wrong file fails in a blink
    from lmforge.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir))
    if tokenizer.pad_token_id is None:  # batched generation pads; EOS is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    model = _load_model(base)
    if adapter_dir is not None:
        model = _apply_adapter(model, adapter_dir)
    model.eval()
    return model, tokenizer


def inference_device() -> tuple[torch.device, torch.dtype]:
    """bfloat16 on CUDA when there is one, else float32 on CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def is_full_model(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


def _check_adapter(path: Path) -> Path:
    if not (path / "adapter_config.json").is_file():
        raise UserInputError(
            f"--adapter {path}: no adapter_config.json there; expected a PEFT adapter directory"
        )
    return path


def check_adapter_weights(adapter_dir: Path) -> None:
    """UserInputError unless `adapter_dir` holds adapter_model.safetensors.

    A pickled adapter_model.bin is refused: unpickling runs code from the file, so lmforge
    never loads one (PEFT would try). The message says how to convert it where it is trusted.
    """
    if (adapter_dir / ADAPTER_WEIGHTS).is_file():
        return
    pickled = [name for name in _PICKLED_ADAPTER_WEIGHTS if (adapter_dir / name).is_file()]
    if pickled:
        raise UserInputError(
            f"{adapter_dir / pickled[0]}: a pickled adapter; lmforge loads only {ADAPTER_WEIGHTS} "
            "because loading a pickle can run code from the file. Fix: in an environment where you "
            "trust the file, convert it once with PEFT: `model = PeftModel.from_pretrained(base_model, "
            f"'{adapter_dir}'); model.save_pretrained('{adapter_dir}', safe_serialization=True)`, "
            f"which writes {ADAPTER_WEIGHTS} next to it."
        )
    raise UserInputError(
        f"{adapter_dir}: adapter_config.json but no {ADAPTER_WEIGHTS}; the adapter's weights are "
        "missing. Fix: copy the whole adapter directory saved by save_pretrained."
    )


def adapter_base(adapter_dir: Path) -> str:
    """The adapter's base model, a local path (relative ones resolved from the adapter) or a hub id."""
    try:
        config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise UserInputError(f"{adapter_dir / 'adapter_config.json'}: unreadable: {err}") from None
    base = config.get("base_model_name_or_path")
    if not base:
        raise UserInputError(
            f"{adapter_dir / 'adapter_config.json'}: no base_model_name_or_path; load the base "
            "model directory and pass this adapter with --adapter"
        )
    relative = adapter_dir / base
    return str(relative) if not Path(base).is_absolute() and relative.is_dir() else str(base)


def _load_model(base: str) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from lmforge.config.model_kind import vision_model_type

    device, dtype = inference_device()
    auto: Any = AutoModelForImageTextToText if vision_model_type(base) else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(base, dtype=dtype, trust_remote_code=False, use_safetensors=True)
    except (OSError, ValueError) as err:
        raise UserInputError(f"{base}: cannot load the model: {err}") from None
    model.to(device)  # type: ignore[arg-type]
    return model


def _apply_adapter(model: PreTrainedModel, adapter_dir: Path) -> PreTrainedModel:
    from peft import PeftModel

    try:
        with warnings.catch_warnings():  # PEFT calls transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
    except (OSError, ValueError) as err:
        raise UserInputError(f"{adapter_dir}: cannot load the adapter: {err}") from None
    return peft_model  # type: ignore[return-value]
