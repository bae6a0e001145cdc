"""Next-token cross-entropy that never builds the full (tokens x vocabulary) logits.

At a 150k vocabulary the float32 logits of one micro-batch (and the log-softmax and gradient that
`cross_entropy` keeps next to them) dominate activation memory. Here the tokens are cut into
chunks and only one chunk's logits exist at a time; the loss and its gradients equal transformers'
`ForCausalLMLoss` (shift by one, float32 logits, -100 ignored, sum / `num_items_in_batch` or mean).

Two ways to compute a chunk, picked per call:
- a plain float32 `nn.Linear` head (no hooks, ordinary tensors, no softcap, no autocast) goes to
  torch's own `F.linear_cross_entropy` with chunking options (torch >= 2.13): it computes each
  chunk's gradients during the forward, so the head's matmul runs 3 times per token, not 4, and it
  held about half the memory of the path below at the same chunk size (bench/chunked_ce.py);
- any other head (LoRA-adapted, hooked, soft-capped, bf16 or autocast, an older torch) is called
  once per chunk under `torch.utils.checkpoint`, so its logits are freed after the chunk and
  recomputed in backward; the ops are transformers' own, so bf16 results match it exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100

Head = Callable[[torch.Tensor], torch.Tensor]

# Model types whose causal-LM forward is exactly `lm_head(backbone(...).last_hidden_state)`, with
# at most Gemma's `final_logit_softcapping` after the head; each one is compared with the model's
# own loss in tests/test_chunked_loss.py. Anything else may post-process its logits in ways this
# loss would silently miss (Cohere multiplies by `logit_scale`, Granite divides by
# `logits_scaling`, HyperCLOVA X multiplies by it, MoE models add a router loss), so it is refused.
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo2",
        "gpt2",
        "gpt_neox",
        "starcoder2",
    }
)


def chunked_next_token_loss(
    hidden: torch.Tensor,
    head: Head,
    labels: torch.Tensor | None,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_tokens: int = 4096,
    softcap: float | None = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` on `head(hidden)`, without materialising all the logits.

    `hidden` is (batch, seq, d), the final hidden states after the final norm; `head` is the
    output embedding module (or its bound `forward`), called rather than multiplied by its weight
    so a LoRA-adapted or biased head works. Position t predicts `labels[t + 1]`; `shift_labels`
    (already shifted, as padding-free and sequence-parallel batches carry them) replaces that
    shift when given. -100 is ignored. With `num_items_in_batch` the loss is sum / that count
    (HF Trainer's normalisation across gradient accumulation), else the mean over kept tokens.
    `softcap` applies Gemma's `cap * tanh(logits / cap)` before the cross-entropy.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    targets = _next_token_targets(hidden, labels, shift_labels)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    # Ignored positions (prompt, padding, each row's last token) cost nothing in the loss, so they
    # never reach the head: on SFT batches that skips a large share of the head's work. The
    # selection is data-dependent, one host sync on a GPU.
    kept = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    kept_hidden = flat_hidden.index_select(0, kept)
    kept_targets = targets.index_select(0, kept)

    linear = _plain_linear(head, hidden) if softcap is None else None
    if linear is not None and kept.numel() > 0:
        total = _torch_linear_ce_sum(kept_hidden, kept_targets, linear, chunk_tokens)
    else:
        total = _checkpointed_ce_sum(kept_hidden, kept_targets, head, chunk_tokens, softcap)
    return _normalise(total, num_items_in_batch, kept_tokens=kept.numel())


def _next_token_targets(
    hidden: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None
) -> torch.Tensor:
    """The flat (batch * seq,) class each hidden state must predict, -100 where none."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_next_token_loss needs labels or shift_labels")
        # As ForCausalLMLoss: pad one -100 on the right, so the last position predicts nothing.
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    if shift_labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels of shape {tuple(shift_labels.shape)} do not match hidden states "
            f"{tuple(hidden.shape)}: expected (batch, seq) = {tuple(hidden.shape[:-1])}"
        )
    return shift_labels.reshape(-1).to(hidden.device)


def _normalise(
    total: torch.Tensor, num_items_in_batch: torch.Tensor | int | None, *, kept_tokens: int
) -> torch.Tensor:
    """Sum / num_items_in_batch when given, else the mean over kept tokens (NaN when there are none,
    as cross_entropy's mean gives)."""
    if num_items_in_batch is None:
        return total / kept_tokens
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _chunk_ce_sum(
    hidden_chunk: torch.Tensor, target_chunk: torch.Tensor, head: Head, softcap: float | None
) -> torch.Tensor:
    """Summed cross-entropy of one chunk, with logits upcast to float32 as transformers does."""
    logits = head(hidden_chunk)
    if softcap is not None:
        # In the head's dtype, then upcast: the order Gemma's forward and its loss use.
        logits = torch.tanh(logits / softcap) * softcap
    # .to: a head placed on another device (a device map) hands its logits back there.
    return F.cross_entropy(logits.float(), target_chunk.to(logits.device), reduction="sum")


def _checkpointed_ce_sum(
    hidden: torch.Tensor, targets: torch.Tensor, head: Head, chunk_tokens: int, softcap: float | None
) -> torch.Tensor:
    """Sum over chunks; each chunk's logits are dropped after its forward and recomputed in backward."""
    total = hidden.new_zeros((), dtype=torch.float32)
    # max(.., 1): with no kept token one empty chunk still runs, so the zero loss stays connected
    # to the graph and backward works (and gives zero gradients) as on any other batch.
    for start in range(0, max(hidden.shape[0], 1), chunk_tokens):
        end = start + chunk_tokens
        chunk_sum = checkpoint(
            _chunk_ce_sum, hidden[start:end], targets[start:end], head, softcap, use_reentrant=False
        )
        total = total + chunk_sum.to(total.device)
    return total


def _plain_linear(head: Head, hidden: torch.Tensor) -> nn.Linear | None:
    """`head` as an nn.Linear whose weight can be used directly, or None to call it instead.

    Only an exact nn.Linear qualifies (a subclass such as a quantised or LoRA layer computes
    something else), with ordinary tensors as weights (not a DTensor or a ZeRO-3 placeholder) and,
    when the module itself is passed, no hooks that calling it would run (device-map or sharding
    hooks). Its bound `forward` runs no hooks, so it qualifies as well.
    """
    if not hasattr(nn, "LinearCrossEntropyOptions") or hidden.device.type not in ("cpu", "cuda"):
        return None  # torch < 2.13, or a device the op was not measured on
    # float32 only: with bf16 or fp16 inputs the op returns its loss in that dtype (measured 4.5625
    # against transformers' 4.5729 under bf16 autocast), where transformers upcasts the logits.
    if hidden.dtype != torch.float32 or torch.is_autocast_enabled(hidden.device.type):
        return None
    module = head if isinstance(head, nn.Module) else getattr(head, "__self__", None)
    if type(module) is not nn.Linear:
        return None
    if head is module:
        if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):
            return None
    elif getattr(head, "__func__", None) is not nn.Linear.forward:
        return None
    params = [module.weight] if module.bias is None else [module.weight, module.bias]
    if any(
        type(p) not in (torch.Tensor, nn.Parameter) or hasattr(p, "ds_id") or p.dtype != torch.float32
        for p in params
    ):
        return None
    return module


def _torch_linear_ce_sum(
    hidden: torch.Tensor, targets: torch.Tensor, linear: nn.Linear, chunk_tokens: int
) -> torch.Tensor:
    """Summed cross-entropy of `linear(hidden)` by torch's chunked F.linear_cross_entropy."""
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_tokens, chunking_method=None)
    return F.linear_cross_entropy(
        hidden, linear.weight, targets, linear_bias=linear.bias, reduction="sum", options=options
    )
