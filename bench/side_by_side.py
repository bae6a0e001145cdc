"""Pieces the side-by-side benchmarks share: the random Llama they measure on, and the median
time / peak RSS of each side, printed with every run so the spread is visible."""

from __future__ import annotations

import statistics
from typing import Any


def random_llama(hidden: int, layers: int, *, vocab: int = 32000) -> Any:
    """A Llama-style model with random weights (seed 0): sizes a benchmark needs, no download."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def medians_by_side(
    runs: dict[str, list[dict]], *, width: int = 9, prefix: str = "", notes: dict[str, str] | None = None
) -> dict[str, tuple[float, float]]:
    """(median seconds, median peak RSS MiB) per side, after printing each side's runs (each line
    after `prefix`, with the side's entry of `notes` at its end)."""
    medians = {}
    for side, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        rss = statistics.median(r["peak_rss_mib"] for r in results)
        medians[side] = (seconds, rss)
        print(
            f"{prefix}{side:{width}}: {seconds:6.1f} s  runs={[round(r['seconds'], 1) for r in results]}  "
            f"peak RSS {rss:,.0f} MiB  runs={[round(r['peak_rss_mib']) for r in results]}"
            + (f"  {notes[side]}" if notes and side in notes else "")
        )
    return medians
