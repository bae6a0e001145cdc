"""Tokenizing a stream of SFT conversations into ragged samples, in a process pool when it pays.

Rendering chat templates is Python-bound, so chunks of conversations are tokenized in
forked worker processes with a bounded number of chunks in flight (memory stays flat
however large the input is); results come back in order, so the output is exactly the
single-process one. Rows the length policy drops are counted per reason.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from lmforge.config.schema import DataConfig
from lmforge.data.chat import Dropped, TokenizedSample, tokenize_conversations
from lmforge.data.examples import Conversation
from lmforge.data.ragged import RaggedSamples
from lmforge.errors import UserInputError
from lmforge.verbosity import progress_bar

if TYPE_CHECKING:
    from lmforge.data.vision_tokens import ImageTokens

# Conversations per batched tokenizer call: enough to keep the Rust backend's threads busy,
# few enough that one chunk's Python objects stay small.
_TOKENIZE_CHUNK = 512


class SampleTokenizer:
    """Renders and tokenizes conversations per the data settings; counts what it drops."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        template: str,
        image_tokens: ImageTokens | None = None,
    ) -> None:
        self.cfg, self.tokenizer, self.template = cfg, tokenizer, template
        self.image_tokens = image_tokens
        self.dropped: Counter[str] = Counter()
        self.truncated: Counter[str] = Counter()  # samples cut to data.max_length, per split

    def all(self, examples: Iterable[Any], split: str, *, workers: int) -> RaggedSamples:
        """Every example of `split` as samples, in order; `workers` processes tokenize them."""
        ids: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        settings = {
            "template": self.template,
            "train_on": self.cfg.train_on,
            "max_length": self.cfg.max_length,
            "over_length": self.cfg.over_length,
            "image_tokens": self.image_tokens,
        }
        images: list[list[list[str]]] = []
        chunks = (list(map(as_conversation, chunk)) for chunk in _chunks(examples, _TOKENIZE_CHUNK))
        with progress_bar(desc=f"tokenize {split}", unit="row") as bar:
            for chunk in _tokenized_chunks(chunks, self.tokenizer, settings, workers):
                for reason in chunk.dropped:
                    self.dropped[f"{split}: {reason}"] += 1
                if chunk.truncated:
                    self.truncated[split] += chunk.truncated
                ids.append(chunk.input_ids)
                labels.append(chunk.labels)
                lengths.append(chunk.lengths)
                images.append(chunk.images)
                bar.update(chunk.rows)
        return RaggedSamples.from_chunks(ids, labels, lengths, images)


@dataclass
class _TokenizedChunk:
    """One chunk's samples as flat arrays (what a worker sends back: three arrays pickle far
    cheaper than a TokenizedSample per row) and the reasons of the rows it dropped, in order."""

    input_ids: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    dropped: list[str]
    rows: int
    truncated: int  # kept samples that were cut to data.max_length
    images: list[list[str]]  # each kept sample's image files


def _pack(results: list[TokenizedSample | Dropped]) -> _TokenizedChunk:
    kept = [r for r in results if isinstance(r, TokenizedSample)]
    empty = np.zeros(0, dtype=np.int32)
    return _TokenizedChunk(
        np.concatenate([r.input_ids for r in kept]) if kept else empty,
        np.concatenate([r.labels for r in kept]) if kept else empty,
        np.fromiter((len(r.input_ids) for r in kept), dtype=np.int64, count=len(kept)),
        [r.reason for r in results if isinstance(r, Dropped)],
        len(results),
        sum(r.truncated for r in kept),
        [r.images for r in kept],
    )


def _tokenized_chunks(
    chunks: Iterator[list[Conversation]],
    tokenizer: PreTrainedTokenizerBase,
    settings: dict[str, Any],
    workers: int,
) -> Iterator[_TokenizedChunk]:
    """Tokenize chunks in order; with several workers, in a process pool with a bounded number
    of chunks in flight, so memory stays flat however large the input is."""
    first = next(chunks, None)
    if first is None:
        return
    second = next(chunks, None)
    if workers == 1 or second is None or "fork" not in mp.get_all_start_methods():
        # One chunk (or one core): a pool's start-up would cost more than it saves.
        for chunk in itertools.chain([first], [second] if second else [], chunks):
            yield _pack(tokenize_conversations(chunk, tokenizer, **settings))
        return
    # fork: workers inherit the tokenizer without pickling it or re-importing transformers.
    with mp.get_context("fork").Pool(
        workers, initializer=_init_worker, initargs=(tokenizer, settings)
    ) as pool:
        pending: deque[Any] = deque()
        for chunk in itertools.chain([first, second], chunks):
            pending.append(pool.apply_async(_tokenize_in_worker, (chunk,)))
            if len(pending) > 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: PreTrainedTokenizerBase, settings: dict[str, Any]) -> None:
    _WORKER["tokenizer"], _WORKER["settings"] = tokenizer, settings


def _tokenize_in_worker(chunk: list[Conversation]) -> _TokenizedChunk:
    return _pack(tokenize_conversations(chunk, _WORKER["tokenizer"], **_WORKER["settings"]))


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def as_conversation(example: Any) -> Conversation:
    """`example` as a Conversation; UserInputError naming its row when it is another kind (a
    preference or KTO row in an SFT dataset)."""
    if not isinstance(example, Conversation):
        raise UserInputError(
            f"{example.origin.file}:{example.origin.line}: a {type(example).__name__} row in an SFT "
            "dataset; preference and KTO data need train.stage dpo / kto"
        )
    return example
