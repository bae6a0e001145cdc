"""The chunked next-token loss equals transformers' own loss (value and gradients) on tiny models,
and it really holds less memory than the full logits at a 150k vocabulary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lmforge.errors import UserInputError
from lmforge.train.chunked_loss import (
    SUPPORTED_MODEL_TYPES,
    chunked_next_token_loss,
)
from lmforge.train.memory_savers import check_chunked_loss_fits, chunked_head

VOCAB = 97
TOL = {"rtol": 1e-5, "atol": 1e-5}
# Batch 2 x 11 tokens with right padding: 16 kept targets, which chunks of 5 tokens do not divide.
SMALL_CHUNK = 5


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny tensors: a second OpenMP thread only adds spin-waits, which on a loaded 2-core machine
    # made each model test 50x slower (1.7 s instead of 0.03 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(model_type: str, **overrides: object) -> PreTrainedModel:
    """An untrained 2-layer causal LM of `model_type` with 32-wide states, in float32, no dropout."""
    if model_type == "gpt2":
        dims: dict[str, object] = {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    else:
        dims = {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        }
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, **dims, **ids, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.float().eval()  # eval: no dropout, so two forwards are comparable


def padded_batch() -> dict[str, torch.Tensor]:
    """Two rows, the second right-padded by 3, its padding and the first row's first 2 tokens
    (a "prompt") labelled -100."""
    torch.manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (2, 11))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0
    input_ids[1, -3:] = 0
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[0, :2] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def loss_and_grads(
    model: torch.nn.Module, loss: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same_as_hf(model: torch.nn.Module, batch: dict[str, torch.Tensor], **loss_kwargs: object) -> None:
    """Our loss and every parameter's gradient equal `model(**batch).loss`'s to 1e-5."""
    hf_inputs = {**batch, **loss_kwargs}
    expected, expected_grads = loss_and_grads(model, model(**hf_inputs).loss)
    with chunked_head(model, chunk_tokens=SMALL_CHUNK):  # what a training forward runs under
        chunked = model(**hf_inputs)
    assert chunked.logits.shape[-1] == model.config.get_text_config().hidden_size  # no logits built
    got, got_grads = loss_and_grads(model, chunked.loss)
    torch.testing.assert_close(got, expected, **TOL)
    assert got_grads.keys() == expected_grads.keys() and got_grads
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=f"gradient of {name}")


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_MODEL_TYPES))
def test_equals_hf_loss_for_each_supported_model_type(model_type: str) -> None:
    # gemma2 also covers final_logit_softcapping (30.0 by default); gemma, gpt2 and starcoder2
    # tie the head to the input embeddings by default.
    assert_same_as_hf(tiny_model(model_type), padded_batch())


def test_tied_llama_head() -> None:
    model = tiny_model("llama", tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert_same_as_hf(model, padded_batch())


@pytest.mark.parametrize("num_items", [40, torch.tensor(40)])
def test_num_items_in_batch(num_items: int | torch.Tensor) -> None:
    # HF Trainer passes the token count of all accumulated micro-batches: sum / that count.
    assert_same_as_hf(tiny_model("qwen2"), padded_batch(), num_items_in_batch=num_items)


def test_num_items_in_batch_from_inputs() -> None:
    model = tiny_model("llama")
    batch = padded_batch()
    expected = model(**batch, num_items_in_batch=40).loss
    with chunked_head(model, chunk_tokens=SMALL_CHUNK):
        got = model(**batch, num_items_in_batch=40).loss
    torch.testing.assert_close(got, expected, **TOL)


def test_shift_labels_replace_the_shift() -> None:
    # Padding-free and sequence-parallel batches carry labels already shifted.
    model = tiny_model("llama")
    batch = padded_batch()
    shift_labels = torch.roll(batch["labels"], 3, dims=1)
    assert_same_as_hf(model, {**batch, "shift_labels": shift_labels})


@pytest.mark.parametrize("target_modules", [["q_proj", "v_proj"], ["q_proj", "v_proj", "lm_head"]])
def test_peft_lora(target_modules: list[str]) -> None:
    torch.manual_seed(2)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=target_modules)
    model = get_peft_model(tiny_model("llama"), config)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; nonzero so the adapters change the loss
            torch.nn.init.normal_(param, std=0.1)
    batch = padded_batch()
    with model.disable_adapter():
        base_loss = model(**batch).loss.item()
    assert abs(model(**batch).loss.item() - base_loss) > 1e-3
    assert_same_as_hf(model, batch)


@pytest.mark.parametrize("model_type", ["cohere", "granite"])
def test_logit_scaling_models_are_refused_before_training(model_type: str) -> None:
    # Cohere multiplies its logits by logit_scale, Granite divides by logits_scaling.
    with pytest.raises(UserInputError, match=f"model_type '{model_type}'"):
        check_chunked_loss_fits(tiny_model(model_type))


def test_the_model_is_itself_again_after_the_chunked_forward() -> None:
    model = tiny_model("gemma2")  # also puts back the soft cap it lifts
    batch = padded_batch()
    before = model(**batch).logits
    with chunked_head(model, chunk_tokens=SMALL_CHUNK):
        model(**batch).loss.backward()
    torch.testing.assert_close(model(**batch).logits, before, rtol=0, atol=0)
    assert model.config.final_logit_softcapping == 30.0


def reference_loss(hidden, weight, bias, labels, num_items=None):  # type: ignore[no-untyped-def]
    logits = F.linear(hidden, weight, bias).float()
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    reduction = "mean" if num_items is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, weight.shape[0]), targets.reshape(-1), reduction=reduction)
    return loss if num_items is None else loss / num_items


@pytest.mark.parametrize("via", ["module", "bound_forward", "callable"])
@pytest.mark.parametrize("num_items", [None, 30])
def test_function_gradients_wrt_hidden_and_head(via: str, num_items: int | None) -> None:
    # "module" and "bound_forward" take torch's F.linear_cross_entropy; a lambda is called per
    # checkpointed chunk. A biased head; 12 kept targets (4 labelled -100), in chunks of 5 tokens.
    torch.manual_seed(3)
    head = torch.nn.Linear(16, 301)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 301, (2, 9))
    labels[0, 3:7] = -100
    callable_head = {"module": head, "bound_forward": head.forward, "callable": lambda h: head(h)}[via]

    expected = reference_loss(hidden, head.weight, head.bias, labels, num_items)
    want = torch.autograd.grad(expected, [hidden, head.weight, head.bias])
    got = chunked_next_token_loss(hidden, callable_head, labels, num_items_in_batch=num_items, chunk_tokens=5)
    have = torch.autograd.grad(got, [hidden, head.weight, head.bias])
    torch.testing.assert_close(got, expected, **TOL)
    for name, g_have, g_want in zip(("hidden", "weight", "bias"), have, want, strict=True):
        torch.testing.assert_close(g_have, g_want, **TOL, msg=name)


@pytest.mark.parametrize("via", ["module", "callable"])
def test_no_kept_token(via: str) -> None:
    # As cross_entropy's mean: NaN for a batch with nothing to predict; 0 with num_items_in_batch,
    # and backward still runs (zero gradients) so a step over such a micro-batch does not crash.
    head = torch.nn.Linear(8, 50)
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    labels = torch.full((1, 4), -100)
    callable_head = head if via == "module" else (lambda h: head(h))
    assert torch.isnan(chunked_next_token_loss(hidden, callable_head, labels))
    loss = chunked_next_token_loss(hidden, callable_head, labels, num_items_in_batch=7)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad is not None and not hidden.grad.any()


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_bf16_autocast(model_type: str) -> None:
    # Under autocast the head's logits are bf16, upcast before the loss, as in transformers (torch's
    # op would return a bf16-rounded loss here, so the checkpointed path runs): the loss is equal.
    # The gradients are bf16 matmuls over other token groupings, so they differ by bf16 rounding:
    # measured at most 0.34% (llama) and 0.16% (gemma2) of a gradient's norm, where transformers'
    # own bf16 gradients are 0.8% and 1.5% away from its float32 ones.
    model = tiny_model(model_type)
    batch = padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_grads = loss_and_grads(model, model(**batch).loss)
        with chunked_head(model, chunk_tokens=SMALL_CHUNK):
            loss = model(**batch).loss
        got, got_grads = loss_and_grads(model, loss)
    torch.testing.assert_close(got, expected, **TOL)
    for name, grad in expected_grads.items():
        assert (got_grads[name] - grad).norm() < 0.01 * grad.norm(), name


PEAK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.nn.functional as F
    from lmforge.train.chunked_loss import chunked_next_token_loss

    variant, batch, seq, width, vocab = sys.argv[1], *map(int, sys.argv[2:])

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def loss_of(head, hidden, labels):
        if variant == "full":
            logits = head(hidden).float()
            targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
            return F.cross_entropy(logits.reshape(-1, head.out_features), targets.reshape(-1))
        how = head if variant == "torch_op" else (lambda h: head(h))
        return chunked_next_token_loss(hidden, how, labels, chunk_tokens=64)

    # A tiny first call, so the code paths' lazy imports (80 MiB) fall outside the measured peak.
    tiny = torch.randn(1, 4, width, requires_grad=True)
    loss_of(torch.nn.Linear(width, 16), tiny, torch.ones(1, 4).long()).backward()
    torch.manual_seed(0)
    head = torch.nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(batch, seq, width, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq))
    before = rss()
    # The high-water mark restarts here (Linux: clear_refs 5), so an earlier peak (imports, the
    # model's setup) cannot pass for this forward+backward's.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    loss = loss_of(head, hidden, labels)
    loss.backward()
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024
    print(json.dumps({"peak_over_start": peak - before, "loss": loss.item()}))
    """
)


def peak_memories(variants: list[str], *shape: int) -> dict[str, dict[str, float]]:
    """Peak RSS above the start of forward+backward for each variant, each in a fresh process (so
    no other peak counts); the processes run side by side, which changes no one's memory."""
    # A fixed mmap threshold: glibc's dynamic one keeps freed blocks under 32 MiB in the heap, and
    # RSS would count those dead chunks (bench/chunked_ce.py shows by how much).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    procs = {
        variant: subprocess.Popen(
            [sys.executable, "-c", PEAK_SCRIPT, variant, *map(str, shape)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for variant in variants
    }
    results = {}
    for variant, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results[variant] = json.loads(out.strip().splitlines()[-1])
    return results


def test_peak_memory_is_lower_at_150k_vocabulary() -> None:
    # Batch 2 x 128 tokens, vocabulary 150,000, width 64 (small, so the head's weight and its
    # gradient do not hide the logits): the float32 logits alone are 146 MiB. Measured peak over
    # the start of forward+backward, chunks of 64 tokens: full 441 MiB (logits, log-softmax and
    # their gradient), torch's op 75 MiB, checkpointed 148 MiB: 2.5x and 2.0x the logits saved.
    batch, seq, width, vocab = 2, 128, 64, 150_000
    logits_bytes = batch * seq * vocab * 4
    peaks = peak_memories(["full", "torch_op", "checkpoint"], batch, seq, width, vocab)
    for variant in ("torch_op", "checkpoint"):
        assert peaks[variant]["loss"] == pytest.approx(peaks["full"]["loss"], rel=1e-5)
        saved = peaks["full"]["peak_over_start"] - peaks[variant]["peak_over_start"]
        assert saved > 1.5 * logits_bytes, (variant, peaks)
