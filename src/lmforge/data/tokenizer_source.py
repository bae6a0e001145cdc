"""Where a run's tokenizer comes from: the run itself (on resume), a path, or training one."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from lmforge.config import LmforgeConfig
from lmforge.config.model_kind import VISION_PRESET_NAMES, add_image_tokens
from lmforge.config.schema import SourceConfig
from lmforge.data.sources import iter_documents, sources_fingerprint
from lmforge.data.tokenizer import ensure_pad_token, load_tokenizer, train_tokenizer
from lmforge.run_layout import RunPaths

log = logging.getLogger(__name__)


def obtain_tokenizer(cfg: LmforgeConfig, paths: RunPaths, cache_dir: Path) -> PreTrainedTokenizerBase:
    """The run's tokenizer; a trained one is saved in the run directory so a resume reuses it exactly."""
    if paths.tokenizer.is_dir():
        return load_tokenizer(str(paths.tokenizer), trust_remote_code=False)
    if cfg.tokenizer.train is not None:
        tokenizer = _trained_tokenizer(cfg, cache_dir)
        _with_preset_image_tokens(cfg, tokenizer)
        tokenizer.save_pretrained(str(paths.tokenizer))
        return tokenizer
    path = cfg.tokenizer.path or cfg.model.path
    assert path is not None  # LmforgeConfig guarantees one source
    key = "tokenizer.path" if cfg.tokenizer.path else "model.path"
    tokenizer = load_tokenizer(path, trust_remote_code=cfg.model.trust_remote_code, key=key)
    ensure_pad_token(tokenizer)  # every collator pads; checked here, before data or model work
    _with_preset_image_tokens(cfg, tokenizer)
    return tokenizer


def _with_preset_image_tokens(cfg: LmforgeConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """A vision preset's image tokens join the tokenizer before any data is rendered with it (the
    model built later sizes its embeddings to the tokenizer)."""
    if cfg.model.preset in VISION_PRESET_NAMES:
        add_image_tokens(tokenizer, cfg.model.preset)


def _trained_tokenizer(cfg: LmforgeConfig, cache_dir: Path) -> PreTrainedTokenizerBase:
    """Train on the training sources, or reuse a tokenizer trained earlier on the same text and settings."""
    assert cfg.tokenizer.train is not None
    key = hashlib.sha256(
        (sources_fingerprint(cfg.data.train) + cfg.tokenizer.train.model_dump_json()).encode()
    ).hexdigest()[:16]
    cached = cache_dir / "tokenizers" / key
    if cached.is_dir():
        log.info("reusing tokenizer trained earlier on the same data: %s", cached)
        return load_tokenizer(str(cached), trust_remote_code=False)
    tokenizer = train_tokenizer(_all_documents(cfg.data.train), cfg.tokenizer.train)
    cached.parent.mkdir(parents=True, exist_ok=True)
    # Written under a name of this process's own and renamed whole: distributed workers that
    # train the same tokenizer at once each publish a complete copy, and the first one stays.
    partial = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=cached.parent))
    try:
        tokenizer.save_pretrained(str(partial))
        os.rename(partial, cached)
    except OSError:
        if not cached.is_dir():
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return tokenizer


def _all_documents(sources: list[SourceConfig]) -> Iterator[str]:
    return itertools.chain.from_iterable(
        iter_documents(source, key=f"data.train.{index}.path") for index, source in enumerate(sources)
    )
