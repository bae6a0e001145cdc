"""Training, loading and fingerprinting tokenizers.

`train_tokenizer` builds a byte-level BPE tokenizer (GPT-2 style: every byte is in the
vocabulary, so no text is ever unknown) with ChatML special tokens and a ChatML chat
template, wrapped as a transformers fast tokenizer that round-trips through
`save_pretrained` / `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from lmforge.config.hub_names import is_hub_id, not_here_and_no_hub
from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.encoding import BatchEncoder, rust_encoder
from lmforge.errors import UserInputError

log = logging.getLogger(__name__)
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, IM_START, IM_END]

# ChatML. The {% generation %} markers let transformers return an assistant-token mask
# (`return_assistant_tokens_mask=True`) for training on assistant replies only; they
# render nothing otherwise. The reply's <|im_end|> is inside the span so models learn to stop.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _limit_chars(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    """Yield texts until `max_chars` characters have been given (the last one cut to fit)."""
    remaining = max_chars
    for text in texts:
        if remaining <= 0:
            return
        yield text[:remaining]
        remaining -= len(text)


def train_tokenizer(texts: Iterable[str], cfg: TokenizerTrainConfig) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on at most `cfg.max_chars` characters of `texts`.

    The result has `<|endoftext|>` as eos, `<|pad|>` as pad, `<|im_start|>`/`<|im_end|>`
    as extra special tokens, and a ChatML chat template. No BOS is added when encoding.
    """
    backend = Tokenizer(models.BPE())
    # add_prefix_space=False keeps encode(a + b) == encode(a) + encode(b) at line starts,
    # which is what packed pretraining and chat templates assume.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    backend.train_from_iterator(_limit_chars(texts, cfg.max_chars), trainer=trainer)
    if backend.get_vocab_size() <= len(SPECIAL_TOKENS) + 256:
        raise UserInputError(
            "tokenizer.train: the training text produced no BPE merges (is the data empty?). "
            "Fix: check data.train sources, or lower tokenizer.train.min_frequency."
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,  # byte-level decoding is already exact
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def load_tokenizer(
    path: str, trust_remote_code: bool = False, *, key: str = "tokenizer.path"
) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local HF directory, or from the hub when `path` is a hub id.

    Local files are tried first; the network is used only for a hub id not found locally.
    Raises UserInputError with the path and a fix when nothing loads.
    """
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        local_error = err
    if is_hub_id(path):
        offline = not_here_and_no_hub(
            key,
            path,
            "make that directory first (a previous step's run), point tokenizer.path "
            "(or model.path) at one with tokenizer.json, or set tokenizer.train to train one.",
        )
        if offline:
            raise UserInputError(offline)
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            raise UserInputError(
                f"tokenizer {path!r}: not found locally and could not be loaded from the hub ({err}). "
                "Fix: give a local directory with tokenizer.json, connect to the network, or set "
                "tokenizer.train to train one."
            ) from None
    raise UserInputError(
        f"tokenizer path {path!r} {_why_not_loadable(Path(path).expanduser(), local_error)}. "
        "Fix: point tokenizer.path (or model.path) at a directory saved with save_pretrained "
        "(tokenizer.json + tokenizer_config.json), or set tokenizer.train to train one."
    )


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give a tokenizer without a pad token (Llama-2, Llama-3 and Mistral base tokenizers) a
    stand-in: EOS, else UNK. Every collator masks padding out of attention and labels, so the
    id only fills positions nothing reads; saying so once keeps the choice visible."""
    if tokenizer.pad_token_id is not None:
        return
    stand_in = tokenizer.eos_token if tokenizer.eos_token_id is not None else tokenizer.unk_token
    if stand_in is None:
        raise UserInputError(
            "tokenizer: it has no pad, eos or unk token, so batches cannot be padded. Fix: add a pad "
            "token to the tokenizer (tokenizer.add_special_tokens({'pad_token': '<pad>'}) and "
            "save_pretrained), or train one with tokenizer.train"
        )
    tokenizer.pad_token = stand_in
    log.info(
        "tokenizer: it has no pad token; batches pad with %r (id %d), which attention masks and labels ignore",
        stand_in,
        tokenizer.pad_token_id,
    )


def _why_not_loadable(where: Path, error: Exception) -> str:
    if not where.exists():
        return f"({where.resolve()}) does not exist"
    if where.is_dir() and not any(
        (where / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        return f"({where.resolve()}) holds no tokenizer.json or tokenizer_config.json"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"({where.resolve()}) holds no loadable tokenizer: {first_line}"


def _backend_json(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return json.dumps(tokenizer.get_vocab(), sort_keys=True)
    state = json.loads(backend.to_str())
    # transformers sets padding/truncation on the backend per call; they don't change ids.
    state.pop("padding", None)
    state.pop("truncation", None)
    return json.dumps(state, sort_keys=True)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of what decides token ids: the serialized tokenizer, special tokens and chat template."""
    special = {
        "special_tokens": tokenizer.special_tokens_map,
        "all_special_ids": tokenizer.all_special_ids,
        "chat_template": tokenizer.chat_template,
    }
    digest = hashlib.sha256(_backend_json(tokenizer).encode())
    digest.update(json.dumps(special, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def batch_encoder(tokenizer: PreTrainedTokenizerBase) -> BatchEncoder:
    """A function giving the token ids of a batch of texts: no special tokens, never truncated
    or padded, encoded by the Rust backend (which releases the GIL) when there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (pure Python) tokenizer: correct, just slower
        return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]
    return rust_encoder(backend)
