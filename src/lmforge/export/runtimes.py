"""Run a model artifact in its own runtime: transformers for HF directories and adapters (with
compressed-tensors for FP8/int checkpoints), onnxruntime for ONNX exports, llama.cpp for GGUF files
(transformers' GGUF reader when llama-cpp-python is not installed), and vLLM on request (a CUDA GPU).

Every runtime answers the same two questions on token ids, so `ckpt verify` compares any
artifact with any reference without caring what either is.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from lmforge.errors import UserInputError
from lmforge.export.safetensors_stream import SafetensorsReader

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

RUNTIMES = ("auto", "transformers", "onnxruntime", "llama.cpp", "vllm")
# Coarse precision classes, each with its own default gates and tolerances in verify, coarsest last.
FULL, HALF, INT8, BITS6, BITS4 = "f32", "f16/bf16", "8-bit", "5-6 bit", "4-bit or less"
PRECISIONS = (FULL, HALF, INT8, BITS6, BITS4)


class CausalRuntime(Protocol):
    def logits(self, token_ids: list[int]) -> np.ndarray:
        """Next-token logits at every position, float32 [len(token_ids), vocab]."""
        ...

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """The greedy continuation's new token ids (no stop tokens applied)."""
        ...


@dataclass
class Artifact:
    """A model to run: what it is, which runtime runs it and at what precision."""

    path: Path
    format: str  # hf | peft-adapter | gguf | onnx
    runtime_name: str
    precision: str
    runtime: CausalRuntime


class TransformersRuntime:
    """A model in transformers; a vision-language model also takes the image files of a sequence
    (`images`, one per image in its token ids, in order), fed as its own processor makes pixels."""

    def __init__(self, model: PreTrainedModel, processor: Any = None) -> None:
        self.model = model
        self.processor = processor  # a vision-language model's processor, else None

    @property
    def takes_images(self) -> bool:
        return self.processor is not None

    def logits(self, token_ids: list[int], images: Sequence[str] = ()) -> np.ndarray:
        import torch

        with torch.no_grad():
            ids = torch.tensor([token_ids], device=self.model.device)
            return self.model(input_ids=ids, **self._pixels(images)).logits[0].float().cpu().numpy()

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, images: Sequence[str] = ()) -> list[int]:
        # A plain argmax loop over the KV cache: generate() would apply the model's generation
        # config (EOS stopping, minimum lengths), which other runtimes do not share. The pixels go
        # in with the prompt only; later steps read the images through the cache.
        import torch

        new: list[int] = []
        with torch.no_grad():
            ids = torch.tensor([prompt_ids], device=self.model.device)
            past, pixels = None, self._pixels(images)
            for _ in range(max_new_tokens):
                out = self.model(input_ids=ids, past_key_values=past, use_cache=True, **pixels)
                past, pixels = out.past_key_values, {}
                new.append(int(out.logits[0, -1].argmax()))
                ids = torch.tensor([[new[-1]]], device=self.model.device)
        return new

    def _pixels(self, images: Sequence[str]) -> dict[str, Any]:
        """The model's image inputs for one sequence's image files (none without images)."""
        if not images:
            return {}
        if self.processor is None:
            raise UserInputError("a text model was given images; compare it on text only")
        from lmforge.data.vision_tokens import pixel_inputs

        inputs = pixel_inputs(self.processor.image_processor, [list(images)])
        dtype = self.model.dtype
        return {
            name: value.to(self.model.device, dtype=dtype)
            if value.is_floating_point()
            else value.to(self.model.device)
            for name, value in inputs.items()
        }


def load_reference(path: Path) -> tuple[Artifact, PreTrainedTokenizerBase]:
    """The reference model (HF directory, adapter or a run's final/) in transformers, and its tokenizer."""
    from lmforge.evaluate.loading import load_for_inference
    from lmforge.models.vision import is_vision_config
    from lmforge.verbosity import stderr_to_log

    compressed = _compressed_bits(path) is not None
    with stderr_to_log("compressed-tensors") if compressed else contextlib.nullcontext():
        model, tokenizer = load_for_inference(path)  # compressed-tensors draws bars as it loads
        if compressed:
            TransformersRuntime(model).logits([0])  # its weights decompress at the first forward
    kind = "peft-adapter" if hasattr(model, "peft_config") else _hf_format(path)
    runtime = "transformers (compressed-tensors)" if kind == "compressed-tensors" else "transformers"
    processor = load_vision_processor(path, tokenizer) if is_vision_config(model.config) else None
    return (
        Artifact(path, kind, runtime, _hf_precision(path), TransformersRuntime(model, processor)),
        tokenizer,
    )


def load_vision_processor(path: Path, tokenizer: PreTrainedTokenizerBase) -> Any:
    """The processor saved with the vision-language model at `path` (an HF folder, a run's final/,
    or an adapter, whose processor may sit with its base), around `tokenizer`; a UserInputError
    when none is there: without it the model's images cannot be made into its inputs."""
    from transformers import AutoProcessor

    from lmforge.config.model_kind import PROCESSOR_FILES
    from lmforge.evaluate.loading import adapter_base

    candidates = [path, path.parent if path.name == "adapter" else path / "adapter"]
    adapter = next((c for c in (path, path / "adapter") if (c / "adapter_config.json").is_file()), None)
    if adapter is not None:
        candidates.append(Path(adapter_base(adapter)))
    folder = next((c for c in candidates if any((c / name).is_file() for name in PROCESSOR_FILES)), None)
    if folder is None:
        raise UserInputError(
            f"{path}: a vision-language model without its processor settings ({' or '.join(PROCESSOR_FILES)}), "
            "so its images cannot be made into its inputs. Fix: copy them from the model it was made from "
            "(lmforge's converters and merge copy them)"
        )
    try:
        return AutoProcessor.from_pretrained(str(folder), tokenizer=tokenizer)
    except (OSError, ValueError) as err:
        raise UserInputError(f"{folder}: its processor does not load ({err})") from None


def _hf_format(path: Path) -> str:
    return "compressed-tensors" if _compressed_bits(path) is not None else "hf"


def _compressed_bits(path: Path) -> int | None:
    """The weight bits of a compressed-tensors checkpoint (llm-compressor's or lmforge's), else None."""
    config_path = path / "config.json"
    if not config_path.is_file():
        return None
    quantization = json.loads(config_path.read_text()).get("quantization_config") or {}
    if quantization.get("quant_method") != "compressed-tensors":
        return None
    bits = [
        group["weights"]["num_bits"]
        for group in quantization.get("config_groups", {}).values()
        if group.get("weights")
    ]
    return min(bits, default=16)


def open_artifact(path: Path, runtime: str = "auto") -> Artifact:
    """The artifact at `path` in the runtime that will serve it (`auto`: its own)."""
    if runtime not in RUNTIMES:
        raise UserInputError(f"--runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}")
    gguf = gguf_file(path)
    if gguf is not None:
        return _open_gguf(gguf, runtime)
    if path.is_dir() and (path / "model.onnx").is_file():
        _require(runtime, ("auto", "onnxruntime"), path, "an ONNX export runs in onnxruntime")
        from lmforge.export.to_onnx import OnnxCausalLM

        return Artifact(path, "onnx", "onnxruntime", onnx_precision(path / "model.onnx"), OnnxCausalLM(path))
    if runtime == "vllm":
        from lmforge.export.vllm_runtime import open_in_vllm

        return Artifact(path, _hf_format(path), "vllm", _hf_precision(path), open_in_vllm(path))
    _require(runtime, ("auto", "transformers"), path, "an HF model or adapter runs in transformers")
    artifact, _ = load_reference(path)
    return artifact


def gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` names, or the single one in directory `path`."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        from lmforge.export.gguf_vision import is_mmproj

        # A vision-language GGUF is a pair: the text model is the file named; its projector goes with it.
        found = [file for file in sorted(path.glob("*.gguf")) if not is_mmproj(file)]
        if len(found) > 1:
            raise UserInputError(f"{path}: {len(found)} GGUF files; name the one to verify")
        return found[0] if found else None
    return None


def _open_gguf(path: Path, runtime: str) -> Artifact:
    from lmforge.export import gguf_runtime

    _require(
        runtime, ("auto", "llama.cpp", "transformers"), path, "a GGUF file runs in llama.cpp or transformers"
    )
    from lmforge.export.gguf_vision import is_mmproj, mmproj_file

    if is_mmproj(path):
        raise UserInputError(
            f"{path}: a vision projector (mmproj); verify the text model GGUF beside it, which runs with it"
        )
    precision = gguf_precision(path)
    mmproj = mmproj_file(path)
    has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    if runtime == "llama.cpp" or (runtime == "auto" and has_llama_cpp):
        if mmproj is not None:
            model: CausalRuntime = gguf_runtime.LlamaCppVisionModel(path, mmproj)
            return Artifact(
                path, "gguf", "llama.cpp (libmtmd)", coarsest(precision, gguf_precision(mmproj)), model
            )
        return Artifact(path, "gguf", "llama.cpp", precision, gguf_runtime.LlamaCppModel(path))
    if _has_experts(path):
        raise UserInputError(
            f"{path}: a Mixture-of-Experts GGUF runs in llama.cpp; transformers' GGUF reader does not load its "
            "stacked experts. Fix: pip install 'lmforge[gguf]' (llama-cpp-python) and verify again"
        )
    return Artifact(
        path, "gguf", "transformers (GGUF reader)", precision, gguf_runtime.TransformersGgufModel(path)
    )


def _has_experts(path: Path) -> bool:
    from gguf import GGUFReader

    return any(name.endswith(".expert_count") for name in GGUFReader(path).fields)


def _require(runtime: str, allowed: tuple[str, ...], path: Path, why: str) -> None:
    if runtime not in allowed:
        raise UserInputError(f"--runtime {runtime}: cannot run {path}; {why}")


def gguf_precision(path: Path) -> str:
    """The coarsest precision among the GGUF's weight tensors (a k-quant mix such as q4_k_m keeps
    some tensors at 6 bits and the norms at f32: its class is its 4-bit part)."""
    from gguf import GGUFReader

    return precision_of_bits(min(_gguf_bits(tensor.tensor_type) for tensor in GGUFReader(path).tensors))


def _gguf_bits(tensor_type: object) -> int:
    """Bits per weight of a GGML type, by its name (F32, F16, BF16, Q8_0, Q6_K, Q5_K, Q4_0, IQ4_XS...)."""
    name = getattr(tensor_type, "name", str(tensor_type))
    if name == "F32":
        return 32
    if name in ("F16", "BF16"):
        return 16
    digits = "".join(ch for ch in name.split("_")[0] if ch.isdigit())
    return int(digits) if digits else 4


def precision_of_bits(bits: int) -> str:
    if bits >= 32:
        return FULL
    if bits >= 16:
        return HALF
    if bits >= 8:
        return INT8
    return BITS6 if bits >= 5 else BITS4


def onnx_precision(path: Path) -> str:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    types = {init.data_type for init in model.graph.initializer}
    if types & {onnx.TensorProto.INT8, onnx.TensorProto.UINT8}:
        return INT8  # onnxruntime's dynamic quantization: int8 weights, one scale per tensor or row
    return HALF if types & {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16} else FULL


def _hf_precision(path: Path) -> str:
    bits = _compressed_bits(path)
    if bits is not None:
        return precision_of_bits(bits)
    shards = sorted(path.glob("*.safetensors")) or sorted((path / "adapter").glob("*.safetensors"))
    dtypes: set[str] = set()
    for shard in shards:
        with SafetensorsReader(shard) as reader:
            dtypes |= {entry.dtype for entry in reader.entries}
    return HALF if dtypes & {"F16", "BF16"} else FULL


def coarsest(*precisions: str) -> str:
    return max(precisions, key=PRECISIONS.index)


def token_logprob_mean(logits: np.ndarray, token_ids: list[int], start: int = 1) -> float:
    """Mean next-token negative log-likelihood of `token_ids[start:]` under per-position `logits`
    (start > 1: only a sequence's tail, an answer after its prompt, is scored)."""
    log_probs = log_softmax(logits[start - 1 : -1])
    targets = np.asarray(token_ids[start:])
    return float(-log_probs[np.arange(len(targets)), targets].mean())


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64."""
    shifted = logits.astype(np.float64)
    shifted -= shifted.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
