"""Perplexity: exp of the mean next-token negative log-likelihood over the tokens that carry labels.

One summation (`_nll_sum`) serves every data shape: fixed blocks of text, answer tokens of
QA rows, and the batches a run's eval collator makes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmforge.data.chat import IGNORE_INDEX, TokenizedSample, resolve_template, tokenize_conversation
from lmforge.data.collate import PaddedCollator
from lmforge.data.examples import Conversation, Message, Origin
from lmforge.verbosity import progress_bar


def text_perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    block_size: int = 256,
    batch_size: int = 8,
    limit: int | None = None,
) -> dict[str, Any]:
    """Token-level perplexity of `texts` (joined with EOS, as pretraining packs them) in fixed blocks.

    A shorter last block is kept; `limit` caps the number of blocks.
    """
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream = [t for text in texts for t in [*tokenizer(text, add_special_tokens=False)["input_ids"], *eos]]
    blocks = [stream[i : i + block_size] for i in range(0, len(stream), block_size)]
    blocks = [b for b in blocks if len(b) > 1][:limit]
    samples = [{"input_ids": b, "labels": b} for b in blocks]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    result = dataset_perplexity(model, samples, PaddedCollator(pad_id), batch_size=batch_size)
    return {**result, "blocks": len(blocks), "block_size": block_size}


def answer_perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, str]],
    *,
    batch_size: int = 8,
    max_length: int = 1024,
) -> dict[str, Any]:
    """Perplexity over the answer tokens (end-of-turn included) of QA rows rendered as chats,
    with the loss mask training uses."""
    template = resolve_template(tokenizer, None)
    samples = []
    for number, row in enumerate(rows, start=1):
        conversation = Conversation(
            [Message("user", row["question"]), Message("assistant", row["answer"])], Origin("rows", number)
        )
        sample = tokenize_conversation(
            conversation,
            tokenizer,
            template=template,
            train_on="last_assistant",
            max_length=max_length,
            over_length="truncate",
        )
        if isinstance(sample, TokenizedSample):  # a Dropped sample has nothing to score
            samples.append(sample.as_features())
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return dataset_perplexity(model, samples, PaddedCollator(pad_id), batch_size=batch_size)


@torch.inference_mode()
def dataset_perplexity(
    model: PreTrainedModel,
    dataset: Dataset | Sequence[Any],
    collator: Callable[[list[Any]], dict[str, Any]],
    *,
    batch_size: int = 8,
    limit: int | None = None,
) -> dict[str, Any]:
    """Perplexity over the labelled tokens of `dataset` batched by `collator` (a run's eval data)."""
    loader: Iterable[dict[str, Any]] = DataLoader(dataset, batch_size=batch_size, collate_fn=collator)  # type: ignore[arg-type]
    nll, tokens, batches = 0.0, 0, 0
    for batch in progress_bar(loader, desc="perplexity", unit="batch"):
        if limit is not None and batches * batch_size >= limit:
            break
        batch_nll, batch_tokens = _nll_sum(model, batch)
        nll, tokens, batches = nll + batch_nll, tokens + batch_tokens, batches + 1
    loss = nll / tokens if tokens else float("nan")
    return {"perplexity": _safe_exp(loss), "loss": loss, "tokens": tokens}


def _nll_sum(model: PreTrainedModel, batch: dict[str, Any]) -> tuple[float, int]:
    """Summed next-token NLL and the number of predicted tokens (labels are unshifted, -100 = none)."""
    labels = batch["labels"].to(model.device)
    inputs = {
        k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k != "labels"
    }
    logits = model(**inputs).logits.float()
    targets = labels[:, 1:]
    nll = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return float(nll), int((targets != IGNORE_INDEX).sum())


def _safe_exp(loss: float) -> float:
    if not np.isfinite(loss):
        return float("nan")
    return math.exp(loss) if loss < 700 else float("inf")
