"""`lmforge ckpt convert --to gguf`: an HF Llama / Mistral / Qwen2 model -> one GGUF file + an Ollama Modelfile.

The GGUF carries what llama.cpp needs to run the model as a chat model on its own: the
architecture hyperparameters, the weights under llama.cpp's tensor names, and the tokenizer
(vocabulary, merges or scores, special ids, chat template). Weights stream a block of rows at a
time: every tensor's name, type and size is known from the safetensors headers, so the GGUF header
is written first and each tensor is read, converted and appended in blocks of a few MB in turn
(peak memory: the imports, the tokenizer and one block, whatever the model's size).

Two layout facts llama.cpp expects and HF does not:
- Llama/Mistral run RoPE on interleaved pairs in llama.cpp (rope type NORM) but on halves in HF
  (rotate_half), so the rows of q_proj/k_proj are permuted per head. Qwen2 uses llama.cpp's NEOX
  rope type, which is HF's layout: no permutation.
- Tied embeddings: llama.cpp reuses token_embd for the output when output.weight is absent.

The tokenizer metadata is written by gguf_tokenizer.py, the Modelfile by gguf_modelfile.py,
each tensor's bytes by gguf_encoding.py.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from lmforge.errors import UserInputError
from lmforge.export.conversion import Conversion
from lmforge.export.gguf_encoding import PlannedTensor, QType, storage_type, write_complete
from lmforge.export.gguf_modelfile import render_modelfile
from lmforge.export.gguf_quantize import (
    QUANT_TYPES,
    quantize,
    quantize_with_imatrix,
    require_imatrix_tools,
    require_quantizer,
)
from lmforge.export.gguf_tokenizer import add_tokenizer, load_tokenizer
from lmforge.export.gguf_vision import (
    VISION_GGUF_TYPES,
    is_vision_gguf_source,
    llama_cpp_refusal,
    text_model_config,
    text_tensor_name,
    unsupported_family,
    write_mmproj,
)
from lmforge.export.safetensors_stream import INDEX_NAME, Entry, SafetensorsReader

# --dtype -> (type of 2-D weights, general.file_type)
GGUF_DTYPES: dict[str, tuple[QType, gguf.LlamaFileType]] = {
    "f32": (QType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (QType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (QType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (QType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


@dataclass(frozen=True)
class Family:
    arch: gguf.MODEL_ARCH
    permute_qk: bool  # HF rotate_half layout -> llama.cpp interleaved (NORM) rope


# HF model_type -> GGUF architecture. Mistral is the Llama graph in llama.cpp (as its own converter writes it).
FAMILIES: dict[str, Family] = {
    "llama": Family(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    "mistral": Family(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    "qwen2": Family(gguf.MODEL_ARCH.QWEN2, permute_qk=False),
    # Mixture-of-Experts: each layer's experts stacked into one 3-D tensor per projection
    # (ffn_gate_exps / ffn_up_exps / ffn_down_exps), the router as ffn_gate_inp. Mixtral is
    # llama.cpp's llama graph with experts.
    "mixtral": Family(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    "qwen2_moe": Family(gguf.MODEL_ARCH.QWEN2MOE, permute_qk=False),
    "qwen3_moe": Family(gguf.MODEL_ARCH.QWEN3MOE, permute_qk=False),
}
# checkpoint name of one expert's projection -> (the merged name llama.cpp's map knows, expert index)
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<proj>\w+)\.weight$")
# Buffers some checkpoints carry that are not weights.
_SKIP_SUFFIXES = ("rotary_emb.inv_freq",)


def convert_to_gguf(source: Path, out: Path, *, dtype: str, imatrix_data: Path | None = None) -> Conversion:
    """Write `<out>/model-<dtype>.gguf` and `<out>/Modelfile` from the HF model directory `source`.
    f32 / f16 / bf16 / q8_0 are written here; the other llama.cpp types (q4_k_m, q6_k, ...) are the
    f16 file requantized by llama.cpp (gguf_quantize.py), the f16 file removed after; with
    `imatrix_data`, by llama.cpp's tools with an importance matrix computed on that data's texts."""
    if dtype not in GGUF_DTYPES and dtype not in QUANT_TYPES:
        raise UserInputError(
            f"--dtype {dtype!r}: for gguf choose one of {', '.join([*GGUF_DTYPES, *QUANT_TYPES])}"
        )
    requantized = dtype in QUANT_TYPES
    if imatrix_data is not None:
        tools = require_imatrix_tools(dtype)
    elif requantized:
        require_quantizer(dtype)
    written = "f16" if requantized else dtype
    source_config = _read_config(source)
    vision = is_vision_gguf_source(source_config)
    config = text_model_config(source_config) if vision else source_config
    calibration = _calibration_texts(source, imatrix_data) if imatrix_data is not None else None
    family = FAMILIES[config["model_type"]]
    shards = _weight_files(source)
    tokenizer = load_tokenizer(source, source_config)
    if vision:
        refusal = llama_cpp_refusal(source, source_config, tokenizer)
        if refusal is not None:
            raise UserInputError(f"--to gguf: {source} is a vision-language model, and {refusal}")

    out.mkdir(parents=True, exist_ok=True)
    path = out / f"model-{dtype}.gguf"
    plain = out / f"model-{written}.gguf"  # the file lmforge writes (requantized: llama.cpp's input)
    partial = plain.with_name(plain.name + ".partial")
    plan = _plan_tensors(shards, config, family, GGUF_DTYPES[written][0], text_only=vision)
    _require_space(out, sum(t.nbytes for t in plan) * (2 if requantized else 1))
    writer = gguf.GGUFWriter(partial, gguf.MODEL_ARCH_NAMES[family.arch])
    details: dict[str, Any] = {
        "architecture": writer.arch,
        "dtype": dtype,
        "source_model_type": source_config["model_type"],
    }
    _add_hyperparameters(writer, config, source, written)
    rope_freqs = _add_rope_scaling(writer, config)
    details |= add_tokenizer(writer, tokenizer, config)
    modelfile_text = render_modelfile(path.name, tokenizer)
    del tokenizer  # its vocabulary need not stay resident while the weights stream

    if rope_freqs is not None:
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        plan.append(PlannedTensor(name, QType.F32, computed=rope_freqs))
    write_complete(writer, plan, partial, plain)
    if calibration is not None:
        details |= quantize_with_imatrix(plain, path, dtype, *calibration, tools)
        details |= {
            "quantizer": "llama.cpp llama-imatrix + llama-quantize --imatrix",
            "imatrix_data": str(imatrix_data),
        }
        plain.unlink()
    elif requantized:
        quantize(plain, path, dtype)
        plain.unlink()
        details["quantizer"] = "llama.cpp llama_model_quantize (llama-cpp-python)"

    counts: dict[str, int] = {}
    for tensor in gguf.GGUFReader(path).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    details |= {"tensors": len(plan), "tensor_types": counts, "bytes": path.stat().st_size}
    if vision:  # Ollama's Modelfile has no place for llama.cpp's idefics3 projector: name the commands
        mmproj, mm_details = write_mmproj(source, shards, source_config, out, written)
        details |= mm_details | {
            "runs_with": f"llama-mtmd-cli -m {path.name} --mmproj {mmproj.name} --image IMAGE -p PROMPT; "
            f"llama-server -m {path.name} --mmproj {mmproj.name}"
        }
        return Conversion(format="gguf", out=out, files=[path, mmproj], details=details)
    modelfile = out / "Modelfile"
    modelfile.write_text(modelfile_text)
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    if window and window < config["max_position_embeddings"]:
        details["note"] = (
            f"sliding_window={window} is not used by llama.cpp's {writer.arch} graph: "
            "outputs match the source only for sequences up to the window"
        )
    return Conversion(format="gguf", out=out, files=[path, modelfile], details=details)


def _require_space(out: Path, needed: int) -> None:
    """UserInputError, before anything is written, when the disk holding `out` lacks `needed` bytes."""
    free = shutil.disk_usage(out).free
    if needed > free:
        raise UserInputError(
            f"{out}: the GGUF needs about {needed / 2**20:,.0f} MiB and the disk has {free / 2**20:,.0f} MiB "
            "free; free space there or pass another --out"
        )


def _calibration_texts(source: Path, data: Path) -> tuple[list[str], int]:
    """The importance matrix's calibration texts, `data` read as verification reads it (texts, or QA
    rows chat-rendered with their answers), and their length in tokens."""
    from lmforge.data.tokenizer import load_tokenizer as load_hf_tokenizer
    from lmforge.export.reference_texts import rendered_texts

    if not data.is_file():
        raise UserInputError(f"--imatrix-data {data}: no such file; pass texts (.txt, jsonl) or QA rows")
    tokenizer = load_hf_tokenizer(str(source))
    texts, _, _ = rendered_texts(tokenizer, data, None)
    return texts, len(tokenizer("\n".join(texts))["input_ids"])


def _read_config(source: Path) -> dict[str, Any]:
    supported = ", ".join(sorted(FAMILIES))
    config_path = source / "config.json"
    if not source.is_dir() or not config_path.is_file():
        raise UserInputError(
            f"{source}: not an HF model directory (no config.json). GGUF export reads a directory saved with "
            f"save_pretrained (config.json + *.safetensors) of model type {supported}."
        )
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if is_vision_gguf_source(config):
        if model_type not in VISION_GGUF_TYPES:
            raise UserInputError(
                f"--to gguf: {source} is a vision-language model, and {unsupported_family(str(model_type))}"
            )
        if text_model_config(config)["model_type"] not in FAMILIES:
            raise UserInputError(
                f"{config_path}: the text model of this vision-language model is a "
                f"{text_model_config(config)['model_type']!r}; GGUF export here writes a llama one"
            )
        return config
    if model_type not in FAMILIES:
        raise UserInputError(
            f"{config_path}: model_type {model_type!r} has no GGUF export here; supported: {supported}."
        )
    _check_moe_routing(config, config_path)
    return config


def _check_moe_routing(config: dict[str, Any], config_path: Path) -> None:
    """Refuse, before any work, an MoE whose routing llama.cpp's graph for its family does not
    compute: it hard-codes whether the top-k weights are renormalized (qwen3moe: yes, qwen2moe:
    no) and puts experts in every layer."""
    model_type = config["model_type"]
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return
    renormalized = model_type == "qwen3_moe"
    if bool(config.get("norm_topk_prob", False)) != renormalized:
        raise UserInputError(
            f"{config_path}: norm_topk_prob is {bool(config.get('norm_topk_prob', False))}, and llama.cpp's "
            f"{model_type.replace('_', '')} graph {'always' if renormalized else 'never'} renormalizes the chosen "
            "experts' weights: the GGUF would route differently from this model. Export it as safetensors or "
            "ONNX instead"
        )
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise UserInputError(
            f"{config_path}: dense layers among the expert layers (decoder_sparse_step / mlp_only_layers); "
            f"llama.cpp's {model_type.replace('_', '')} graph puts experts in every layer. Export it as "
            "safetensors or ONNX instead"
        )


def _weight_files(source: Path) -> list[Path]:
    index = source / INDEX_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [source / name for name in names]
    if (source / "model.safetensors").is_file():
        return [source / "model.safetensors"]
    raise UserInputError(
        f"{source}: no model.safetensors or {INDEX_NAME}. GGUF export reads safetensors weights only; "
        f"for pytorch_model*.bin run `lmforge ckpt convert {source} --to safetensors --allow-bin --out DIR` first."
    )


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters`; older configs have rope_theta + rope_scaling."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _add_hyperparameters(writer: gguf.GGUFWriter, config: dict[str, Any], source: Path, dtype: str) -> None:
    writer.add_type(gguf.GGUFType.MODEL)
    name = source.resolve().name
    # transformers' GGUF reader treats a "llama" file whose general.name is exactly "mistral" as a
    # Mistral architecture it cannot load (transformers 5.23); llama.cpp does not care about the name.
    writer.add_name(f"{name}-model" if name.lower() == "mistral" else name)
    writer.add_file_type(GGUF_DTYPES[dtype][1])
    if dtype == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = _head_dim(config)
    if head_dim != config["hidden_size"] // config["num_attention_heads"]:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(_rope_parameters(config)["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        if "moe_intermediate_size" in config:  # Qwen MoE: expert width apart from the dense one
            writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))


def _add_rope_scaling(writer: gguf.GGUFWriter, config: dict[str, Any]) -> np.ndarray | None:
    """Rope scaling as llama.cpp reads it; Llama 3's frequency-dependent scaling is a per-frequency
    factor tensor (rope_freqs), which this returns for writing."""
    params = _rope_parameters(config)
    kind = params["rope_type"]
    if kind == "default":
        return None
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(params["factor"]))
        return None
    if kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(params["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(params["original_max_position_embeddings"]))
        return None
    if kind == "llama3":
        return _llama3_rope_factors(params, _head_dim(config))
    raise UserInputError(
        f"config.json: rope scaling {kind!r} has no GGUF export here; supported: default, linear, yarn, llama3"
    )


def _llama3_rope_factors(params: dict[str, Any], head_dim: int) -> np.ndarray:
    """Divisors of each rotary frequency (Llama 3.1 scaling): none for short wavelengths, `factor`
    for long ones, a smooth blend between."""
    factor = float(params["factor"])
    low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
    old_context = float(params.get("original_max_position_embeddings", 8192))
    theta = float(params["rope_theta"])
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = np.clip((old_context / wavelen - low) / (high - low), 0.0, 1.0)
    factors = 1.0 / ((1.0 - smooth) / factor + smooth)
    return factors.astype(np.float32)


def _plan_tensors(
    shards: list[Path], config: dict[str, Any], family: Family, weight_type: QType, *, text_only: bool = False
) -> list[PlannedTensor]:
    """Every tensor of the model under its llama.cpp name; `text_only`: a vision-language model's
    text model alone (its tensors named as a plain causal LM's, the vision side left out)."""
    names = gguf.get_tensor_name_map(family.arch, config["num_hidden_layers"])
    tied = bool(config.get("tie_word_embeddings", False))
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    plan: list[PlannedTensor] = []
    experts: dict[str, list[tuple[int, Path, Entry]]] = {}  # merged name -> each expert's part
    for shard in shards:
        with SafetensorsReader(shard) as reader:
            entries = reader.entries
        for entry in entries:
            checkpoint_name = text_tensor_name(entry.name) if text_only else entry.name
            if checkpoint_name is None:
                continue
            if checkpoint_name.endswith(_SKIP_SUFFIXES) or (tied and checkpoint_name == "lm_head.weight"):
                continue
            expert = _EXPERT.match(checkpoint_name)
            if expert is not None:
                merged = f"{expert['prefix']}.{expert['proj']}.weight"
                if merged not in experts:
                    plan.append(PlannedTensor(merged, QType.F32))  # its place; filled in below
                experts.setdefault(merged, []).append((int(expert["index"]), shard, entry))
                continue
            name = _gguf_name(names, checkpoint_name, shard, family, config)
            permute = 0
            if family.permute_qk and ".attn_q." in name:
                permute = heads
            elif family.permute_qk and ".attn_k." in name:
                permute = kv_heads
            qtype = storage_type(entry.shape, weight_type)
            plan.append(PlannedTensor(name, qtype, shard, entry, permute))
    return [
        _stacked(t, experts[t.name], names, family, config, weight_type) if t.name in experts else t
        for t in plan
    ]


def _gguf_name(
    names: gguf.TensorNameMap, checkpoint_name: str, shard: Path, family: Family, config: dict[str, Any]
) -> str:
    name = names.get_name(checkpoint_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise UserInputError(
            f"{shard}: tensor {checkpoint_name!r} has no llama.cpp name for architecture "
            f"{gguf.MODEL_ARCH_NAMES[family.arch]!r}; is this a plain {config['model_type']} checkpoint?"
        )
    return name


def _stacked(
    placeholder: PlannedTensor,
    parts: list[tuple[int, Path, Entry]],
    names: gguf.TensorNameMap,
    family: Family,
    config: dict[str, Any],
    weight_type: QType,
) -> PlannedTensor:
    """One layer's experts of one projection as the 3-D tensor llama.cpp reads, experts in order."""
    parts.sort(key=lambda part: part[0])
    count = config.get("num_local_experts") or config.get("num_experts")
    if [index for index, _, _ in parts] != list(range(int(count or 0))):
        raise UserInputError(
            f"{placeholder.name}: experts {[index for index, _, _ in parts]} in the checkpoint, and config.json "
            f"says {count}; the checkpoint is incomplete"
        )
    name = _gguf_name(names, placeholder.name, parts[0][1], family, config)
    shape = (len(parts), *parts[0][2].shape)
    return PlannedTensor(
        name, storage_type(shape, weight_type), parts=tuple((shard, entry) for _, shard, entry in parts)
    )
