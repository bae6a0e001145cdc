"""The Ollama Modelfile written next to a GGUF: the chat template (when it is ChatML) and stop tokens
(the trained built-in template's, see `data.chat.turn_end_tokens`)."""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

from lmforge.data.chat import turn_end_tokens

# Ollama's Go-template form of ChatML; renders the same text as lmforge's CHATML_TEMPLATE with
# add_generation_prompt=True.
OLLAMA_CHATML = "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
_PROBE = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
]


def is_chatml(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders exactly ChatML (checked by rendering a probe)."""
    if not isinstance(tokenizer.chat_template, str):
        return False
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in _PROBE)
    expected += "<|im_start|>assistant\n"
    try:
        rendered = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - any template error means "not translatable"
        return False
    return rendered == expected


def default_system_prompt(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The system message a ChatML-shaped template adds when a conversation has none (Qwen2's
    "You are a helpful assistant."), found by rendering a conversation without one."""
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "U"}], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # noqa: BLE001 - no usable template, no default
        return None
    match = re.fullmatch(
        r"<\|im_start\|>system\n(.*?)<\|im_end\|>\n<\|im_start\|>user\nU<\|im_end\|>\n<\|im_start\|>assistant\n",
        str(rendered),
        re.DOTALL,
    )
    return match.group(1) if match else None


def render_modelfile(gguf_name: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """An Ollama Modelfile for the GGUF next to it."""
    lines = [f"FROM ./{gguf_name}", ""]
    if is_chatml(tokenizer):
        lines.append(f'TEMPLATE """{OLLAMA_CHATML}"""')
        system = default_system_prompt(tokenizer)
        if system:  # every training sample carried it; Ollama adds SYSTEM when a chat has none
            lines.append(f'SYSTEM """{system}"""')
    else:
        lines += [
            "# The chat template is not ChatML and was not translated to Ollama's Go template syntax;",
            "# Ollama falls back to the Jinja template embedded in the GGUF (tokenizer.chat_template).",
        ]
    vocab = tokenizer.get_vocab()
    stops = [t for t in turn_end_tokens(tokenizer) if t in vocab]
    if tokenizer.eos_token and tokenizer.eos_token not in stops:
        stops.append(tokenizer.eos_token)
    lines += [""] + [f'PARAMETER stop "{token}"' for token in stops]
    return "\n".join(lines) + "\n"
