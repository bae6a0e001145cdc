"""Memory savers around a training forward: activations kept in host memory (activation offload)
and a next-token loss that never builds the full logits (the chunked cross-entropy).

The chunked loss goes through the model's own forward, so every wrapper (DDP, FSDP2, PEFT)
sees the usual call: for the length of one training forward the output head hands the final
hidden states through unchanged, and the model's `loss_function` (which every transformers
causal LM calls with its "logits") applies the real head chunk by chunk
(train/chunked_loss.py). Evaluation and generation never see the swap."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from lmforge.config.schema import CHUNKED_LOSS_TOKENS, TrainConfig
from lmforge.errors import UserInputError
from lmforge.train.chunked_loss import SUPPORTED_MODEL_TYPES, chunked_next_token_loss


@contextmanager
def memory_savers(settings: TrainConfig | None, model: torch.nn.Module) -> Iterator[None]:
    """The savers `settings` switch on, for one training forward of `model` (HF's unwrapped model)."""
    with ExitStack() as stack:
        if settings is not None and settings.activation_offload:
            stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()))
        if settings is not None and settings.chunked_cross_entropy:
            stack.enter_context(chunked_head(model))
        yield


def describe_memory_savers(train: TrainConfig) -> str:
    """The savers a run has on, for the start banner ("" for none)."""
    every = f" (every {train.checkpoint_every} layers)" if train.checkpoint_every > 1 else ""
    return ", ".join(
        words
        for on, words in (
            (train.gradient_checkpointing, f"gradient checkpointing{every}"),
            (train.activation_offload, "activations in host memory"),
            (train.chunked_cross_entropy, f"chunked cross-entropy ({CHUNKED_LOSS_TOKENS}-token chunks)"),
            (
                train.empty_cache_steps is not None,
                f"device cache emptied every {train.empty_cache_steps} steps",
            ),
        )
        if on
    )


def causal_lm(model: torch.nn.Module) -> Any:
    """The transformers causal LM inside a PEFT wrapper, or the model itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def check_chunked_loss_fits(model: torch.nn.Module) -> None:
    """UserInputError, before training, for a model whose loss the chunked one may not reproduce:
    one outside SUPPORTED_MODEL_TYPES (each tested against its own loss), whose logits may be
    post-processed after the head (Cohere's logit_scale, Granite's logits_scaling)."""
    lm = causal_lm(model)
    model_type = getattr(lm.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or lm.get_output_embeddings() is None:
        raise UserInputError(
            f"train.chunked_cross_entropy: {type(lm).__name__} (model_type {model_type!r}) is not among the "
            f"architectures whose loss it reproduces exactly ({', '.join(sorted(SUPPORTED_MODEL_TYPES))}); "
            "remove train.chunked_cross_entropy"
        )


@contextmanager
def chunked_head(model: torch.nn.Module, chunk_tokens: int = CHUNKED_LOSS_TOKENS) -> Iterator[None]:
    """While open, `model`'s forward computes its loss chunk by chunk and returns the final
    hidden states in place of the logits. The backward may run after it closes."""
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    real_head = head.forward
    own_forward = head.__dict__.get("forward")  # a hook library's wrapper, if any
    own_loss = lm.__dict__.get("_loss_function")
    # Gemma 2 soft-caps its logits between the head and the loss: here the loss applies the cap
    # to each chunk's logits, and the model must not cap the hidden states it hands through.
    softcap = getattr(lm.config, "final_logit_softcapping", None)

    def chunked_loss(
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        # `logits` are the final hidden states here: the head passed them through.
        return chunked_next_token_loss(
            logits,
            real_head,
            labels,
            num_items_in_batch=num_items_in_batch,
            shift_labels=shift_labels,
            chunk_tokens=chunk_tokens,
            softcap=softcap,
        )

    head.forward = _pass_through
    lm.loss_function = chunked_loss
    if softcap is not None:
        lm.config.final_logit_softcapping = None
    try:
        yield
    finally:
        if own_forward is None:
            del head.forward  # the class's forward again
        else:
            head.forward = own_forward
        if own_loss is None:
            del lm._loss_function  # transformers' property picks the model's loss again
        else:
            lm.loss_function = own_loss
        if softcap is not None:
            lm.config.final_logit_softcapping = softcap


def _pass_through(hidden: torch.Tensor) -> torch.Tensor:
    return hidden
