"""Packing: best-fit bins, collator layouts, and the proof that packed samples stay isolated."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerFast, set_seed

from lmforge.config.schema import ModelConfig, TokenizerTrainConfig
from lmforge.data.collate import (
    IGNORE_INDEX,
    PackedCollator,
    PaddedCollator,
    PaddingFreeCollator,
)
from lmforge.data.packing import best_fit_pack, pack_samples, packing_stats
from lmforge.data.tokenizer import train_tokenizer
from lmforge.models.build import build_model

TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # Larger than the default 0.02 so attention patterns (and any leak) visibly move the loss.
    "initializer_range": 0.2,
}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    text = ["the cat sat on the mat and the dog ran far away\n", "one two three four five six\n"] * 100
    return train_tokenizer(text, TokenizerTrainConfig(vocab_size=320, min_frequency=1))


def tiny_llama(tokenizer: PreTrainedTokenizerFast, attn_implementation: str) -> PreTrainedModel:
    set_seed(0)
    cfg = ModelConfig(preset="llama-tiny", config=TINY_LLAMA, attn_implementation=attn_implementation)
    return build_model(cfg, tokenizer, max_length=128).eval()


def random_samples(vocab: int, lengths: list[int], seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Samples with random ids; the first half of each is an unsupervised "prompt"."""
    rng = np.random.default_rng(seed)
    samples = []
    for n in lengths:
        ids = rng.integers(0, vocab, size=n).astype(np.int32)
        labels = ids.copy()
        labels[: n // 2] = IGNORE_INDEX
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def per_sample_mean_losses(logits: torch.Tensor, labels: torch.Tensor, seq_lengths: list[int]) -> list[float]:
    """Mean next-token cross-entropy over each sample's supervised span in one row."""
    targets = torch.cat(
        [labels[1:], torch.tensor([IGNORE_INDEX], device=labels.device)]
    )  # the model's internal shift
    token_loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    losses, start = [], 0
    for n in seq_lengths:
        span = slice(start, start + n)
        losses.append(float(token_loss[span].sum() / (targets[span] != IGNORE_INDEX).sum()))
        start += n
    return losses


def alone_losses(model: PreTrainedModel, samples: list[dict[str, np.ndarray]]) -> list[float]:
    out = []
    for sample in samples:
        ids = torch.from_numpy(sample["input_ids"].astype(np.int64))
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0]
        out.extend(
            per_sample_mean_losses(logits, torch.from_numpy(sample["labels"].astype(np.int64)), [len(ids)])
        )
    return out


def packed_losses(
    model: PreTrainedModel, batch: dict[str, torch.Tensor], rows: list[list[int]]
) -> list[float]:
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    out = []
    for b, lengths in enumerate(rows):
        out.extend(per_sample_mean_losses(logits[b], batch["labels"][b], lengths))
    return out


def max_loss_diff(model: PreTrainedModel, batch: dict[str, torch.Tensor], samples: list) -> float:
    """Largest gap between a sample's loss inside the packed batch and its loss alone."""
    packed, alone = packed_losses(model, batch, LENGTHS), alone_losses(model, samples)
    return max(abs(a - b) for a, b in zip(packed, alone, strict=True))


LENGTHS = [[17, 9, 30], [25, 40]]  # two packed rows, the second shorter than the first (padding)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_sample_loss_equals_its_loss_alone(tokenizer, attn_implementation: str) -> None:
    model = tiny_llama(tokenizer, attn_implementation)
    samples = random_samples(len(tokenizer), [n for row in LENGTHS for n in row])
    rows = [samples[:3], samples[3:]]
    batch = PackedCollator(tokenizer.pad_token_id, attn_implementation=attn_implementation)(rows)
    diff = max_loss_diff(model, batch, samples)
    print(f"{attn_implementation}: max per-sample loss diff packed vs alone = {diff:.2e}")
    assert diff <= 1e-5


def test_position_ids_alone_do_not_isolate_packed_samples(tokenizer) -> None:
    """The control: without the block mask the same check fails, so the test above can fail."""
    model = tiny_llama(tokenizer, "sdpa")
    samples = random_samples(len(tokenizer), [n for row in LENGTHS for n in row])
    batch = PackedCollator(tokenizer.pad_token_id)([samples[:3], samples[3:]])
    del batch["attention_mask"]
    diff = max_loss_diff(model, batch, samples)
    print(f"control (position ids only): max per-sample loss diff = {diff:.2e}")
    assert diff > 1e-3


def test_flex_attention_keeps_packed_samples_apart_by_their_position_ids(tokenizer) -> None:
    """Under flex_attention the collator sends no mask: transformers finds each row's samples from
    the restarting position ids and builds FlexAttention's block mask, in a forward without a KV
    cache (the HF Trainer's forwards: its use_cache argument is off). Forward only: FlexAttention
    has no backward on CPU (the training path runs in tests/test_gpu.py)."""
    model = tiny_llama(tokenizer, "flex_attention")
    samples = random_samples(len(tokenizer), [n for row in LENGTHS for n in row])
    collate = PackedCollator(
        tokenizer.pad_token_id, attn_implementation="flex_attention", pad_to_multiple_of=128
    )
    batch = collate([samples[:3], samples[3:]])
    assert "attention_mask" not in batch
    assert batch["input_ids"].shape == (2, 128)  # one row length: one compile
    alone = alone_losses(tiny_llama(tokenizer, "sdpa"), samples)  # the same weights (same seed)
    uncached = packed_losses(model, {**batch, "use_cache": False}, LENGTHS)
    diff = max(abs(a - b) for a, b in zip(uncached, alone, strict=True))
    print(f"flex_attention: max per-sample loss diff packed vs alone = {diff:.2e}")
    assert diff <= 1e-5
    cached = packed_losses(model, batch, LENGTHS)  # a cache hides the samples from transformers
    assert max(abs(a - b) for a, b in zip(cached, alone, strict=True)) > 1e-3


def test_the_eval_step_keeps_flex_packed_rows_apart(tokenizer, tmp_path) -> None:
    """Through lmforge's Trainer: the eval loss of packed rows under flex_attention (no mask) equals
    the one under sdpa with the 4-D block mask. With the Trainer's `use_cache=True` the flex rows
    would leak into each other (the forward keeps a cache, and transformers then looks for no samples)."""
    from transformers import TrainingArguments

    from lmforge.train.hf_trainer import HFTrainerAdapter as LmforgeTrainer

    samples = random_samples(len(tokenizer), [n for row in LENGTHS for n in row])
    losses = {}
    for implementation, length in (("sdpa", None), ("flex_attention", 128)):
        trainer = LmforgeTrainer(
            model=tiny_llama(tokenizer, implementation),
            args=TrainingArguments(
                output_dir=str(tmp_path / implementation),
                use_cpu=True,
                report_to=[],
                per_device_eval_batch_size=2,
            ),
            eval_dataset=[samples[:3], samples[3:]],
            data_collator=PackedCollator(
                tokenizer.pad_token_id, attn_implementation=implementation, pad_to_multiple_of=length
            ),
        )
        losses[implementation] = trainer.evaluate()["eval_loss"]
    assert losses["flex_attention"] == pytest.approx(losses["sdpa"], rel=1e-5)


def test_eager_needs_the_additive_mask_not_the_boolean_one(tokenizer) -> None:
    """Eager attention adds the mask to the scores: a boolean mask there would silently leak."""
    model = tiny_llama(tokenizer, "eager")
    samples = random_samples(len(tokenizer), [n for row in LENGTHS for n in row])
    batch = PackedCollator(tokenizer.pad_token_id, attn_implementation="sdpa")([samples[:3], samples[3:]])
    diff = max_loss_diff(model, batch, samples)
    assert diff > 1e-3


def _pieces(samples: list[dict]) -> dict[str, list]:
    return {"input_ids": [s["input_ids"] for s in samples], "labels": [s["labels"] for s in samples]}


def test_packed_collator_layout() -> None:
    samples = [
        {"input_ids": [5, 6, 7], "labels": [5, 6, 7]},
        {"input_ids": [8, 9], "labels": [IGNORE_INDEX, 9]},
        {"input_ids": [4, 4, 4, 4], "labels": [4, 4, 4, 4]},
    ]
    rows = pack_samples(samples, [[0, 1], [2]])
    batch = PackedCollator(pad_token_id=1)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [4, 4, 4, 4, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    # First label of every sample is -100: no target crosses a boundary; padding has no loss.
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, 4, 4, 4, -100]]
    # The same rows given as lists of samples, or as one list per sample, collate identically.
    for layout in ([samples[:2], samples[2:]], [_pieces(samples[:2]), _pieces(samples[2:])]):
        same = PackedCollator(pad_token_id=1)(layout)
        assert all(torch.equal(same[key], batch[key]) for key in batch)
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    assert mask[1, 0, 4].int().tolist() == [0, 0, 0, 0, 1]  # padding sees only itself
    eager = PackedCollator(pad_token_id=1, attn_implementation="eager")(rows)["attention_mask"]
    assert eager.dtype == torch.float32 and eager[0, 0, 3, 0] == torch.finfo(torch.float32).min
    assert eager[0, 0, 4, 3] == 0


def test_padded_collator_pads_right_with_no_loss_on_padding() -> None:
    batch = PaddedCollator(pad_token_id=1)(
        [{"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


def test_padding_free_collator_flattens_the_batch() -> None:
    batch = PaddingFreeCollator()(
        [
            {"input_ids": np.array([5, 6, 7]), "labels": np.array([5, 6, 7])},
            {"input_ids": [8, 9], "labels": [8, 9]},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert "attention_mask" not in batch
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5]


def test_best_fit_places_every_sample_once_within_capacity() -> None:
    lengths = np.array([5, 9, 3, 7, 2, 8, 1, 10, 4, 6])
    bins = best_fit_pack(lengths, capacity=10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(lengths[b].sum() <= 10 for b in bins)
    assert len(bins) == 6  # 55 tokens: the best possible is 6 bins of 10
    with pytest.raises(ValueError, match="more than the row capacity"):
        best_fit_pack(np.array([3, 11]), capacity=10)


def test_best_fit_is_efficient_on_heavy_tailed_lengths() -> None:
    rng = np.random.default_rng(0)
    capacity = 2048
    lengths = np.clip(rng.lognormal(mean=5.0, sigma=1.0, size=20_000).astype(np.int64), 8, capacity)
    bins = best_fit_pack(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert max(int(lengths[b].sum()) for b in bins) <= capacity
    stats = packing_stats(bins, lengths, capacity)
    print(f"lognormal packing: {stats}")
    assert stats["efficiency"] >= 0.98
    assert stats["pad_fraction"] == pytest.approx(1 - stats["efficiency"])
