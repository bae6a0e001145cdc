"""`lmforge ckpt consolidate`: a DeepSpeed ZeRO-1/2/3 or FSDP / torch-DCP sharded checkpoint
turned into one HF safetensors model directory, streaming one tensor at a time.

DeepSpeed's zero_to_fp32 unpickles every rank file in full (`weights_only=False`) and builds
the whole fp32 state dict before writing. Here each format's reader (zero_assembly,
dcp_checkpoint) gives every tensor as a TensorSource that reads it on demand, and this module
maps the names to the HF model's, picks the model weights and writes them shard by shard, so
peak memory stays near the largest tensor. config.json and the tokenizer are copied alongside.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmforge.ckpt.atomic import staged_directory
from lmforge.ckpt.dcp_checkpoint import dcp_sources
from lmforge.ckpt.tensor_source import TensorSource
from lmforge.ckpt.zero_checkpoint import find_zero_dir
from lmforge.config.model_kind import PROCESSOR_FILES, vision_model_type
from lmforge.errors import UserInputError
from lmforge.export.safetensors_stream import CODES, TensorSpec, parse_size, write_sharded
from lmforge.export.to_safetensors import FLOAT_DTYPES, SIDE_FILES
from lmforge.export.zero_assembly import zero_sources

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
MISSING_PROCESSOR = (
    "a vision-language model, but no processor settings (" + " / ".join(PROCESSOR_FILES) + ") next to "
    "the checkpoint: AutoProcessor cannot load the output; copy them into it from the model folder the "
    "run started from (model.path)"
)
# Module wrappers that insert a path segment: torch.compile, FSDP1 and activation checkpointing.
_WRAPPER_SEGMENTS = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


@dataclass
class ConsolidateReport:
    out: Path
    format: str  # "deepspeed-zero" or "torch-dcp"
    world_size: int
    tensors: int
    parameters: int
    files: list[str] = field(default_factory=list)
    zero_stage: int | None = None
    step: int | None = None
    tokenizer: bool = False
    # A vision-language model's processor settings were copied (None: config.json names a text model).
    processor: bool | None = None
    skipped: list[str] = field(default_factory=list)  # checkpoint tensors that are not model weights


def consolidate(
    path: Path,
    out: Path,
    *,
    max_shard_size: str = "5GB",
    dtype: str = "f32",
    config_dir: Path | None = None,
) -> ConsolidateReport:
    """Write the model weights of the sharded checkpoint at `path` as an HF model in `out`.

    `path` is an HF Trainer checkpoint-N/ (with `latest` and global_stepN/, or with an FSDP
    pytorch_model_fsdp_0/), a DeepSpeed global_stepN/ directory, or a torch DCP directory
    (*.distcp + .metadata). config.json and
    the tokenizer are taken from `config_dir`, else from the checkpoint directory or its parent;
    without a config.json the checkpoint is refused (the weights alone cannot be loaded)."""
    _check_arguments(path, dtype)
    max_bytes = parse_size(max_shard_size)
    _check_out(path, out)
    zero_dir = find_zero_dir(path)
    # HF Trainer / accelerate FSDP checkpoints keep the DCP directory inside checkpoint-N.
    inner = [d for d in sorted(path.glob("pytorch_model_fsdp_*")) if (d / ".metadata").is_file()]
    if zero_dir is None and not (path / ".metadata").is_file() and len(inner) == 1:
        path = inner[0]
    if zero_dir is not None:
        picked, side, report = _read_zero(path, zero_dir, out, config_dir)
    elif (path / ".metadata").is_file():
        picked, side, report = _read_dcp(path, out, config_dir)
    else:
        raise UserInputError(
            f"{path}: not a sharded checkpoint lmforge can consolidate; give an HF Trainer checkpoint-N "
            "directory (with `latest` and global_stepN/), a DeepSpeed global_stepN directory, or a torch "
            "DCP directory (*.distcp files and .metadata)"
        )
    _write(picked, out, side, FLOAT_DTYPES[dtype], max_bytes, report)
    return report


def _check_arguments(path: Path, dtype: str) -> None:
    if not path.exists():
        raise UserInputError(f"{path}: no such file or directory")
    if dtype not in FLOAT_DTYPES:
        raise UserInputError(f"--dtype {dtype!r}: use one of {', '.join(FLOAT_DTYPES)}")


def _check_out(path: Path, out: Path) -> None:
    resolved_out, resolved_path = out.resolve(), path.resolve()
    if resolved_out == resolved_path or {resolved_out, resolved_path} & {
        *resolved_out.parents,
        *resolved_path.parents,
    }:
        # out is replaced as a whole: it must neither hold nor lie inside the checkpoint
        raise UserInputError(
            f"--out {out}: overlaps the checkpoint {path}; write the model to a new directory"
        )


def _read_zero(
    path: Path, zero_dir: Path, out: Path, config_dir: Path | None
) -> tuple[dict[str, TensorSource], Path, ConsolidateReport]:
    sources, shared, info = zero_sources(zero_dir)  # checks the rank files first
    side = _side_dir(config_dir, [zero_dir.parent, zero_dir.parent.parent])
    # config.json silent: DeepSpeed saw the head shared with the embedding, so store it once.
    ties = _config_ties(side)
    picked = _select(path, sources, shared, ties is not False)
    report = ConsolidateReport(out, "deepspeed-zero", info.world_size, 0, 0, zero_stage=info.stage)
    report.step = info.step
    return picked, side, report


def _read_dcp(
    path: Path, out: Path, config_dir: Path | None
) -> tuple[dict[str, TensorSource], Path, ConsolidateReport]:
    sources, skipped, world_size = dcp_sources(path)
    side = _side_dir(config_dir, [path, path.parent])
    report = ConsolidateReport(out, "torch-dcp", world_size, 0, 0, skipped=skipped)
    if skipped:
        log.warning(
            "%s: left out %d tensors that are not model weights (for example %s)",
            path,
            len(skipped),
            skipped[:3],
        )
    # A DCP state dict lists a tied head under its own name too; dropped only when config.json ties it.
    picked = _select(path, sources, {"lm_head.weight"}, _config_ties(side) is True)
    return picked, side, report


def _write(
    picked: dict[str, TensorSource],
    out: Path,
    side: Path,
    dtype: torch.dtype,
    max_bytes: int,
    report: ConsolidateReport,
) -> None:
    def target(source: TensorSource) -> torch.dtype:
        return dtype if source.dtype.is_floating_point else source.dtype

    specs = [TensorSpec(name, CODES[target(s)], s.shape) for name, s in picked.items()]

    def tensor_for(spec: TensorSpec) -> torch.Tensor:
        source = picked[spec.name]
        return source.read().to(target(source)).contiguous()

    with staged_directory(out) as staging:
        files = write_sharded(staging, specs, tensor_for, max_shard_bytes=max_bytes, desc="consolidate")
        report.tokenizer = _copy_side_files(side, staging, dtype)
        report.processor = _has_processor(staging)
    report.files = [f.name for f in files]
    report.tensors = len(specs)
    report.parameters = sum(math.prod(s.shape) for s in specs)
    if not report.tokenizer:
        log.warning("%s: no tokenizer files next to the checkpoint; %s holds the model only", side, out)
    if report.processor is False:
        log.warning("%s: %s", side, MISSING_PROCESSOR)


# ---------------------------------------------------------------- names, config, side files


def _side_dir(config_dir: Path | None, candidates: list[Path]) -> Path:
    """The directory holding config.json (and usually the tokenizer) for this checkpoint."""
    if config_dir is not None:
        if not (config_dir / "config.json").is_file():
            raise UserInputError(f"--config {config_dir}: no config.json there; give an HF model directory")
        return config_dir
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    raise UserInputError(
        f"{candidates[0]}: no config.json next to the checkpoint (looked in "
        f"{', '.join(str(c) for c in candidates)}); pass --config DIR, an HF model directory of the "
        "same architecture (for example the model training started from)"
    )


def _config_ties(side: Path) -> bool | None:
    """Whether config.json ties the output head to the input embedding (None: it does not say)."""
    config = json.loads((side / "config.json").read_text())
    text = config.get("text_config") or {}
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    return None if tied is None else bool(tied)


def _hf_name(key: str) -> str:
    """A checkpoint key without the segments module wrappers insert (torch.compile, FSDP1,
    activation checkpointing, DDP's leading "module.")."""
    parts = [part for part in key.split(".") if part not in _WRAPPER_SEGMENTS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _select(
    path: Path, sources: dict[str, TensorSource], shared: set[str], ties: bool
) -> dict[str, TensorSource]:
    """The model's tensors under their HF names, in checkpoint order. `shared` names are copies of
    another tensor (a tied head): left out when config.json ties them (as save_pretrained does)."""
    picked: dict[str, TensorSource] = {}
    origin: dict[str, str] = {}
    for key, source in sources.items():
        name = _hf_name(key)
        if ties and (key in shared or name in shared):
            continue
        if name in picked:
            raise UserInputError(f"{path}: {origin[name]!r} and {key!r} are both the model's {name!r}")
        picked[name], origin[name] = source, key
    if not picked:
        raise UserInputError(f"{path}: holds no model tensors")
    return picked


def _copy_side_files(side: Path, staging: Path, dtype: torch.dtype) -> bool:
    for name in SIDE_FILES:
        if (side / name).is_file():
            shutil.copy2(side / name, staging / name)
    config = json.loads((staging / "config.json").read_text())
    # The weights are written in `dtype`; say so, or from_pretrained would cast them back.
    keys = [key for key in ("dtype", "torch_dtype") if key in config] or ["dtype"]
    for key in keys:
        config[key] = str(dtype).removeprefix("torch.")
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return any((staging / name).is_file() for name in _TOKENIZER_FILES)


def _has_processor(model_dir: Path) -> bool | None:
    """Whether a vision-language model's folder holds its processor settings (None: a text model).
    lmforge's checkpoints carry them since issue 39; older ones and other tools' do not."""
    if vision_model_type(model_dir) is None:
        return None
    return any((model_dir / name).is_file() for name in PROCESSOR_FILES)
