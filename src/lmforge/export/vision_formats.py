"""Which export formats a vision-language model (Idefics3: SmolVLM's architecture) can take.

Safetensors only, for now: the folder is the model as transformers, vLLM and llama.cpp's own
converter read it, and `ckpt verify` checks it on the images. Every other format is refused
before any work, with the reason and what to do instead (each converter below reads a causal LM
and would otherwise fail midway on a traceback, or write a model without its eyes):

- GGUF: llama.cpp runs an Idefics3 model as two files, the text model (a llama GGUF) and the
  vision tower with its projector (`mmproj-*.gguf`, projector type idefics3) that its multimodal
  library, libmtmd, loads. lmforge writes text GGUFs only; llama-cpp-python 0.3.36 binds libmtmd
  (`llama_cpp.mtmd_cpp`), so a projector written here could be checked on images there, but that
  writer and check are not built yet.
- ONNX: lmforge's graph is a text decoder (input_ids, attention_mask -> logits); the vision tower
  and the merge of image features into the text are not in it.
- compressed-tensors, TensorRT-LLM: their writers load and quantize a causal LM; neither places
  the vision tower.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.config.model_kind import vision_model_type
from lmforge.errors import UserInputError

VISION_FORMATS = ("safetensors",)

_SAFETENSORS = "`lmforge ckpt convert {source} --to safetensors --out DIR`"
_WHY = {
    "gguf": (
        "llama.cpp runs a vision-language model as two files: the text model GGUF and a vision projector "
        "(mmproj-*.gguf) that its multimodal library loads, and lmforge writes the text model only (a "
        "projector writer checked in llama.cpp on images is not built yet)"
    ),
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
    "gguf": (
        "export safetensors ({safetensors}), or make both files with llama.cpp's own converter from this "
        "folder (an adapter merged first with `lmforge ckpt merge-lora`), in a llama.cpp checkout: "
        "`python convert_hf_to_gguf.py {source} --outfile model.gguf` and "
        "`python convert_hf_to_gguf.py {source} --mmproj --outfile mmproj-model.gguf`, then run "
        "`llama-mtmd-cli -m model.gguf --mmproj mmproj-model.gguf --image IMAGE -p PROMPT`"
    ),
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


def check_vision_exports(model_path: str | None, formats: list[str]) -> None:
    """UserInputError, before a run trains, when `export.formats` names a format its vision-language
    model (`model.path`) cannot be exported as: every such format at once."""
    model_type = vision_model_type(model_path)
    if model_type is None:
        return
    reasons = [vision_export_refusal(model_type, fmt, "runs/<name>/final") for fmt in formats]
    refused = [reason for reason in reasons if reason is not None]
    if refused:
        raise UserInputError("\n".join(f"export.formats: {reason}" for reason in refused))
