"""GGUF of a vision-language model (Idefics3, SmolVLM's architecture): two files, as llama.cpp runs it.

- `model-<dtype>.gguf`: the text model, a llama GGUF (`to_gguf.py` writes it from the checkpoint's
  `model.text_model.*` and `lm_head` tensors, with the tokenizer, image tokens included).
- `mmproj-<dtype>.gguf`: the vision tower and its projector, in the layout of llama.cpp's multimodal
  library (libmtmd: `clip` architecture, projector type idefics3), which `llama-mtmd-cli`,
  `llama-server --mmproj` and llama-cpp-python load beside the text model.

llama.cpp reads an Idefics3 image its own way, and the model must have been made to read it the same
way, or the GGUF pair would see prompts laid out as in no training row:
- it always cuts the image into tiles of the tower's size plus a resized overview (the "global"
  image), each framed by tokens it looks up by their text (`<fake_token_around_image>`,
  `<global-img>`, and "\\n\\n" before the overview); the model's processor does the same only with
  image splitting on and a longest edge larger than one tile (SmolVLM's settings);
- it takes the tile size from the tower's `image_size` and the longest edge from the processor.
`llama_cpp_refusal` names the first of these a model breaks, so the export is refused before any
work with the reason, instead of written and found wrong later.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf

from lmforge.errors import UserInputError
from lmforge.export.gguf_encoding import PlannedTensor, QType, storage_type, write_complete
from lmforge.export.safetensors_stream import SafetensorsReader

# model_type of the vision-language models llama.cpp's idefics3 projector runs.
VISION_GGUF_TYPES = ("idefics3",)
_TEXT_PREFIX = "model.text_model."
_VISION_PREFIXES = ("model.vision_model.", "model.connector.")
# Tokens llama.cpp's libmtmd looks up by their text to frame each Idefics3 image (mtmd.cpp).
_FRAME_TEXTS = ("<fake_token_around_image>", "<global-img>", "\n\n", "\n")
MMPROJ_PREFIX = "mmproj-"


def is_vision_gguf_source(config: dict[str, Any]) -> bool:
    return "vision_config" in config


def text_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a vision-language config, as the llama GGUF writer reads one."""
    text = dict(config.get("text_config") or {})
    text["tie_word_embeddings"] = bool(
        config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    )
    text.setdefault("model_type", "llama")
    return text


def text_tensor_name(name: str) -> str | None:
    """The text model's checkpoint name of tensor `name` of the VLM (as a plain Llama names it), or
    None for the vision tower's and projector's tensors (they go to the mmproj file)."""
    if name.startswith(_VISION_PREFIXES):
        return None
    if name.startswith(_TEXT_PREFIX):
        return "model." + name[len(_TEXT_PREFIX) :]
    return name


def mmproj_file(model_file: Path) -> Path | None:
    """The vision projector GGUF written beside text model GGUF `model_file`, or None."""
    found = sorted(model_file.parent.glob(f"{MMPROJ_PREFIX}*.gguf"))
    return found[0] if len(found) == 1 else None


def image_processor_settings(source: Path) -> dict[str, Any]:
    """The image processor's settings saved with the model (processor_config.json in transformers
    5, preprocessor_config.json before), {} when there are none."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = source / name
        if path.is_file():
            saved = json.loads(path.read_text(encoding="utf-8"))
            return dict(saved.get("image_processor", saved))
    return {}


def llama_cpp_refusal(source: Path, config: dict[str, Any], tokenizer: Any) -> str | None:
    """Why llama.cpp would read this model's images differently from its own processor (the reason
    and the fix), or None when the GGUF pair will see what the model was trained on."""
    model_type = str(config.get("model_type"))
    if model_type not in VISION_GGUF_TYPES:
        return unsupported_family(model_type)
    settings = image_processor_settings(source)
    if not settings:
        return "the model's processor settings (processor_config.json) are missing; the images' tiling is unknown"
    reason = tiling_refusal(settings, int(config["vision_config"]["image_size"]))
    if reason is not None:
        return reason
    for text in _FRAME_TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            return (
                f"llama.cpp frames each image with the token {text!r}, looked up by its text, and this tokenizer "
                f"writes it as {len(ids)} tokens. Fix: export safetensors (or add the token to the tokenizer "
                "before training)"
            )
    return None


def unsupported_family(model_type: str) -> str:
    """Why a VLM family gets no GGUF here, with what to do instead."""
    if model_type == "llava":
        return (
            "llama.cpp's projector for 'llava' models is not written by lmforge (it writes idefics3's, SmolVLM's "
            "architecture), and llama.cpp's own convert_hf_to_gguf.py does not convert a transformers LLaVA-1.5 "
            "(CLIP tower) folder either: llama.cpp reads that family only through its legacy scripts "
            "(tools/mtmd/legacy-models: llava_surgery_v2.py, convert_image_encoder_to_gguf.py). Fix: export "
            "safetensors and serve it with transformers or vLLM"
        )
    return (
        f"llama.cpp's projector for {model_type!r} models is not written by lmforge (it writes idefics3's, "
        "SmolVLM's architecture). Fix: export safetensors, or run llama.cpp's convert_hf_to_gguf.py with "
        "--mmproj on this folder if llama.cpp supports the family"
    )


def tiling_refusal(settings: dict[str, Any], tile: int) -> str | None:
    """Why llama.cpp's tiling of images differs from that of an Idefics3 image processor with
    `settings` and a vision tower of `tile` px, or None when they agree."""
    longest = int((settings.get("size") or {}).get("longest_edge", 0))
    max_edge = int((settings.get("max_image_size") or {}).get("longest_edge", tile))
    if not settings.get("do_image_splitting", True) or longest <= max_edge:
        return (
            "llama.cpp always cuts an Idefics3 image into tiles plus an overview image, and this model's "
            f"processor does not (do_image_splitting {settings.get('do_image_splitting')}, longest edge "
            f"{longest} px, tile {max_edge} px): in llama.cpp it would see a layout of image tokens it was never "
            "trained on. Fix: train with SmolVLM's processor settings (image splitting on, size.longest_edge a "
            "multiple of max_image_size.longest_edge above it), or export safetensors"
        )
    if max_edge != tile:
        return (
            f"the processor's tiles are {max_edge} px and the vision tower's image_size is {tile} px; llama.cpp "
            "cuts tiles of the tower's size. Fix: save the processor with max_image_size.longest_edge = "
            f"{tile}, or export safetensors"
        )
    return None


def write_mmproj(
    source: Path, shards: list[Path], config: dict[str, Any], out: Path, dtype: str
) -> tuple[Path, dict[str, Any]]:
    """Write the vision tower and projector of the VLM at `source` as llama.cpp's mmproj GGUF in
    `out`: f32 when the text model is f32, else f16 (llama.cpp's converter's default; quantizing the
    tower costs more accuracy than it saves), embeddings kept in f32 as llama.cpp keeps them."""
    weight_type = QType.F32 if dtype == "f32" else QType.F16
    mm_dtype = "f32" if dtype == "f32" else "f16"
    vision = config["vision_config"]
    plan = _plan_vision_tensors(shards, int(vision["num_hidden_layers"]), weight_type)
    path = out / f"{MMPROJ_PREFIX}{mm_dtype}.gguf"
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    _add_vision_metadata(writer, source, config, mm_dtype)
    write_complete(writer, plan, partial, path)
    return path, {"mmproj": path.name, "mmproj_tensors": len(plan), "projector_type": "idefics3"}


def _plan_vision_tensors(shards: list[Path], layers: int, weight_type: QType) -> list[PlannedTensor]:
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, layers)
    plan = []
    for shard in shards:
        with SafetensorsReader(shard) as reader:
            entries = reader.entries
        for entry in entries:
            if not entry.name.startswith(_VISION_PREFIXES):
                continue
            name = names.get_name(entry.name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise UserInputError(
                    f"{shard}: vision tensor {entry.name!r} has no name in llama.cpp's projector layout; is this "
                    "a plain Idefics3 / SmolVLM checkpoint?"
                )
            # The patch and position embeddings stay f32, as llama.cpp's converter keeps them.
            embedding = ".embeddings." in entry.name
            qtype = QType.F32 if embedding else storage_type(entry.shape, weight_type)
            plan.append(PlannedTensor(name, qtype, shard, entry))
    return plan


def _add_vision_metadata(writer: gguf.GGUFWriter, source: Path, config: dict[str, Any], dtype: str) -> None:
    vision, text = config["vision_config"], text_model_config(config)
    settings = image_processor_settings(source)
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(source.resolve().name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
    writer.add_vision_projection_dim(int(text["hidden_size"]))
    writer.add_vision_image_size(int(vision["image_size"]))
    writer.add_vision_patch_size(int(vision["patch_size"]))
    writer.add_vision_embedding_length(int(vision["hidden_size"]))
    writer.add_vision_feed_forward_length(int(vision["intermediate_size"]))
    writer.add_vision_block_count(int(vision["num_hidden_layers"]))
    writer.add_vision_head_count(int(vision["num_attention_heads"]))
    writer.add_vision_attention_layernorm_eps(float(vision.get("layer_norm_eps", 1e-6)))
    writer.add_vision_image_mean([float(v) for v in settings["image_mean"]])
    writer.add_vision_image_std([float(v) for v in settings["image_std"]])
    writer.add_vision_projector_scale_factor(int(config.get("scale_factor", 2)))
    writer.add_vision_use_gelu(True)
    writer.add_vision_preproc_image_size(int(settings["size"]["longest_edge"]))


def is_mmproj(path: Path) -> bool:
    return path.name.startswith(MMPROJ_PREFIX)
