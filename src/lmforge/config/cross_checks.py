"""Rules that span config sections, in one table: (applies?, key path, problem and fix).

Each rule is checked after every section validated on its own, and all broken rules are
reported together, like any other config error.
"""

from __future__ import annotations

from collections.abc import Callable

from lmforge.config.schema import LmforgeConfig

CHAT_FORMATS = {"alpaca", "sharegpt", "messages"}

Rule = tuple[Callable[[LmforgeConfig], bool], str, str]

RULES: list[Rule] = [
    (
        lambda c: c.data.padding_free and c.model.attn_implementation != "flash_attention_2",
        "data.padding_free",
        "padding-free batches keep samples apart only under flash_attention_2 (sdpa/eager would let them "
        "attend to each other); set model.attn_implementation: flash_attention_2, or use data.packing: true",
    ),
    (
        lambda c: c.data.packing and c.model.attn_implementation == "flash_attention_2",
        "data.packing",
        "with flash_attention_2 use data.padding_free: true (varlen attention) instead of data.packing",
    ),
    (
        lambda c: c.data.packing and c.data.padding_free,
        "data.packing",
        "choose one of data.packing and data.padding_free",
    ),
    (
        lambda c: c.train.stage == "pretrain" and (c.data.packing or c.data.padding_free),
        "data.packing",
        "pretraining already packs text into full blocks; packing/padding_free apply to train.stage: sft",
    ),
    (
        lambda c: (
            c.train.stage == "pretrain"
            and any(s.format not in ("auto", "text") for s in [*c.data.train, *c.data.eval])
        ),
        "data.train",
        "train.stage: pretrain reads raw text (format: text); set train.stage: sft for conversation data",
    ),
    (
        lambda c: c.train.stage == "sft" and any(s.format == "text" for s in [*c.data.train, *c.data.eval]),
        "data.train",
        "train.stage: sft needs conversation rows (alpaca, sharegpt, messages); format: text is for pretraining",
    ),
    (
        lambda c: c.train.stage == "sft" and c.tokenizer.train is not None,
        "tokenizer.train",
        "tokenizer.train learns from raw text sources; for train.stage: sft train one with "
        "`lmforge tokenizer train --input ... --out DIR` and set tokenizer.path: DIR, or use model.path's tokenizer",
    ),
    (
        lambda c: c.train.stage == "sft" and any(s.format in ("preference", "kto") for s in c.data.train),
        "data.train",
        "preference and kto rows need a preference stage (dpo / kto), not train.stage: sft",
    ),
]


def cross_section_problems(cfg: LmforgeConfig) -> list[tuple[str, str]]:
    """(key path, message) for every rule the config breaks."""
    return [(key, message) for applies, key, message in RULES if applies(cfg)]
