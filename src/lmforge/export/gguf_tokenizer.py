"""The tokenizer part of a GGUF: vocabulary, merges or scores, token types, special ids,
pre-tokenizer name and chat template, written as llama.cpp reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lmforge.errors import UserInputError

# A byte-level BPE split by GPT-2's regex (what `train_tokenizer` makes) is llama.cpp's "gpt-2"
# pre-tokenizer; a Split regex in front of ByteLevel is named by matching it against the regexes
# transformers' GGUF reader (which runs these files in CI) associates with llama.cpp's names.
# A SentencePiece-style vocabulary becomes llama.cpp's SPM tokenizer, which puts the dummy-prefix
# space before every text segment that follows a special token (Llama 2's "legacy" behaviour);
# HF's Metaspace(prepend_scheme="first") puts it before the first segment only, and no GGUF key
# selects that, so chat prompts of such tokenizers tokenize differently in llama.cpp.
_PRE_TOKENIZER_NAMES = ("llama-bpe", "qwen2")


def load_tokenizer(source: Path, config: dict[str, Any]) -> PreTrainedTokenizerBase:
    """The HF tokenizer saved next to the model (a GGUF embeds it)."""
    try:
        return AutoTokenizer.from_pretrained(
            str(source), local_files_only=True, config=_config_facts(source, config)
        )
    except (OSError, ValueError) as err:
        if (source / "tokenizer.model").is_file() and not (source / "tokenizer.json").is_file():
            raise UserInputError(
                f"{source}: the tokenizer is a SentencePiece tokenizer.model without tokenizer.json, and "
                f"transformers could not convert it ({err}); that needs the sentencepiece package. Fix: pip "
                "install sentencepiece, or save the tokenizer with tokenizer.save_pretrained(DIR) where it is "
                "installed (that writes tokenizer.json)."
            ) from None
        raise UserInputError(
            f"{source}: no loadable tokenizer ({err}). A GGUF embeds its tokenizer: save it with "
            "tokenizer.save_pretrained(DIR) next to the model."
        ) from None


@dataclass(frozen=True)
class _ConfigFacts:
    """What AutoTokenizer reads from a model config, taken from config.json as it is.

    Without `config=`, AutoTokenizer builds the model's config class (AutoConfig), whose import
    pulls in transformers' modeling, image and video utilities, accelerate and torch._dynamo: about
    80 of the 120 MiB that loading a SentencePiece Llama's tokenizer added to the export's peak RSS.
    When tokenizer_config.json names its tokenizer class (what save_pretrained writes) and no
    remote code, AutoTokenizer picks the class from these names alone."""

    model_type: str
    tokenizer_class: str | None
    _name_or_path: str


def _config_facts(source: Path, config: dict[str, Any]) -> _ConfigFacts | None:
    """A stand-in for the model config; None (AutoTokenizer builds the real one) where its choice
    of tokenizer class could depend on the config's class: no class named, or remote code."""
    path = source / "tokenizer_config.json"
    try:
        tokenizer_config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return None  # AutoTokenizer reports it
    if (
        not tokenizer_config.get("tokenizer_class")
        or "auto_map" in tokenizer_config
        or "model_name" in config
    ):
        return None
    return _ConfigFacts(config["model_type"], config.get("tokenizer_class"), str(source))


def add_tokenizer(
    writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerBase, config: dict[str, Any]
) -> dict[str, Any]:
    """Embed the tokenizer as llama.cpp reads it; returns facts for the conversion report."""
    vocab_size = int(config["vocab_size"])
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model["type"] != "BPE":
        raise UserInputError(
            f"tokenizer model {model['type']!r} has no GGUF export here; supported: byte-level BPE "
            "(GPT-2 style, tokenizer.ggml.model gpt2) and SentencePiece-style BPE with byte fallback (llama)"
        )
    vocab = tokenizer.get_vocab()
    tokens = _token_list(vocab, vocab_size)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    spm = bool(model.get("byte_fallback"))
    types = _token_types(tokenizer, tokens, set(vocab.values()), spm)
    writer.add_tokenizer_model("llama" if spm else "gpt2")
    if spm:
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(_spm_scores(tokens, merges))
        writer.add_add_space_prefix(_adds_space_prefix(spec))
    else:
        writer.add_tokenizer_pre(_pre_tokenizer_name(spec.get("pre_tokenizer")))
        writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)  # the exact BPE; llama.cpp's SPM path ranks by scores instead
    _add_special_tokens(writer, tokenizer, config)
    template = tokenizer.chat_template
    if isinstance(template, str):
        writer.add_chat_template(template)
    return {
        "tokenizer_model": "llama" if spm else "gpt2",
        "vocab_size": vocab_size,
        "merges": len(merges),
        "chat_template": isinstance(template, str),
    }


def _token_list(vocab: dict[str, int], vocab_size: int) -> list[str]:
    """One token per embedding row; rows past the tokenizer get llama.cpp's [PADn] placeholders."""
    if max(vocab.values()) >= vocab_size:
        raise UserInputError(
            f"tokenizer has ids up to {max(vocab.values())} but config.json vocab_size is {vocab_size}: the "
            "embedding has no row for some tokens. Fix: resize the model's embeddings to the tokenizer "
            "(model.resize_token_embeddings) and save it again."
        )
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    for token, index in vocab.items():
        tokens[index] = token
    return tokens


def _add_special_tokens(
    writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerBase, config: dict[str, Any]
) -> None:
    ids = _special_ids(tokenizer, config)
    for key, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("unk", writer.add_unk_token_id),
        ("pad", writer.add_pad_token_id),
        ("eot", writer.add_eot_token_id),
    ):
        token_id = ids.get(key)
        if token_id is not None:
            add(token_id)
    # Whether encoding adds bos/eos, as the tokenizer's post-processor does it.
    probe = tokenizer("a")["input_ids"]
    writer.add_add_bos_token(ids["bos"] is not None and probe[:1] == [ids["bos"]])
    writer.add_add_eos_token(ids["eos"] is not None and probe[-1:] == [ids["eos"]])


def _token_types(
    tokenizer: PreTrainedTokenizerBase, tokens: list[str], used: set[int], spm: bool
) -> list[int]:
    added = tokenizer.added_tokens_decoder
    types = []
    for index, token in enumerate(tokens):
        if spm and index == tokenizer.unk_token_id:
            kind = gguf.TokenType.UNKNOWN
        elif index in added:
            kind = gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED
        elif index not in used:  # embedding rows past the tokenizer: llama.cpp's [PADn] placeholders
            kind = gguf.TokenType.UNUSED
        elif spm and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            kind = gguf.TokenType.BYTE
        else:
            kind = gguf.TokenType.NORMAL
        types.append(int(kind))
    return types


def _spm_scores(tokens: list[str], merges: list[str]) -> list[float]:
    """llama.cpp's SentencePiece tokenizer merges the adjacent pair whose joined token scores
    highest; a BPE merge list says the same with ranks, so a merged token scores -rank."""
    rank = {merge.replace(" ", ""): -float(i) for i, merge in reversed(list(enumerate(merges)))}
    return [rank.get(token, 0.0) for token in tokens]


def _adds_space_prefix(spec: dict[str, Any]) -> bool:
    parts = [spec.get("pre_tokenizer") or {}, spec.get("normalizer") or {}]
    flat: list[dict[str, Any]] = []
    for part in parts:
        flat += part.get("pretokenizers") or part.get("normalizers") or [part]
    return any(
        (p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never")
        or (p.get("type") == "Prepend" and p.get("prepend") == "\u2581")
        for p in flat
    )


def _pre_tokenizer_name(pre: dict[str, Any] | None) -> str:
    from transformers.integrations.gguf import gguf_tokenizer_mapping

    if (
        pre
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space")
    ):
        return "gpt-2"
    steps = (pre or {}).get("pretokenizers") or []
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel":
        regex = steps[0].get("pattern", {}).get("Regex")
        for name in _PRE_TOKENIZER_NAMES:
            if regex == gguf_tokenizer_mapping.GGUF_PRE_TOKENIZER_SPLITS[name]:
                return name
    raise UserInputError(
        f"tokenizer pre-tokenizer {json.dumps(pre)[:200]} is not one llama.cpp knows by name; supported: "
        "ByteLevel with GPT-2's regex (lmforge's own tokenizers), the Llama 3 split, the Qwen2 split"
    )


def _special_ids(tokenizer: PreTrainedTokenizerBase, config: dict[str, Any]) -> dict[str, int | None]:
    """The tokenizer's special ids; bos/eos fall back to config.json's, as llama.cpp's converter does."""
    from lmforge.data.chat import turn_end_tokens

    vocab = tokenizer.get_vocab()
    # The chat template's end of turn (GLM's <|user|>, Gemma's <end_of_turn>); none when it is EOS.
    eot = next(
        (vocab[t] for t in turn_end_tokens(tokenizer) if t in vocab and t != tokenizer.eos_token), None
    )
    return {
        "bos": tokenizer.bos_token_id
        if tokenizer.bos_token_id is not None
        else _config_id(config, "bos_token_id"),
        "eos": tokenizer.eos_token_id
        if tokenizer.eos_token_id is not None
        else _config_id(config, "eos_token_id"),
        "unk": tokenizer.unk_token_id,
        "pad": tokenizer.pad_token_id,
        "eot": eot,
    }


def _config_id(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None
