"""The store's manifest: written last, once every shard is complete; checked before training.

`manifest.json` lists, per split and per source, the ordered shards with their counts, byte
sizes and input hashes. Present means complete. Opening a store checks it against the run
(tokenizer, sources on disk) and against its shards (present, same tokenizer, same counts,
files of the right size) and refuses with the file and the fix, before any training.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import DataConfig
from lmforge.data.token_store.layout import (
    CODE_VERSION,
    MANIFEST,
    input_files,
    store_fingerprint,
    store_location,
)
from lmforge.data.token_store.pipeline import InputFile
from lmforge.data.token_store.shards import (
    INDEX_DTYPE,
    TOKEN_DTYPE,
    ShardInfo,
    index_path,
    read_sidecar,
    shard_stem,
    tokens_path,
)
from lmforge.errors import UserInputError

PREPARE_HINT = "lmforge prepare CONFIG --executor local (or slurm / ray, as data.store.executor)"


@dataclass(frozen=True)
class Shard:
    """A shard as the manifest lists it; `stem` is its path without suffix."""

    stem: Path
    info: ShardInfo


def collect_shards(store: Path, files: list[InputFile]) -> list[Shard] | None:
    """Every planned shard with its sidecar, or None while one is not complete."""
    shards = []
    for item in files:
        stem = shard_stem(store, item.split, item.source, item.number)
        info = read_sidecar(stem)
        if info is None:
            return None
        shards.append(Shard(stem, info))
    return shards


def write_manifest(
    store: Path, shards: list[Shard], fingerprint: str, tokenizer_fp: str, eos_id: int
) -> None:
    """manifest.json, atomically (a temporary file renamed): its presence marks the store complete."""
    splits: dict[str, list[dict[str, Any]]] = {}
    for shard in shards:
        sources = splits.setdefault(shard.info.split, [])
        while len(sources) <= shard.info.source:
            sources.append({"shards": [], "tokens": 0, "documents": 0})
        entry = sources[shard.info.source]
        entry["shards"].append(_shard_entry(store, shard))
        entry["tokens"] += shard.info.tokens
        entry["documents"] += shard.info.documents
    manifest = {
        "code_version": CODE_VERSION,
        "fingerprint": fingerprint,
        "tokenizer_fingerprint": tokenizer_fp,
        "eos_id": eos_id,
        "splits": splits,
        "totals": {
            "shards": len(shards),
            "tokens": sum(s.info.tokens for s in shards),
            "documents": sum(s.info.documents for s in shards),
            "input_bytes": sum(s.info.input_size for s in shards),
        },
    }
    temporary = store / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    os.replace(temporary, store / MANIFEST)


def _shard_entry(store: Path, shard: Shard) -> dict[str, Any]:
    info = shard.info
    return {
        "shard": str(shard.stem.relative_to(store)),
        "tokens": info.tokens,
        "documents": info.documents,
        "token_bytes": info.tokens * TOKEN_DTYPE.itemsize,
        "index_bytes": info.documents * INDEX_DTYPE.itemsize,
        "input_path": info.input_path,
        "input_size": info.input_size,
        "input_mtime_ns": info.input_mtime_ns,
        "input_sha256": info.input_sha256,
    }


def is_complete(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, cache_dir: Path) -> bool:
    """Whether `cfg`'s store is built, from its sources as they are on disk now (a cheap check:
    stats and the manifest, no shard read); `build_token_store` is what makes it so."""
    files = input_files(cfg)
    store = store_location(cfg, cache_dir, store_fingerprint(cfg, tokenizer, files))
    if not (store / MANIFEST).is_file():
        return False
    manifest = json.loads((store / MANIFEST).read_text(encoding="utf-8"))
    listed = sorted((e["input_path"], e["input_size"], e["input_mtime_ns"]) for e in _entries(manifest))
    return listed == sorted((f.path, f.size, f.mtime_ns) for f in files)


def read_manifest(store: Path, *, default_location: bool) -> dict[str, Any]:
    """The manifest; UserInputError saying how to build the store when there is none."""
    path = store / MANIFEST
    if not path.is_file():
        why = (
            "no token store was built for these sources and this tokenizer (or they changed since it was)"
            if default_location
            else "the token store is not built, or its build did not finish"
        )
        raise UserInputError(f"{path}: missing: {why}. Fix: run {PREPARE_HINT}.")
    manifest: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return manifest


def check_against_run(
    store: Path, manifest: dict[str, Any], files: list[InputFile], tokenizer_fp: str
) -> None:
    """The store was built with this tokenizer, from these sources as they are on disk now."""
    where = store / MANIFEST
    if manifest.get("code_version") != CODE_VERSION:
        raise UserInputError(
            f"{where}: written by token store {manifest.get('code_version')!r}, this lmforge reads "
            f"{CODE_VERSION!r}. Fix: delete {store} and run {PREPARE_HINT}."
        )
    if manifest["tokenizer_fingerprint"] != tokenizer_fp:
        raise UserInputError(
            f"{where}: the store was tokenized with another tokenizer than this run's. Fix: point "
            f"data.store.path elsewhere (or delete {store}) and run {PREPARE_HINT}."
        )
    listed = {(e["input_path"], e["input_size"], e["input_mtime_ns"]) for e in _entries(manifest)}
    for item in files:
        if (item.path, item.size, item.mtime_ns) not in listed:
            raise UserInputError(
                f"{item.path} (data.{item.split}.{item.source}.path) changed since the token store {store} "
                f"was built (size or modification time), or is new. Fix: run {PREPARE_HINT} to rebuild "
                "it (finished shards of unchanged files are kept)."
            )
    if len(files) != sum(1 for _ in _entries(manifest)):
        raise UserInputError(
            f"{where}: lists files the sources no longer have. Fix: run {PREPARE_HINT} to rebuild it."
        )


def checked_shards(store: Path, manifest: dict[str, Any], tokenizer_fp: str) -> dict[str, list[list[Shard]]]:
    """Per split, per source, the shards in order, each checked against its files and sidecar."""
    splits: dict[str, list[list[Shard]]] = {}
    for split, sources in manifest["splits"].items():
        splits[split] = [[_checked(store, entry, tokenizer_fp) for entry in s["shards"]] for s in sources]
    return splits


def _checked(store: Path, entry: dict[str, Any], tokenizer_fp: str) -> Shard:
    stem = store / entry["shard"]
    tokens, index = tokens_path(stem), index_path(stem)
    info = read_sidecar(stem)
    for path in (tokens, index):
        if not path.is_file() or info is None:
            missing = path if not path.is_file() else stem.with_suffix(".json")
            raise UserInputError(
                f"{missing}: shard listed in {store / MANIFEST} is missing (input {entry['input_path']}). "
                f"Fix: restore it, or delete {store / MANIFEST} and run {PREPARE_HINT} to redo it."
            )
    assert info is not None
    if info.tokenizer_fingerprint != tokenizer_fp:
        raise UserInputError(
            f"{stem.with_suffix('.json')}: shard tokenized with another tokenizer than this run's. "
            f"Fix: delete it and {store / MANIFEST}, then run {PREPARE_HINT}."
        )
    if (info.tokens, info.documents) != (entry["tokens"], entry["documents"]):
        raise UserInputError(
            f"{store / MANIFEST}: does not match shard {stem.name} ({entry['tokens']} tokens, "
            f"{entry['documents']} documents listed; its sidecar says {info.tokens}, {info.documents}). "
            f"Fix: delete {store / MANIFEST} and run {PREPARE_HINT} to rewrite it."
        )
    _check_size(tokens, info.tokens * TOKEN_DTYPE.itemsize, store)
    _check_size(index, info.documents * INDEX_DTYPE.itemsize, store)
    if info.documents and _last_end(index) != info.tokens:
        raise UserInputError(
            f"{index}: its last document ends at {_last_end(index)}, not {info.tokens}. {_redo(store)}"
        )
    return Shard(stem, info)


def _check_size(path: Path, expected: int, store: Path) -> None:
    actual = path.stat().st_size
    if actual != expected:
        raise UserInputError(
            f"{path}: truncated or damaged ({actual} bytes, expected {expected}). {_redo(store)}"
        )


def _last_end(index: Path) -> int:
    with index.open("rb") as handle:
        handle.seek(-INDEX_DTYPE.itemsize, os.SEEK_END)
        return int(np.frombuffer(handle.read(INDEX_DTYPE.itemsize), dtype=INDEX_DTYPE)[0])


def _redo(store: Path) -> str:
    return f"Fix: delete this shard's files and {store / MANIFEST}, then run {PREPARE_HINT} to redo it."


def _entries(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for sources in manifest["splits"].values() for s in sources for e in s["shards"]]
