"""The names `data.chat_template` accepts: the built-in catalogue's, and LLaMA-Factory's `template:`
names for the same formats.

The names live here because the schema validates with them (config/ imports no stage); the
templates themselves are in `lmforge.data.chat_templates`, whose catalogue a test keeps equal to
CHAT_TEMPLATE_NAMES.
"""

from __future__ import annotations

import typing
from typing import Literal

ChatTemplateName = Literal[
    "chatml",
    "llama2",
    "llama3",
    "mistral",
    "gemma",
    "phi3",
    "phi4",
    "qwen2",
    "qwen3",
    "qwen3_nothink",
    "deepseek",
    "glm4",
    "glm4_moe",
]
CHAT_TEMPLATE_NAMES: tuple[str, ...] = typing.get_args(ChatTemplateName)

# LLaMA-Factory template names whose format a built-in renders under another name. Its names that
# equal a built-in's (llama2, llama3, mistral, gemma, phi4, qwen3, qwen3_nothink, glm4, glm4_moe,
# chatml) need no entry; its `deepseek` (DeepSeek-LLM's "User: / Assistant:" format) is shadowed
# by the built-in deepseek (V3/R1).
LLAMAFACTORY_ALIASES: dict[str, str] = {
    "gemma2": "gemma",
    "gemma3": "gemma",  # text-only: the same turns as Gemma and Gemma 2
    "phi": "phi3",
    "qwen": "qwen2",  # LLaMA-Factory's default system text is Qwen2.5's ("You are Qwen, ..."); see README
    "deepseek3": "deepseek",
    "deepseekr1": "deepseek",
    "yi": "chatml",
}
# LLaMA-Factory names with no model family behind them: refused with the reason, never mapped to a
# template that would render something else.
NOT_A_FAMILY: dict[str, str] = {
    "default": "LLaMA-Factory's own 'Human: ... Assistant: ...' format, which no model family uses",
    "empty": "LLaMA-Factory's template with no chat markup at all",
}


def canonical_chat_template(name: str) -> str:
    """The built-in name `name` stands for (itself or the built-in a LLaMA-Factory alias names).

    Raises ValueError naming the accepted names, or the reason a LLaMA-Factory name has no built-in.
    """
    if name in CHAT_TEMPLATE_NAMES:
        return name
    if name in LLAMAFACTORY_ALIASES:
        return LLAMAFACTORY_ALIASES[name]
    fix = (
        f"choose the template of the model family you fine-tune ({', '.join(CHAT_TEMPLATE_NAMES)}), "
        "or leave data.chat_template unset to use the tokenizer's own"
    )
    if name in NOT_A_FAMILY:
        raise ValueError(f"{name!r} is {NOT_A_FAMILY[name]}; lmforge has no built-in for it. Fix: {fix}")
    aliases = ", ".join(f"{alias} -> {target}" for alias, target in LLAMAFACTORY_ALIASES.items())
    raise ValueError(
        f"unknown chat template {name!r} (LLaMA-Factory's names are accepted too: {aliases}). Fix: {fix}"
    )
