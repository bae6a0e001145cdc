"""`lmforge ckpt consolidate`: a DeepSpeed ZeRO-1/2/3 or FSDP / torch-DCP sharded checkpoint
turned into one HF safetensors model directory, streaming one tensor at a time.

DeepSpeed's zero_to_fp32 unpickles every rank file in full (`weights_only=False`) and builds
the whole fp32 state dict before writing. Here the rank files are opened with
`torch.load(weights_only=True, mmap=True)`: unpickling creates only tensors, plain containers
and the few inert DeepSpeed classes listed in ZERO_SAFE_GLOBALS, and no tensor data is read
until a slice of it is copied. Each output tensor is assembled from its rank slices exactly as
zero_to_fp32 does (its bytes read with pread, not through the mapping) and written, so peak
memory stays near the largest tensor. DCP checkpoints are read tensor by tensor through torch's
FileSystemReader, with its metadata file unpickled under an allow-list (torch itself uses a
plain `pickle.load` there).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pickle
import re
import shutil
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lmforge.ckpt.safetensors_stream import CODES, TensorSpec, parse_size, write_sharded
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)

# Files copied next to the weights: the model's config and its tokenizer.
_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
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
    skipped: list[str] = field(default_factory=list)  # checkpoint tensors that are not model weights


@dataclass(frozen=True)
class _Source:
    """A tensor of the checkpoint: its shape, dtype and how to read it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


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
    if not path.exists():
        raise UserInputError(f"{path}: no such file or directory")
    if dtype not in _DTYPES:
        raise UserInputError(f"--dtype {dtype!r}: use one of {', '.join(_DTYPES)}")
    max_bytes = parse_size(max_shard_size)
    resolved_out, resolved_path = out.resolve(), path.resolve()
    if resolved_out == resolved_path or {resolved_out, resolved_path} & {
        *resolved_out.parents,
        *resolved_path.parents,
    }:
        # out is replaced as a whole: it must neither hold nor lie inside the checkpoint
        raise UserInputError(
            f"--out {out}: overlaps the checkpoint {path}; write the model to a new directory"
        )
    zero_dir = find_zero_dir(path)
    # HF Trainer / accelerate FSDP checkpoints keep the DCP directory inside checkpoint-N.
    inner = [d for d in sorted(path.glob("pytorch_model_fsdp_*")) if (d / ".metadata").is_file()]
    if zero_dir is None and not (path / ".metadata").is_file() and len(inner) == 1:
        path = inner[0]
    if zero_dir is not None:
        sources, shared, info = _zero_sources(zero_dir)  # checks the rank files first
        side = _side_dir(config_dir, [zero_dir.parent, zero_dir.parent.parent])
        # config.json silent: DeepSpeed saw the head shared with the embedding, so store it once.
        ties = _config_ties(side)
        picked = _select(path, sources, shared, ties is not False)
        report = ConsolidateReport(out, "deepspeed-zero", info.world_size, 0, 0, zero_stage=info.stage)
        report.step = info.step
    elif (path / ".metadata").is_file():
        sources, skipped, world_size = _dcp_sources(path)
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
    else:
        raise UserInputError(
            f"{path}: not a sharded checkpoint lmforge can consolidate; give an HF Trainer checkpoint-N "
            "directory (with `latest` and global_stepN/), a DeepSpeed global_stepN directory, or a torch "
            "DCP directory (*.distcp files and .metadata)"
        )
    _write(picked, out, side, _DTYPES[dtype], max_bytes, report)
    return report


def _write(
    picked: dict[str, _Source],
    out: Path,
    side: Path,
    dtype: torch.dtype,
    max_bytes: int,
    report: ConsolidateReport,
) -> None:
    def target(source: _Source) -> torch.dtype:
        return dtype if source.dtype.is_floating_point else source.dtype

    specs = [TensorSpec(name, CODES[target(s)], s.shape) for name, s in picked.items()]

    def tensor_for(spec: TensorSpec) -> torch.Tensor:
        source = picked[spec.name]
        return source.read().to(target(source)).contiguous()

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        files = write_sharded(staging, specs, tensor_for, max_shard_bytes=max_bytes, desc="consolidate")
        report.tokenizer = _copy_side_files(side, staging, dtype)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    report.files = [f.name for f in files]
    report.tensors = len(specs)
    report.parameters = sum(math.prod(s.shape) for s in specs)
    if not report.tokenizer:
        log.warning("%s: no tokenizer files next to the checkpoint; %s holds the model only", side, out)


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


def _select(path: Path, sources: dict[str, _Source], shared: set[str], ties: bool) -> dict[str, _Source]:
    """The model's tensors under their HF names, in checkpoint order. `shared` names are copies of
    another tensor (a tied head): left out when config.json ties them (as save_pretrained does)."""
    picked: dict[str, _Source] = {}
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
    for name in _SIDE_FILES:
        if (side / name).is_file():
            shutil.copy2(side / name, staging / name)
    config = json.loads((staging / "config.json").read_text())
    # The weights are written in `dtype`; say so, or from_pretrained would cast them back.
    keys = [key for key in ("dtype", "torch_dtype") if key in config] or ["dtype"]
    for key in keys:
        config[key] = str(dtype).removeprefix("torch.")
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return any((staging / name).is_file() for name in _TOKENIZER_FILES)


# ---------------------------------------------------------------- DeepSpeed ZeRO


class _Inert:
    """Stand-in for a DeepSpeed class in a checkpoint: unpickling only fills its __dict__."""


class _ZeroStage(int):
    """Stand-in for deepspeed's ZeroStageEnum, an int enum pickled as ZeroStageEnum(stage)."""


# What DeepSpeed's rank files hold besides tensors, containers and numbers. Each name maps to an
# inert lmforge stand-in (never the DeepSpeed class), so unpickling runs no DeepSpeed code.
ZERO_SAFE_GLOBALS: list[Any] = [
    # optimizer_state_dict.zero_stage: the stage number.
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    # optimizer_state_dict.loss_scaler: loss-scale numbers (fp16 / static).
    (_Inert, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Inert, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    # optimizer_state_dict.param_slice_mappings (ZeRO-1/2): (numel, start) of each parameter slice.
    (_Inert, "deepspeed.utils.tensor_fragment.fragment_address"),
]
_RANK_FILE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_(model|optim)_states\.pt")


def load_rank_file(path: Path) -> dict[str, Any]:
    """A DeepSpeed rank file, unpickled with weights_only and memory-mapped (no tensor data read)."""
    with torch.serialization.safe_globals(ZERO_SAFE_GLOBALS):
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:
            raise UserInputError(
                f"{path}: holds an object lmforge does not unpickle ({str(err).splitlines()[0]}); it is not "
                "a DeepSpeed rank file lmforge knows. Convert it with DeepSpeed's zero_to_fp32.py only if "
                "you trust its origin"
            ) from None
        except RuntimeError as err:
            raise UserInputError(
                f"{path}: unreadable ({err}); the file is damaged or not a torch file"
            ) from None
    if not isinstance(loaded, dict):
        raise UserInputError(f"{path}: not a DeepSpeed rank file (holds a {type(loaded).__name__})")
    return loaded


def find_zero_dir(path: Path) -> Path | None:
    """The DeepSpeed tag directory (global_stepN) of `path`, or None when `path` is not one."""
    if path.is_dir() and (path / "latest").is_file():
        tag = (path / "latest").read_text().strip()
        if not (path / tag).is_dir():
            raise UserInputError(
                f"{path / 'latest'}: names {tag!r} but {path / tag} does not exist; the checkpoint is "
                "incomplete (give the global_stepN directory that exists instead)"
            )
        return path / tag
    if path.is_dir() and any(_RANK_FILE.fullmatch(p.name) for p in path.glob("*_states.pt")):
        return path
    return None


@dataclass
class ZeroInfo:
    stage: int
    world_size: int
    step: int | None
    ds_version: str | None
    model_files: list[Path]
    optim_files: list[Path]
    missing: list[str]
    unexpected: list[str]  # rank files beyond the world size (an older, larger save left behind)


def describe_zero(zero_dir: Path) -> ZeroInfo:
    """Stage, world size, step and completeness of a ZeRO tag directory, from the small pickles only."""
    files = {p.name: _RANK_FILE.fullmatch(p.name) for p in zero_dir.glob("*_states.pt")}
    matched = {name: m for name, m in files.items() if m}
    if any(m.group(2) != "00" for m in matched.values()) or list(zero_dir.glob("layer_*")):
        raise UserInputError(
            f"{zero_dir}: a tensor- or pipeline-parallel DeepSpeed checkpoint; lmforge consolidates "
            "data-parallel ZeRO checkpoints only (use DeepSpeed's ds_to_universal.py for this one)"
        )
    optim = sorted((n for n, m in matched.items() if m.group(3) == "optim"), key=_rank_of)
    model = sorted((n for n, m in matched.items() if m.group(3) == "model"), key=_rank_of)
    if not model and not optim:
        raise UserInputError(f"{zero_dir}: no DeepSpeed *_model_states.pt or *_optim_states.pt files")
    model_state = load_rank_file(zero_dir / model[0]) if model else {}
    stage3 = any(matched[n].group(1) is not None for n in model)
    stage, world_size = None, model_state.get("dp_world_size")
    if optim:
        optim_state = load_rank_file(zero_dir / optim[0]).get("optimizer_state_dict", {})
        stage = int(optim_state["zero_stage"]) if "zero_stage" in optim_state else None
        partitions = optim_state.get("partition_count")
        world_size = max(partitions) if isinstance(partitions, list) else partitions or world_size
    if stage is None:
        stage = 3 if stage3 else 2  # stage 1 and 2 files look alike; only the optimizer file says which
    if not isinstance(world_size, int):
        raise UserInputError(
            f"{zero_dir}: the rank files do not say the world size; the checkpoint is damaged"
        )
    expected = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)]
    if stage == 3:
        expected += [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)]
    else:
        expected.append("mp_rank_00_model_states.pt")
    return ZeroInfo(
        stage=stage,
        world_size=world_size,
        step=model_state.get("global_steps"),
        ds_version=model_state.get("ds_version"),
        model_files=[zero_dir / n for n in model if n in expected],
        optim_files=[zero_dir / n for n in optim if n in expected],
        missing=[name for name in expected if name not in files],
        unexpected=sorted(name for name in matched if name not in expected),
    )


def _rank_of(name: str) -> int:
    match = _RANK_FILE.fullmatch(name)
    return int(match.group(1) or 0) if match else 0


def _zero_sources(zero_dir: Path) -> tuple[dict[str, _Source], set[str], ZeroInfo]:
    """Every tensor zero_to_fp32 would return, in its order, each read lazily from the mmap'd rank files."""
    info = describe_zero(zero_dir)
    if info.missing:
        raise UserInputError(
            f"{zero_dir}: incomplete ZeRO-{info.stage} checkpoint of world size {info.world_size}: missing "
            f"{', '.join(info.missing)}; a rank did not finish saving. Use an earlier complete checkpoint"
        )
    if info.unexpected:
        raise UserInputError(
            f"{zero_dir}: rank files of more ranks than the world size {info.world_size}: "
            f"{', '.join(info.unexpected)}; probably left by an earlier save. Remove them or use another checkpoint"
        )
    key = "fp32_flat_groups" if info.stage == 3 else "single_partition_of_fp32_groups"
    optim_states = [load_rank_file(f)["optimizer_state_dict"] for f in info.optim_files]
    flat = [state[key] for state in optim_states]  # [rank][group] -> 1-D fp32 tensor
    paddings = optim_states[0].get("param_alignment_paddings")
    models = [load_rank_file(f) for f in info.model_files]
    files = _RankFiles([*info.optim_files, *info.model_files])  # after loading: their mappings are live
    head = models[0]
    sources: dict[str, _Source] = {}
    module = head["module"]
    for name in head["buffer_names"]:  # zero_to_fp32 restores buffers to fp32
        buffer = module[name]
        sources[name] = _Source(
            tuple(buffer.shape),
            torch.float32 if buffer.is_floating_point() else buffer.dtype,
            partial(_buffer, buffer),
        )
    shapes = [dict(group) for group in head["param_shapes"]]
    if info.stage == 3:
        _zero3_frozen(files, sources, models)
        _zero3_trainable(files, sources, shapes, flat, info.world_size)
    else:
        for name, fragment in (head.get("frozen_param_fragments") or {}).items():
            sources[name] = _Source(
                tuple(fragment.shape),
                fragment.dtype,
                partial(files.gather, [fragment], fragment.numel(), tuple(fragment.shape)),
            )
        _zero2_trainable(files, sources, shapes, flat, paddings, info.world_size)
    shared = set()
    for name, origin in head["shared_params"].items():
        if origin in sources:
            sources[name] = sources[origin]
            shared.add(name)
    return sources, shared, info


def _span(parts: list[torch.Tensor], start: int, length: int) -> list[torch.Tensor]:
    """The views of `parts`, read as one concatenated vector, that cover [start, start + length)."""
    views, base = [], 0
    for part in parts:
        size = part.numel()
        lo, hi = max(start, base), min(start + length, base + size)
        if lo < hi:
            views.append(part[lo - base : hi - base])
        base += size
    return views


def _buffer(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.float() if buffer.is_floating_point() else buffer.clone()


def _zero2_trainable(
    files: _RankFiles,
    sources: dict[str, _Source],
    shapes: list[dict[str, torch.Size]],
    flat: list[list[torch.Tensor]],
    paddings: list[list[int]] | None,
    world_size: int,
) -> None:
    """ZeRO-1/2: group i is the concatenation of every rank's partition i; parameters lie in it in order."""
    align = 2 * world_size  # zero_to_fp32's sanity check: both ends are padded to 2 * world_size
    for group, group_shapes in enumerate(shapes):
        parts = [rank_groups[group] for rank_groups in flat]
        offset, available = 0, sum(p.numel() for p in parts)
        for index, (name, shape) in enumerate(group_shapes.items()):
            numel = math.prod(shape)
            sources[name] = _Source(
                tuple(shape),
                torch.float32,
                partial(files.gather, _span(parts, offset, numel), numel, tuple(shape)),
            )
            offset += numel + (paddings[group][index] if paddings is not None else 0)
        if align * math.ceil(offset / align) != align * math.ceil(available / align):
            raise UserInputError(
                f"ZeRO group {group}: used {offset} of {available} elements; the checkpoint is damaged"
            )


def _zero3_trainable(
    files: _RankFiles,
    sources: dict[str, _Source],
    shapes: list[dict[str, torch.Size]],
    flat: list[list[torch.Tensor]],
    world_size: int,
) -> None:
    """ZeRO-3: every parameter is split into world_size equal (padded) slices, one per rank, in order."""
    offset = 0
    for group_shapes in shapes:
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world_size)

            views = [view for rank in flat for view in _span(rank, offset, part)]
            sources[name] = _Source(
                tuple(shape), torch.float32, partial(files.gather, views, numel, tuple(shape))
            )
            offset += part
    available = sum(g.numel() for g in flat[0]) * world_size
    if offset * world_size != available:
        raise UserInputError(
            f"ZeRO-3: used {offset * world_size} of {available} elements; the checkpoint is damaged"
        )


def _zero3_frozen(files: _RankFiles, sources: dict[str, _Source], models: list[dict[str, Any]]) -> None:
    for name, shape in (models[0].get("frozen_param_shapes") or {}).items():
        fragments = [m["frozen_param_fragments"][name] for m in models]
        sources[name] = _Source(
            tuple(shape),
            fragments[0].dtype,
            partial(files.gather, fragments, math.prod(shape), tuple(shape)),
        )


class _RankFiles:
    """Reads the bytes behind tensors of mmap'd rank files with pread instead of through the mapping.

    Pages of a memory-mapped file stay resident once touched, so copying every slice through the
    mapping would leave the whole checkpoint in this process's memory (and pay a page fault per
    4 KiB). /proc/self/maps says where each rank file is mapped and from which file offset, which
    gives the file offset of any tensor in it; its bytes are then read straight into the output
    tensor. Where that is not known (no /proc) the tensor is copied through the mapping. Made
    after the files are loaded, while the loaded objects (and so their mappings) are alive."""

    def __init__(self, paths: list[Path]) -> None:
        self.maps: list[tuple[int, int, int, int]] = []  # (start, end, file offset, fd)
        fds: dict[str, int] = {}
        self._closer = weakref.finalize(self, _close_all, fds)
        maps = Path("/proc/self/maps")
        targets = {str(path.resolve()) for path in paths}
        for line in maps.read_text().splitlines() if maps.is_file() else []:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5] in targets:
                if fields[5] not in fds:
                    fds[fields[5]] = os.open(fields[5], os.O_RDONLY)
                start, end = (int(x, 16) for x in fields[0].split("-"))
                self.maps.append((start, end, int(fields[2], 16), fds[fields[5]]))

    def gather(self, views: list[torch.Tensor], numel: int, shape: tuple[int, ...]) -> torch.Tensor:
        """The first numel elements of the concatenated views (ZeRO pads slices), shaped."""
        result = torch.empty(sum(v.numel() for v in views), dtype=views[0].dtype)
        position = 0
        for view in views:
            self._copy(result[position : position + view.numel()], view.reshape(-1))
            position += view.numel()
        return result[:numel].view(shape)

    def _copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        address, size = src.data_ptr(), src.numel() * src.element_size()
        found = next(
            (
                (fd, offset + address - start)
                for start, end, offset, fd in self.maps
                if start <= address and address + size <= end
            ),
            None,
        )
        if found is None or not src.is_contiguous() or size == 0:
            dest.copy_(src)
            return
        fd, position = found
        buffer = dest.view(torch.uint8).numpy().data
        done = 0
        while done < size:
            count = os.preadv(fd, [buffer[done:]], position + done)
            if count <= 0:
                raise UserInputError(
                    f"a rank file ended early at byte {position + done}; the checkpoint is damaged"
                )
            done += count


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)


# ---------------------------------------------------------------- torch DCP (FSDP)


def _safe_layout(name: str) -> torch.layout:
    layout = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return layout


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle of torch's own metadata dataclasses: allow those and nothing else."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.serialization" and name == "_get_layout":
            return _safe_layout
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in self._ALLOWED.get(module, set()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(path: Path) -> Any:
    """The Metadata of a DCP directory, unpickled under an allow-list."""
    try:
        return _MetadataUnpickler(io.BytesIO((path / ".metadata").read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
        raise UserInputError(f"{path / '.metadata'}: not DCP metadata lmforge can read ({err})") from None


def dcp_world_size(metadata: Any) -> tuple[int, list[str]]:
    """Ranks that wrote the checkpoint (from the __RANK_N.distcp file names) and the files it needs."""
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    ranks = {int(m.group(1)) for f in files if (m := re.match(r"__(\d+)_", f))}
    return (max(ranks) + 1 if ranks else 1), files


# Top-level entries that training loops (torchtitan, torchtune, hand-written FSDP loops) save next
# to the model.
_NOT_MODEL = {"optim", "optimizer", "optimizers", "lr_scheduler", "lr_schedulers", "scheduler", "dataloader"}


def _dcp_model_keys(metadata: Any, fqns: list[str]) -> tuple[dict[str, str], list[str]]:
    """Model tensor name for each DCP key that is one, and the keys that are not.

    planner_data keeps each key's path in the saved nested dict. With a "model" entry
    (`dcp.save({"model": ..., "optim": ...})`, or torch's AppState recipe `{"app": {"model": ...}}`)
    the model is what lies under it; without one (torchtitan saves the model's keys flat) it is
    everything but the optimizer and friends."""
    planner = metadata.planner_data or {}
    paths = {fqn: tuple(str(part) for part in planner.get(fqn, (fqn,))) for fqn in fqns}
    under = {fqn: _model_entry(parts) for fqn, parts in paths.items()}
    nested = any(index is not None for index in under.values())
    names, skipped = {}, []
    for fqn, parts in paths.items():
        index = under[fqn]
        if nested and index is not None:
            names[fqn] = ".".join(parts[index + 1 :])
        elif not nested and parts[0] not in _NOT_MODEL:
            names[fqn] = fqn
        else:
            skipped.append(fqn)
    return names, skipped


def _model_entry(parts: tuple[str, ...]) -> int | None:
    """Where a "model" container sits in a key's path (not under an optimizer entry), if it does."""
    for index, part in enumerate(parts[:-1]):
        if part in _NOT_MODEL:
            return None
        if part == "model":
            return index
    return None


def _dcp_sources(path: Path) -> tuple[dict[str, _Source], list[str], int]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

    metadata = read_dcp_metadata(path)
    world_size, files = dcp_world_size(metadata)
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise UserInputError(
            f"{path}: incomplete DCP checkpoint of {world_size} ranks: missing {', '.join(missing)}; a rank "
            "did not finish saving. Use an earlier complete checkpoint"
        )

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    reader = SafeReader(str(path))

    def read(fqn: str, entry: Any) -> torch.Tensor:
        # One tensor per load: the planner reads only the chunks of the keys asked for.
        one = {fqn: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)}
        with warnings.catch_warnings():  # "torch.distributed is disabled": intended, no process group
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(one, storage_reader=reader, no_dist=True)
        return one[fqn]

    entries = {k: e for k, e in metadata.state_dict_metadata.items() if isinstance(e, TensorStorageMetadata)}
    names, skipped = _dcp_model_keys(metadata, list(entries))
    sources = {
        name: _Source(
            tuple(entries[fqn].size), entries[fqn].properties.dtype, partial(read, fqn, entries[fqn])
        )
        for fqn, name in names.items()
    }
    return sources, skipped, world_size
