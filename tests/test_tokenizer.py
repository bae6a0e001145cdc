"""Training a byte-level BPE tokenizer with ChatML, saving, loading and fingerprinting it."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lmforge.config.hub_names import hub_unreachable_reason
from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.tokenizer import (
    CHATML_TEMPLATE,
    batch_encoder,
    load_tokenizer,
    tokenizer_fingerprint,
    train_tokenizer,
)
from lmforge.errors import UserInputError

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "Unicode stays exact: café, naïve, 日本語, emoji 🚀\n",
] * 60
SAMPLES = ["  leading spaces and\ttabs\n\n", "café 🚀 <not special>", "x" * 300]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer(TEXTS, TokenizerTrainConfig(vocab_size=400, min_frequency=1))


def test_special_tokens_eos_and_pad_are_set(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id is not None
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id not in (None, tokenizer.eos_token_id)
    for special in ["<|im_start|>", "<|im_end|>"]:
        assert len(tokenizer.encode(special, add_special_tokens=False)) == 1
    assert 260 < len(tokenizer) <= 400  # 256 bytes + 4 specials + merges, capped by vocab_size
    # No BOS/EOS is added implicitly: packing adds EOS itself.
    assert tokenizer("hi")["input_ids"] == tokenizer("hi", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_level_decoding_is_exact(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_renders_chatml(tokenizer: PreTrainedTokenizerFast) -> None:
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_marks_assistant_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    out = tokenizer.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assistant_ids = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tokenizer.decode(assistant_ids) == "hello<|im_end|>"


def test_save_and_load_round_trip(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path / "tok")
    for loaded in [load_tokenizer(str(tmp_path / "tok")), AutoTokenizer.from_pretrained(tmp_path / "tok")]:
        assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(tokenizer)
        assert (loaded.eos_token_id, loaded.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
        assert loaded.chat_template == CHATML_TEMPLATE
        assert loaded.apply_chat_template(CHAT, tokenize=False) == tokenizer.apply_chat_template(
            CHAT, tokenize=False
        )
        for text in SAMPLES:
            assert loaded.encode(text) == tokenizer.encode(text)


def test_fingerprint_tracks_what_decides_ids(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    before = tokenizer_fingerprint(tokenizer)
    tokenizer(["a", "bb b"], padding=True, truncation=True, max_length=4)  # per-call settings: no effect
    assert tokenizer_fingerprint(tokenizer) == before
    other = train_tokenizer(TEXTS, TokenizerTrainConfig(vocab_size=300, min_frequency=1))
    assert tokenizer_fingerprint(other) != before
    tokenizer.save_pretrained(tmp_path / "tok")
    changed = load_tokenizer(str(tmp_path / "tok"))
    changed.chat_template = "{{ messages[0]['content'] }}"
    assert tokenizer_fingerprint(changed) != before


def test_training_stops_after_max_chars() -> None:
    texts = ["ab " * 400, "xyz " * 5000]  # the second text lies beyond max_chars
    tokenizer = train_tokenizer(texts, TokenizerTrainConfig(vocab_size=400, min_frequency=1, max_chars=1200))
    assert not any("xy" in token for token in tokenizer.get_vocab())
    assert any("ab" in token for token in tokenizer.get_vocab())


def test_training_on_no_text_is_a_user_error() -> None:
    with pytest.raises(UserInputError, match=r"no BPE merges.*Fix"):
        train_tokenizer([], TokenizerTrainConfig(vocab_size=400))


def test_missing_local_tokenizer_names_the_path_and_fix(tmp_path: Path) -> None:
    missing = tmp_path / "no-tokenizer-here"
    with pytest.raises(UserInputError, match=rf"{re.escape(str(missing))}.*does not exist.*Fix"):
        load_tokenizer(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        UserInputError, match=r"holds no tokenizer.json or tokenizer_config.json.*save_pretrained"
    ):
        load_tokenizer(str(empty))


@pytest.mark.usefixtures("unreachable_hub")
def test_a_missing_relative_directory_is_not_looked_up_on_an_unreachable_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`runs/calc-tokenizer` before the step that makes it: also a valid hub id, but with no way to the
    hub the error comes at once (transformers retried 5 times per file, ~45 s and 24 warnings)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserInputError) as raised, caplog.at_level(logging.WARNING):
        load_tokenizer("runs/calc-tokenizer", key="model.path")
    assert str(raised.value) == (
        f"model.path: 'runs/calc-tokenizer' is no local directory ({tmp_path}/runs/calc-tokenizer does "
        "not exist), and as a hub id it cannot be looked up: the Hugging Face hub (127.0.0.1) cannot be "
        "reached (Connection refused). Fix: make that directory first (a previous step's run), point "
        "tokenizer.path (or model.path) at one with tokenizer.json, or set tokenizer.train to train one. A "
        "hub model: download it where a network exists (`hf download runs/calc-tokenizer --local-dir DIR`) "
        "and set model.path to DIR."
    )
    assert not [r for r in caplog.records if r.name.startswith("huggingface_hub")]  # no retries
    hub_unreachable_reason.cache_clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_unreachable_reason() == "HF_HUB_OFFLINE is set"
    hub_unreachable_reason.cache_clear()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert hub_unreachable_reason() is None  # through a proxy: left to the hub client


def test_batch_encoder_never_truncates_and_leaves_the_tokenizer_alone(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    tokenizer.save_pretrained(tmp_path / "tok")
    truncating = load_tokenizer(str(tmp_path / "tok"))
    truncating.backend_tokenizer.enable_truncation(max_length=4)  # as some tokenizer.json files ship
    ids = batch_encoder(truncating)(SAMPLES)
    assert ids == [tokenizer.encode(text, add_special_tokens=False) for text in SAMPLES]
    assert truncating.backend_tokenizer.truncation is not None
