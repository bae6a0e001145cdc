"""The data stage as a run sees it: the tokenizer, the datasets, the collator and the data report.

`train.stage` decides the path: pretraining packs text into fixed blocks; SFT renders
conversations with the chat template and batches them padded, packed or padding-free
(the collator is chosen here); preference and KTO rows go to TRL, which batches them itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase, default_data_collator

from lmforge.config import LmforgeConfig
from lmforge.config.stages import stage_spec
from lmforge.data.tokenizer_source import obtain_tokenizer
from lmforge.errors import UserInputError
from lmforge.run_layout import RunPaths


@dataclass
class RunData:
    """What the Trainer needs from the data stage, whatever the training stage."""

    train: Dataset
    eval: Dataset | None
    collator: Callable[[list[Any]], dict[str, Any]] | None  # None: the TRL trainer's own
    fingerprint: str
    report: dict[str, Any]
    # A stream's report from its readers' states, rewritten while training (None: the report is final).
    stream_report: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None
    # A vision-language model's processor (None for text rows): the TRL trainers that batch image
    # rows themselves (dpo) take it as processing_class; a vision preset run saves it.
    processor: Any = None

    @property
    def streaming(self) -> bool:
        """The training set is read as a stream: no length, a position instead."""
        return isinstance(self.train, torch.utils.data.IterableDataset)

    @property
    def image_processor(self) -> Any:
        """What turns image files into the model's pixel inputs; None for text data."""
        if self.processor is not None:
            return self.processor.image_processor
        return getattr(self.collator, "image_processor", None)  # VisionCollator's

    @property
    def conversational_rows(self) -> bool:
        """Preference / KTO rows that TRL tokenizes and batches itself (no token ids here)."""
        return self.collator is None


def resolve_cache_dir(cfg: LmforgeConfig) -> Path:
    """data.cache_dir, else $LMFORGE_CACHE, else ~/.cache/lmforge."""
    if cfg.data.cache_dir is not None:
        return cfg.data.cache_dir
    return Path(os.environ.get("LMFORGE_CACHE", Path.home() / ".cache" / "lmforge"))


def prepare_data_for_run(
    cfg: LmforgeConfig,
    paths: RunPaths,
    *,
    write_report: bool = True,
    for_training: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[PreTrainedTokenizerBase, RunData]:
    """Tokenizer and prepared data for the run in `paths`; writes data_report.json there
    (rank 0 of a distributed run; the others read the same cache and report nothing).
    `for_training` also checks that the data fills one micro-batch (eval needs no such check).
    `rank` / `world_size`: this process's place among the data-parallel ranks, whose parts of a
    stream differ."""
    paths.root.mkdir(parents=True, exist_ok=True)
    cache_dir = resolve_cache_dir(cfg)
    tokenizer = obtain_tokenizer(cfg, paths, cache_dir)
    data_kind = stage_spec(cfg.train.stage).data_kind
    if data_kind == "text" and cfg.data.streaming:
        data = _text_stream(cfg, tokenizer, cache_dir, rank, world_size)
    elif data_kind == "text" and cfg.data.store is not None:
        data = _token_store_data(cfg, tokenizer, cache_dir)
    elif data_kind == "text":
        data = _pretraining_data(cfg, tokenizer, cache_dir)
    elif data_kind == "chat":
        data = _sft_data(cfg, tokenizer, cache_dir, paths, rank, world_size)
    else:
        data = _preference_data(cfg, tokenizer, cache_dir, paths)
    if write_report:
        paths.data_report.write_text(json.dumps(data.report, indent=2), encoding="utf-8")
    if for_training and not data.streaming:  # a stream has no size to check; it starts over at its end
        check_micro_batch_fits(cfg, data)
    return tokenizer, data


def prepare_run_data(
    cfg: LmforgeConfig, *, for_training: bool = True
) -> tuple[Path, PreTrainedTokenizerBase, RunData]:
    """`lmforge prepare`: run the data stage alone; returns where the report went and the data.
    `for_training=False` (evaluation) skips the checks that only matter to a training run."""
    paths = RunPaths(cfg.run.dir)
    tokenizer, data = prepare_data_for_run(cfg, paths, for_training=for_training)
    return paths.data_report, tokenizer, data


def check_micro_batch_fits(cfg: LmforgeConfig, data: RunData) -> None:
    """UserInputError when the training set is smaller than one micro-batch: every step would
    reuse the same few items in a short batch, which is never what a config with that
    micro_batch_size means. Per rank under distributed training the share is smaller still;
    the whole set is checked here because it is known on every rank."""
    size = len(data.train)  # type: ignore[arg-type]
    batch = cfg.train.micro_batch_size
    if stage_spec(cfg.train.stage).online_rl:  # a micro-batch of completions: group_size per prompt
        batch = -(-batch // cfg.train.rl.group_size)
    if size >= batch:
        return
    raise UserInputError(
        f"train.micro_batch_size={batch} is larger than the training set, which holds {size} "
        f"{_train_units(cfg)} (see {RunPaths(cfg.run.dir).data_report}). Fix: lower "
        f"train.micro_batch_size to {max(size, 1)} or less, or add training data"
        + (" or lower data.max_length." if stage_spec(cfg.train.stage).data_kind == "text" else ".")
    )


def _train_units(cfg: LmforgeConfig) -> str:
    """What one item of the training set is, in the words of the data report."""
    data_kind = stage_spec(cfg.train.stage).data_kind
    if data_kind == "text":
        return f"block(s) of data.max_length={cfg.data.max_length} tokens"
    if data_kind == "chat":
        return "packed row(s)" if cfg.data.packing else "sample(s)"
    return f"{cfg.train.stage} row(s)"


def _preference_data(
    cfg: LmforgeConfig, tokenizer: PreTrainedTokenizerBase, cache_dir: Path, paths: RunPaths
) -> RunData:
    from lmforge.data.preference import prepare_preference_data, rendered_image_pairs
    from lmforge.data.vision_tokens import ImageTokens, save_image_parts_template

    processor = vision_processor(cfg, tokenizer)
    prepared = prepare_preference_data(
        cfg.data,
        tokenizer,
        cfg.train.stage,
        seed=cfg.run.seed,
        cache_dir=cache_dir,
        quarantine_path=paths.root / "bad_rows.jsonl",
        image_tokens=ImageTokens(processor) if processor is not None else None,
    )
    train, evaluation = prepared.train, prepared.eval
    if "images" not in train.column_names:
        processor = None  # text pairs: TRL tokenizes them with the tokenizer, as for a text model
    else:
        train = rendered_image_pairs(train, tokenizer)
        evaluation = rendered_image_pairs(evaluation, tokenizer) if evaluation is not None else None
        save_image_parts_template(tokenizer, processor)
    return RunData(train, evaluation, None, prepared.fingerprint, prepared.report, processor=processor)  # type: ignore[arg-type]


def first_samples(data: RunData, count: int) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of the first `count` training samples, packed rows split into their samples."""
    samples: list[tuple[list[int], list[int]]] = []
    items: Iterable[Any] = (
        iter(data.train)  # a stream's head: what training reads first (rank 0, no worker)
        if data.streaming
        else (data.train[index] for index in range(len(data.train)))  # type: ignore[arg-type]
    )
    for item in items:
        ids, labels = item["input_ids"], item["labels"]
        if len(ids) and isinstance(ids[0], list):  # a packed row: one list per sample
            samples.extend(zip(ids, labels, strict=True))
        else:
            samples.append((list(map(int, ids)), list(map(int, labels))))
        if len(samples) >= count:
            break
    return samples[:count]


def supervised_runs(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], labels: list[int]
) -> list[tuple[str, bool]]:
    """The sample's text cut into runs of (text, carries loss), for `prepare --show`."""
    runs: list[tuple[str, bool]] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or (labels[end] != -100) != (labels[start] != -100):
            runs.append((str(tokenizer.decode(ids[start:end])), labels[start] != -100))
            start = end
    return runs


def _pretraining_data(cfg: LmforgeConfig, tokenizer: PreTrainedTokenizerBase, cache_dir: Path) -> RunData:
    from lmforge.data.text import BlockDataset, prepare_pretraining_data

    text = prepare_pretraining_data(cfg.data, tokenizer, seed=cfg.run.seed, cache_dir=cache_dir)
    has_eval = text.eval_blocks is not None and len(text.eval_blocks) > 0
    return RunData(
        train=BlockDataset(text.train_blocks),
        eval=BlockDataset(text.eval_blocks) if has_eval and text.eval_blocks is not None else None,
        collator=default_data_collator,
        fingerprint=text.fingerprint,
        report=text.report,
    )


def _token_store_data(cfg: LmforgeConfig, tokenizer: PreTrainedTokenizerBase, cache_dir: Path) -> RunData:
    """Pretraining blocks read memory-mapped from the sharded token store. A store not built yet
    is built here with the local executor (as the cache would be); one a Slurm or Ray job builds
    must be finished first (`lmforge prepare CONFIG --executor ...`)."""
    from lmforge.data.token_store.build import build_token_store
    from lmforge.data.token_store.manifest import is_complete
    from lmforge.data.token_store.store import open_token_store

    settings = cfg.data.store
    if (
        settings is not None
        and settings.executor == "local"
        and not is_complete(cfg.data, tokenizer, cache_dir)
    ):
        build_token_store(cfg.data, tokenizer, seed=cfg.run.seed, cache_dir=cache_dir)
    store = open_token_store(cfg.data, tokenizer, seed=cfg.run.seed, cache_dir=cache_dir)
    return RunData(store.train, store.eval, default_data_collator, store.fingerprint, store.report)


def _text_stream(
    cfg: LmforgeConfig, tokenizer: PreTrainedTokenizerBase, cache_dir: Path, rank: int, world_size: int
) -> RunData:
    """Pretraining text read while training: this rank's part of the sources as a stream of blocks.
    Eval sources are read whole into the cache (eval repeats the same blocks every time)."""
    from lmforge.data.streaming import TextStream, stream_report
    from lmforge.data.text import BlockDataset, prepare_pretraining_data

    stream = TextStream(
        cfg.data.train,
        tokenizer,
        max_length=cfg.data.max_length,
        seed=cfg.run.seed,
        rank=rank,
        world_size=world_size,
    )
    evaluation: Dataset | None = None
    report: dict[str, Any] = {"streaming": True, "sources": [s.path for s in cfg.data.train]}
    if cfg.data.eval:
        eval_only = cfg.data.model_copy(update={"train": cfg.data.eval, "eval": [], "streaming": False})
        blocks = prepare_pretraining_data(eval_only, tokenizer, seed=cfg.run.seed, cache_dir=cache_dir)
        evaluation = BlockDataset(blocks.train_blocks)
        report["eval"] = blocks.report["train"]
        report["eval_blocks"] = len(blocks.train_blocks)
    fingerprint = stream_fingerprint(cfg, tokenizer)
    return RunData(
        stream, evaluation, default_data_collator, fingerprint, report, stream_report=stream_report
    )


def stream_fingerprint(cfg: LmforgeConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """What decides a stream's blocks: its sources' settings and files (path, size, modification
    time: a stream's corpus is too big to hash at every start), the tokenizer and the block length;
    a resume whose stream would differ is told so (provenance compares it)."""
    import hashlib

    from lmforge.data.hub import is_remote_source
    from lmforge.data.source_paths import resolve_files
    from lmforge.data.tokenizer import tokenizer_fingerprint

    files: list[str] = []
    keyed = [(f"data.train.{i}.path", s) for i, s in enumerate(cfg.data.train)]
    keyed += [(f"data.eval.{i}.path", s) for i, s in enumerate(cfg.data.eval)]
    for key, source in keyed:
        files.append(source.model_dump_json())
        if not is_remote_source(source.path) and not source.path.startswith("builtin:"):
            for file in resolve_files(source, key=key):
                status = file.stat()
                files.append(f"{file.resolve()}|{status.st_size}|{status.st_mtime_ns}")
    parts = {
        "code": "stream-v1",
        "files": files,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": cfg.data.max_length,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _sft_data(
    cfg: LmforgeConfig,
    tokenizer: PreTrainedTokenizerBase,
    cache_dir: Path,
    paths: RunPaths,
    rank: int = 0,
    world_size: int = 1,
) -> RunData:
    from lmforge.data.sft import prepare_sft_data
    from lmforge.data.vision_tokens import ImageTokens, VisionCollator, save_image_parts_template

    if cfg.data.streaming:
        return _chat_stream(cfg, tokenizer, cache_dir, paths, rank, world_size)
    processor = vision_processor(cfg, tokenizer)
    sft = prepare_sft_data(
        cfg.data,
        tokenizer,
        seed=cfg.run.seed,
        cache_dir=cache_dir,
        quarantine_path=paths.root / "bad_rows.jsonl",
        image_tokens=ImageTokens(processor) if processor is not None else None,
    )
    # Eval rows are packed among themselves only: no eval sample ever shares a row with train.
    evaluation = sft_dataset(cfg, sft.eval) if sft.eval else None
    collator = sft_collator(cfg, tokenizer)
    if processor is not None:
        collator = VisionCollator(collator, processor)
        save_image_parts_template(tokenizer, processor)
    return RunData(
        sft_dataset(cfg, sft.train), evaluation, collator, sft.fingerprint, sft.report, processor=processor
    )


def vision_processor(cfg: LmforgeConfig, tokenizer: PreTrainedTokenizerBase) -> Any:
    """The processor of a vision-language model.path around the run's tokenizer; None for a text model."""
    from lmforge.config.model_kind import VISION_PRESET_NAMES, preset_processor, vision_model_type
    from lmforge.data.vision_tokens import load_processor

    if cfg.model.preset in VISION_PRESET_NAMES:
        return preset_processor(cfg.model.preset, tokenizer)
    if vision_model_type(cfg.model.path) is None:
        return None
    assert cfg.model.path is not None
    return load_processor(cfg.model.path, tokenizer, trust_remote_code=cfg.model.trust_remote_code)


def sft_dataset(cfg: LmforgeConfig, samples: Any) -> Dataset:
    """SFT samples as the Trainer reads them: packed rows under data.packing, else one per item."""
    from lmforge.data.ragged import PackedDataset, SampleDataset

    return PackedDataset(samples, cfg.data.max_length) if cfg.data.packing else SampleDataset(samples)


def sft_collator(
    cfg: LmforgeConfig, tokenizer: PreTrainedTokenizerBase
) -> Callable[[list[Any]], dict[str, Any]]:
    """The SFT batches' collator: packed rows with their attention kept apart, padding-free rows, or padded."""
    from lmforge.data.collate import PackedCollator, PaddedCollator, PaddingFreeCollator

    if cfg.data.packing:
        # The mask's form depends on the kernel: boolean for sdpa, additive for eager (a boolean
        # mask under eager would silently let samples attend to each other).
        flex = cfg.model.attn_implementation == "flex_attention"
        return PackedCollator(
            pad_token_id=tokenizer.pad_token_id,
            attn_implementation=cfg.model.attn_implementation,
            dtype=getattr(torch, cfg.model.dtype),  # model.dtype names a torch dtype: "bfloat16", ...
            # FlexAttention's kernel is compiled per row length: one length, one compile.
            pad_to_multiple_of=cfg.data.max_length if flex else None,
        )
    if cfg.data.padding_free:
        return PaddingFreeCollator()
    return PaddedCollator(pad_token_id=tokenizer.pad_token_id)


def _chat_stream(
    cfg: LmforgeConfig,
    tokenizer: PreTrainedTokenizerBase,
    cache_dir: Path,
    paths: RunPaths,
    rank: int,
    world_size: int,
) -> RunData:
    """SFT conversations read while training: this rank's part as a stream of samples (or packed
    rows). Eval sources are read whole into the cache, as the cached path reads them."""
    from lmforge.data.sft import prepare_sft_data
    from lmforge.data.streaming import ChatStream, stream_report

    stream = ChatStream(
        cfg.data,
        tokenizer,
        seed=cfg.run.seed,
        rank=rank,
        world_size=world_size,
        quarantine_path=paths.root / "bad_rows.jsonl",
    )
    evaluation: Dataset | None = None
    report: dict[str, Any] = {"streaming": True, "sources": [s.path for s in cfg.data.train]}
    if cfg.data.eval:
        eval_only = cfg.data.model_copy(update={"train": cfg.data.eval, "eval": [], "streaming": False})
        sft = prepare_sft_data(
            eval_only,
            tokenizer,
            seed=cfg.run.seed,
            cache_dir=cache_dir,
            quarantine_path=paths.root / "bad_rows.eval.jsonl",  # the stream's readers write the train file
        )
        evaluation = sft_dataset(cfg, sft.train)
        report["eval"] = sft.report.get("train")
    fingerprint = stream_fingerprint(cfg, tokenizer)
    return RunData(
        stream, evaluation, sft_collator(cfg, tokenizer), fingerprint, report, stream_report=stream_report
    )
