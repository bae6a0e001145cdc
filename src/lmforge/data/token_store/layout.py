"""Where a token store lives and which input files it holds.

The default location `<cache_dir>/store-<fingerprint>` changes with the sources (each resolved
file's path, size and mtime: never its content, since hashing terabytes at every start is not an
option; the tasks record content hashes in the manifest), the tokenizer and the store's code
version. Not with data.max_length, weights or budgets: those apply when training reads it, so
one store serves any block length and any mix of its sources.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import DataConfig, SourceConfig
from lmforge.data.corpus import builtin_version, is_builtin
from lmforge.data.source_paths import resolve_files
from lmforge.data.token_store.pipeline import InputFile
from lmforge.data.tokenizer import tokenizer_fingerprint

# Bump when the shard format or the tokenization rules change: old stores then stop matching.
CODE_VERSION = "token-store-v1"
MANIFEST = "manifest.json"
# What decides a source's tokens (weight, max_tokens and max_documents do not: read time).
_READ_SETTINGS = ("path", "format", "split", "text_field")


def store_splits(cfg: DataConfig) -> dict[str, list[SourceConfig]]:
    """The store's splits: train, and eval when data.eval names sources."""
    return {"train": list(cfg.train), **({"eval": list(cfg.eval)} if cfg.eval else {})}


def input_files(cfg: DataConfig) -> list[InputFile]:
    """Every input file of the store in the cached path's order: split, source, file."""
    files = []
    for split, sources in store_splits(cfg).items():
        for index, source in enumerate(sources):
            settings = json.dumps(source.model_dump(mode="json", include=set(_READ_SETTINGS)))
            for number, path in enumerate(resolve_files(source, key=f"data.{split}.{index}.path")):
                stat = path.stat()
                files.append(
                    InputFile(
                        split, index, number, str(path.resolve()), stat.st_size, stat.st_mtime_ns, settings
                    )
                )
    return files


def store_fingerprint(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, files: Sequence[InputFile]) -> str:
    """sha256 over the code version, the tokenizer, the sources' read settings and the input
    files' paths, sizes and mtimes."""
    parts = {
        "code": CODE_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "builtin": [builtin_version(s.path) for s in [*cfg.train, *cfg.eval] if is_builtin(s.path)],
        "files": [(f.split, f.source, f.path, f.size, f.mtime_ns, f.source_settings) for f in files],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def store_location(cfg: DataConfig, cache_dir: Path, fingerprint: str) -> Path:
    """data.store.path when set, else `<cache_dir>/store-<fingerprint>`."""
    if cfg.store is not None and cfg.store.path is not None:
        return cfg.store.path
    return cache_dir / f"store-{fingerprint[:16]}"
