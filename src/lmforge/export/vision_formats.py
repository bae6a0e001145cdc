"""Which export formats a vision-language model (Idefics3: SmolVLM's architecture) can take.

- safetensors: the folder is the model as transformers, vLLM and llama.cpp's own converter read
  it, and `ckpt verify` checks it on the images.
- GGUF: two files, the text model and the vision projector (`mmproj-*.gguf`) that llama.cpp's
  multimodal library loads (gguf_vision.py), when llama.cpp reads the model's images as its own
  processor does (SmolVLM's tiling); the converter checks that before any work, and the run's
  preflight before training.
Every other format is refused before any work, with the reason and what to do instead (each
converter below reads a causal LM and would otherwise fail midway on a traceback, or write a model
without its eyes):
- ONNX: lmforge's graph is a text decoder (input_ids, attention_mask -> logits); the vision tower
  and the merge of image features into the text are not in it.
- compressed-tensors, TensorRT-LLM: their writers load and quantize a causal LM; neither places
  the vision tower.
"""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.config.model_kind import vision_model_type
from lmforge.errors import UserInputError

VISION_FORMATS = ("safetensors", "gguf")

_SAFETENSORS = "`lmforge ckpt convert {source} --to safetensors --out DIR`"
_WHY = {
    "onnx": (
        "lmforge's ONNX graph is a text decoder (input_ids, attention_mask -> logits): the vision tower and "
        "the merge of image features into the text are not exported, so the graph could not see an image"
    ),
    "compressed-tensors": (
        "lmforge's compressed-tensors writer loads and quantizes a causal LM; it does not place the vision "
        "tower and projector"
    ),
    "tensorrt-llm": (
        "lmforge's TensorRT-LLM hand-off is for text models; it does not carry the vision tower and projector"
    ),
}
_FIX = {
    "onnx": "export safetensors ({safetensors}) and serve that folder (transformers or vLLM)",
    "compressed-tensors": (
        "export safetensors ({safetensors}); vLLM serves that folder, and can quantize it on load "
        "(`--quantization fp8`)"
    ),
    "tensorrt-llm": "export safetensors ({safetensors}) and serve that folder with vLLM (`lmforge serve`)",
}


def vision_export_refusal(model_type: str, to: str, source: str) -> str | None:
    """Why the vision-language model at `source` (of `model_type`) cannot be exported as `to`, with
    the fix; None when it can."""
    if to in VISION_FORMATS or to not in _WHY:
        return None
    fix = _FIX[to].format(source=source, safetensors=_SAFETENSORS.format(source=source))
    return (
        f"--to {to}: {source} is a vision-language model ({model_type}), and {_WHY[to]}. Exports of a "
        f"vision-language model: {', '.join(VISION_FORMATS)}. Fix: {fix}"
    )


def refuse_vision_export(source: Path, to: str) -> None:
    """UserInputError, before any work, when `source` is a vision-language model that format `to`
    cannot hold."""
    model_type = vision_model_type(source)
    if model_type is None:
        return
    reason = vision_export_refusal(model_type, to, str(source))
    if reason is not None:
        raise UserInputError(reason)


def check_vision_exports(model_path: str | None, preset: str | None, formats: list[str]) -> None:
    """UserInputError, before a run trains, when `export.formats` names a format its vision-language
    model (`model.path`, or a vision `model.preset`) cannot be exported as: every such format at once."""
    from lmforge.config.model_kind import VISION_PRESETS, preset_family

    model_type = preset_family(preset) if preset in VISION_PRESETS else vision_model_type(model_path)
    if model_type is None:
        return
    source = "runs/<name>/final"
    reasons = [vision_export_refusal(model_type, fmt, source) for fmt in formats]
    if "gguf" in formats:
        reasons.append(_gguf_refusal(model_path, preset, source))
    refused = [reason for reason in reasons if reason is not None]
    if refused:
        raise UserInputError("\n".join(f"export.formats: {reason}" for reason in refused))


def _gguf_refusal(model_path: str | None, preset: str | None, source: str) -> str | None:
    """Why the run's VLM cannot be a GGUF pair llama.cpp reads as the model does (None: it can)."""
    from lmforge.config.model_kind import VISION_PRESETS, preset_family, preset_image_settings
    from lmforge.export.gguf_vision import (
        VISION_GGUF_TYPES,
        llama_cpp_refusal,
        tiling_refusal,
        unsupported_family,
    )

    reason: str | None
    if preset in VISION_PRESETS:
        assert preset is not None
        if preset_family(preset) not in VISION_GGUF_TYPES:
            reason = unsupported_family(preset_family(preset))
        else:
            reason = tiling_refusal(preset_image_settings(preset), int(VISION_PRESETS[preset]["image_size"]))
    else:
        from transformers import AutoTokenizer

        assert model_path is not None
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        reason = llama_cpp_refusal(Path(model_path), config, tokenizer)
    return None if reason is None else f"--to gguf: {source} is a vision-language model, and {reason}"
