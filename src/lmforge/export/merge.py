"""`lmforge ckpt merge-lora`: a PEFT LoRA / DoRA adapter merged into its base, shard by shard.

PEFT's `merge_and_unload()` needs the whole model in memory. Here the base's safetensors
shards are rewritten tensor by tensor: untouched tensors are copied as bytes, adapted ones
merged with the same arithmetic as PEFT's layers (in fp32, cast back to their dtype), so
peak memory stays near the largest adapted tensor plus the adapter.

Adapters on parameters (PEFT's `target_parameters`: the fused experts of a transformers 5 MoE
model) are the exception: PEFT saves each one under its module's name with the parameter left out
(two on one experts module nest as `experts.base_layer.lora_*` and `experts.lora_*`), and whether a
3-D expert weight is stored (experts, in, out) or (experts, out, in) is the model class's business.
Only PEFT, with the model built, knows both, so such adapters merge through `merge_and_unload()`.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lmforge.ckpt.atomic import check_out_path, staged_directory
from lmforge.errors import UserInputError
from lmforge.export.safetensors_stream import INDEX_NAME, SafetensorsReader, write_header, write_tensor
from lmforge.export.to_safetensors import SIDE_FILES
from lmforge.upstream import route_deepspeed_logs
from lmforge.verbosity import progress_bar

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclass
class _Update:
    """What the adapter changes in one base tensor."""

    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    magnitude: torch.Tensor | None = None  # DoRA
    embedding: bool = False  # lora_embedding_A/B: the delta is (B @ A) transposed
    replacement: torch.Tensor | None = None  # modules_to_save: the trained copy replaces the tensor
    scale: float = 1.0


@dataclass
class MergeReport:
    out: Path
    merged_tensors: int
    replaced_tensors: int
    shards: list[str] = field(default_factory=list)


def merge_lora(base: Path, adapter: Path, out: Path) -> MergeReport:
    """Merge the PEFT adapter in `adapter` into the HF safetensors model in `base`, writing `out`.

    Tensors stream one at a time (see safetensors_stream): the ones the adapter leaves alone
    are copied as bytes, the adapted ones merged in fp32 and cast back to their dtype."""
    config = _adapter_config(adapter)
    check_out_path(out, base, adapter)
    if config.get("target_parameters"):
        return _merge_in_memory(base, adapter, out, config)
    updates = _read_updates(adapter, config)
    shards = _base_shards(base)
    tied = _tied_embedding_name(base, shards)
    untie = tied is not None and updates.get(tied, _Update()).replacement is not None
    pending = dict(updates)
    report = MergeReport(out, 0, 0, [s.name for s in shards])
    weight_map: dict[str, str] = {}
    with staged_directory(out) as staging:
        for shard in progress_bar(shards, desc="merge shards", unit="shard"):
            with SafetensorsReader(shard) as reader, (staging / shard.name).open("wb") as writer:
                # An untied copy of the original embedding goes right after it as the output head.
                layout = [(e.name, e.dtype, e.shape, e.end - e.start) for e in reader.entries]
                if untie:
                    layout = [row for item in layout for row in _with_head_copy(item, tied)]
                write_header(writer, layout, {**reader.metadata, "format": "pt"})
                for entry in reader.entries:
                    update = pending.pop(entry.name, None)
                    if update is None:
                        reader.copy_bytes(entry, writer)
                    else:
                        weight = reader.tensor(entry)
                        merged = _apply(
                            entry.name, weight, update, fan_in_fan_out=bool(config.get("fan_in_fan_out"))
                        )
                        write_tensor(writer, merged)
                        report.merged_tensors += update.replacement is None
                        report.replaced_tensors += update.replacement is not None
                    if untie and entry.name == tied:
                        reader.copy_bytes(entry, writer)
                weight_map.update(dict.fromkeys((row[0] for row in layout), shard.name))
        if pending:
            raise UserInputError(
                f"{adapter}: the adapter changes {len(pending)} tensors the base {base} does not have "
                f"(for example {sorted(pending)[:5]}); is this the base the adapter was trained on?"
            )
        _copy_side_files(base, adapter, staging)
        if (base / INDEX_NAME).is_file():  # the index names every tensor, the untied head included
            total = sum((staging / name).stat().st_size for name in report.shards)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (staging / INDEX_NAME).write_text(json.dumps(index, indent=2))
        if untie:
            _set_untied(staging)
    log.info(
        "merged %d adapted and %d replaced tensors into %s",
        report.merged_tensors,
        report.replaced_tensors,
        out,
    )
    return report


def _with_head_copy(
    row: tuple[str, str, tuple[int, ...], int], tied: str | None
) -> list[tuple[str, str, tuple[int, ...], int]]:
    """The layout row, followed by an output-head row of the same shape when it is the tied embedding.

    PEFT's modules_to_save trains a copy of the embedding for the input side only; the tied
    head kept the original, so the merged model stores the original as its own head."""
    return [row, (_OUTPUT_HEAD, *row[1:])] if row[0] == tied else [row]


_OUTPUT_HEAD = "lm_head.weight"


def _tied_embedding_name(base: Path, shards: list[Path]) -> str | None:
    """The input-embedding tensor the output head shares, when the base ties them and stores only it."""
    config = json.loads((base / "config.json").read_text()) if (base / "config.json").is_file() else {}
    text_config = config.get("text_config", config)
    if not text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
        return None
    names: set[str] = set()
    for shard in shards:
        with SafetensorsReader(shard) as reader:
            names.update(entry.name for entry in reader.entries)
    if _OUTPUT_HEAD in names:
        return None
    return next((n for n in sorted(names) if n.endswith(("embed_tokens.weight", "wte.weight"))), None)


def _set_untied(out: Path) -> None:
    config = json.loads((out / "config.json").read_text())
    config["tie_word_embeddings"] = False
    if "text_config" in config:
        config["text_config"]["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _merge_in_memory(base: Path, adapter: Path, out: Path, config: dict[str, Any]) -> MergeReport:
    """PEFT's own merge of an adapter that has adapters on parameters (see the module docstring):
    the base loaded whole in its own dtype, the adapter applied and merged, the model saved."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    log.info(
        "%s adapts parameters %s (fused MoE experts): merged by PEFT's merge_and_unload with the whole model "
        "in memory (their layout is the model class's)",
        adapter,
        config["target_parameters"],
    )
    shards = _base_shards(base)  # the same refusal as the streaming merge for a base without safetensors
    model_class = (
        AutoModelForSequenceClassification if config.get("task_type") == "SEQ_CLS" else AutoModelForCausalLM
    )
    route_deepspeed_logs()  # PEFT imports DeepSpeed, whose own handler prints "Setting accelerator to CPU"
    try:
        with warnings.catch_warnings():  # PEFT calls transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            model = model_class.from_pretrained(
                str(base), dtype="auto", trust_remote_code=False, use_safetensors=True
            )
            merged = PeftModel.from_pretrained(model, str(adapter), is_trainable=False).merge_and_unload()
    except (OSError, ValueError, RuntimeError) as err:
        raise UserInputError(f"{adapter}: PEFT cannot apply it to the base {base}: {err}") from None
    with staged_directory(out) as staging:
        merged.save_pretrained(str(staging))
        _copy_side_files(base, adapter, staging)
    adapted = _adapted_count(adapter)
    log.info("merged %d adapted tensors into %s", adapted, out)
    return MergeReport(out, adapted, 0, [p.name for p in shards])


def _adapted_count(adapter: Path) -> int:
    """Adapted tensors: one lora_A / lora_B pair each."""
    with safe_open(str(adapter / ADAPTER_WEIGHTS), framework="pt") as reader:
        return sum(1 for key in reader.keys() if ".lora_A." in key or ".lora_embedding_A" in key)  # noqa: SIM118


def _adapter_config(adapter: Path) -> dict[str, Any]:
    path = adapter / ADAPTER_CONFIG
    if not path.is_file() or not (adapter / ADAPTER_WEIGHTS).is_file():
        raise UserInputError(
            f"--adapter {adapter}: not a PEFT adapter directory (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
        )
    config = dict(json.loads(path.read_text()))
    if config.get("peft_type") != "LORA":
        raise UserInputError(
            f"{path}: peft_type {config.get('peft_type')!r}; merge-lora merges LORA adapters"
        )
    if config.get("bias", "none") != "none":
        raise UserInputError(
            f"{path}: bias={config['bias']!r} adapters train biases; merge them with PEFT's merge_and_unload()"
        )
    return config


def _read_updates(adapter: Path, config: dict[str, Any]) -> dict[str, _Update]:
    """Base tensor name -> its update, from the adapter's tensors."""
    updates: dict[str, _Update] = {}
    with safe_open(str(adapter / ADAPTER_WEIGHTS), framework="pt") as reader:
        for key in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
            name = key.removeprefix(_PREFIX)
            match = re.match(
                r"(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(\.weight)?$",
                name,
            )
            if match is None:  # a modules_to_save copy: it replaces the base tensor of that name
                updates.setdefault(name, _Update()).replacement = reader.get_tensor(key)
                continue
            module, part = match.group(1), match.group(2)
            update = updates.setdefault(f"{module}.weight", _Update())
            tensor = reader.get_tensor(key)
            if part in ("lora_A", "lora_embedding_A"):
                update.a = tensor
            elif part in ("lora_B", "lora_embedding_B"):
                update.b = tensor
            else:
                update.magnitude = tensor
            update.embedding = part.startswith("lora_embedding")
            update.scale = _scale(module, config)
    for name, update in updates.items():
        if update.replacement is None and (update.a is None or update.b is None):
            raise UserInputError(f"{adapter / ADAPTER_WEIGHTS}: {name} has only one of lora_A / lora_B")
    return updates


def _scale(module: str, config: dict[str, Any]) -> float:
    """lora_alpha / r (or / sqrt(r) with rsLoRA), honouring rank_pattern and alpha_pattern."""
    rank = _pattern_value(module, config.get("rank_pattern") or {}, config["r"])
    alpha = _pattern_value(module, config.get("alpha_pattern") or {}, config["lora_alpha"])
    return float(alpha / (rank**0.5 if config.get("use_rslora") else rank))


def _pattern_value(module: str, patterns: dict[str, Any], default: Any) -> Any:
    for pattern, value in patterns.items():  # PEFT matches a pattern against the module name's end
        if re.match(rf"(.*\.)?{pattern}$", module):
            return value
    return default


def _apply(name: str, weight: torch.Tensor, update: _Update, *, fan_in_fan_out: bool) -> torch.Tensor:
    if update.replacement is not None:
        if update.replacement.shape != weight.shape:
            raise UserInputError(
                f"{name}: the adapter's saved module has shape {tuple(update.replacement.shape)}, "
                f"the base {tuple(weight.shape)}; the base does not match the adapter"
            )
        return update.replacement.to(weight.dtype)
    assert update.a is not None and update.b is not None
    delta = update.b.float() @ update.a.float()
    if update.embedding or fan_in_fan_out:
        delta = delta.T
    if delta.shape != weight.shape:
        raise UserInputError(
            f"{name}: the adapter's update has shape {tuple(delta.shape)}, the base weight "
            f"{tuple(weight.shape)}; the base does not match the adapter (other architecture or size)"
        )
    merged = weight.float() + update.scale * delta
    if update.magnitude is not None:  # DoRA: rescale each output row to its learned magnitude
        norm = torch.linalg.norm(merged, dim=1)
        merged = (update.magnitude.float() / norm).view(-1, 1) * merged
    return merged.to(weight.dtype)


def _base_shards(base: Path) -> list[Path]:
    index = base / INDEX_NAME
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [base / f for f in files]
    single = base / "model.safetensors"
    if single.is_file():
        return [single]
    raise UserInputError(
        f"--base {base}: no model.safetensors or {INDEX_NAME}; point it at an HF model directory with safetensors weights"
    )


def _copy_side_files(base: Path, adapter: Path, out: Path) -> None:
    """The base's config; the tokenizer from the adapter, else from lmforge's
    final/ around an adapter/ directory, else from the base."""
    tokenizer_homes = [adapter, *([adapter.parent] if adapter.name == "adapter" else []), base]
    for name in SIDE_FILES:
        homes = [base] if name in ("config.json", "generation_config.json") else tokenizer_homes
        source = next((home / name for home in homes if (home / name).is_file()), None)
        if source is not None:
            shutil.copy2(source, out / name)
