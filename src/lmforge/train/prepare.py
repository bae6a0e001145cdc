"""The data stage as a run sees it: tokenizer plus prepared (cached) data and its report."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from lmforge.config import LmforgeConfig
from lmforge.data.text import PreparedText, prepare_pretraining_data
from lmforge.train.rundir import RunPaths
from lmforge.train.tokenizer_source import obtain_tokenizer


def resolve_cache_dir(cfg: LmforgeConfig) -> Path:
    """data.cache_dir, else $LMFORGE_CACHE, else ~/.cache/lmforge."""
    if cfg.data.cache_dir is not None:
        return cfg.data.cache_dir
    return Path(os.environ.get("LMFORGE_CACHE", Path.home() / ".cache" / "lmforge"))


def prepare_data_for_run(cfg: LmforgeConfig, paths: RunPaths) -> tuple[PreTrainedTokenizerBase, PreparedText]:
    """Tokenizer and prepared data for the run in `paths`; writes data_report.json there."""
    paths.root.mkdir(parents=True, exist_ok=True)
    cache_dir = resolve_cache_dir(cfg)
    tokenizer = obtain_tokenizer(cfg, paths, cache_dir)
    data = prepare_pretraining_data(cfg.data, tokenizer, seed=cfg.run.seed, cache_dir=cache_dir)
    paths.data_report.write_text(json.dumps(data.report, indent=2), encoding="utf-8")
    return tokenizer, data


def prepare_run_data(cfg: LmforgeConfig) -> tuple[Path, dict[str, Any]]:
    """`lmforge prepare`: run the data stage alone; returns the report and where it was written."""
    paths = RunPaths(cfg.run.dir)
    _, data = prepare_data_for_run(cfg, paths)
    return paths.data_report, data.report
