"""Numerics: real-token counting for every batch layout, throughput windows, perplexity."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import default_data_collator

from lmforge.data.collate import PackedCollator, PaddedCollator
from lmforge.distributed.devices import cpu_supports_bf16
from lmforge.train.console_progress import format_step_line
from lmforge.train.numerics import (
    REAL_TOKENS_KEY,
    CountingCollator,
    RankFlops,
    ThroughputMeter,
    active_parameters,
    feature_tokens,
    flops_per_token,
    mfu,
    peak_flops,
    perplexity,
    rank_flops_per_token,
)
from lmforge.train.step import TrainStep


def test_real_tokens_for_blocks_samples_and_packed_rows() -> None:
    assert feature_tokens({"input_ids": torch.arange(8)}) == 8
    assert feature_tokens({"input_ids": np.arange(5)}) == 5
    assert feature_tokens({"input_ids": [[1, 2, 3], [4, 5]]}) == 5
    assert feature_tokens({"input_ids": [np.arange(3), np.arange(4)]}) == 7


def test_counting_collator_ignores_padding_even_when_pad_equals_a_real_token() -> None:
    # pad id 2 also occurs as a real token: counting after padding would get this wrong.
    samples = [{"input_ids": [2, 2, 3], "labels": [2, 2, 3]}, {"input_ids": [5], "labels": [5]}]
    padded = CountingCollator(PaddedCollator(pad_token_id=2))(samples)
    assert padded[REAL_TOKENS_KEY].item() == 4 and padded["input_ids"].shape == (2, 3)
    rows = [
        {"input_ids": [[2, 2], [3, 3, 3]], "labels": [[2, 2], [3, 3, 3]]},
        {"input_ids": [[7]], "labels": [[7]]},
    ]
    packed = CountingCollator(PackedCollator(pad_token_id=2))(rows)
    assert packed[REAL_TOKENS_KEY].item() == 6 and packed["attention_mask"].dim() == 4
    blocks = CountingCollator(default_data_collator)(
        [{"input_ids": torch.arange(4), "labels": torch.arange(4)}] * 3
    )
    assert blocks[REAL_TOKENS_KEY].item() == 12


def test_throughput_window_and_perplexity() -> None:
    times = iter([0.0, 1.0, 1.0, 3.0])
    meter = ThroughputMeter(clock=lambda: next(times))
    meter.step_started(0)
    meter.step_ended(100)
    meter.step_started(100)
    meter.step_ended(300)
    window = meter.take_window()
    assert window == {"tokens_per_s": 100.0, "step_time_s": 1.5, "window_s": 3.0, "window_steps": 2}
    assert meter.take_window() == {}
    assert (
        perplexity(math.log(20.0)) == pytest.approx(20.0)
        and perplexity(float("nan")) == math.inf
        and perplexity(1e6) == math.inf
    )


def test_flops_per_token_and_mfu_follow_the_palm_formula() -> None:
    # 6N for the weights plus 12 * layers * hidden * seq for attention (PaLM, appendix B).
    assert flops_per_token(1_000_000, 4, 256, 512) == 6e6 + 12 * 4 * 256 * 512
    # LoRA / freeze: frozen weights get no weight gradient, so 4N + 2 * trainable.
    assert flops_per_token(1_000_000, 4, 256, 512, trainable=10_000) == 4e6 + 2e4 + 12 * 4 * 256 * 512
    # 1,000 tokens/s on 2 data ranks (each computes half) at 1 GFLOP per token, 1 TFLOP/s each: 50%.
    two_ranks = [RankFlops(1e9, 1e12), RankFlops(1e9, 1e12)]
    assert mfu(1000.0, two_ranks, token_share=0.5) == pytest.approx(0.5)
    assert peak_flops(torch.device("cpu")) > 1e9  # a measured matmul peak on CPU


def test_cpu_peak_is_measured_in_the_precision_that_trains() -> None:
    # On a CPU with bf16 units a bf16 run measured against the fp32 peak showed MFU above 1; on one
    # without them bf16 is emulated at ~1 GFLOP/s, 1-2% of fp32, and was measured for 22 s.
    fp32, bf16 = peak_flops(torch.device("cpu"), "fp32"), peak_flops(torch.device("cpu"), "bf16")
    assert fp32 > 1e9 and bf16 > 1e8, (fp32, bf16)
    if cpu_supports_bf16():
        assert bf16 > fp32, (fp32, bf16)
    else:
        assert bf16 < fp32 / 4, (fp32, bf16)


# Per layer of the tiny Qwen3-MoE below: attention q 64x64, k and v 32x64, o 64x64, q/k norms 16 each,
# 2 layer norms of 64, a router of 8x64; each of 8 experts gate_up 64x64 and down 64x32.
_ATTENTION = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 16 + 2 * 64
_ROUTER, _EXPERT = 8 * 64, 64 * 64 + 64 * 32


def _tiny_qwen3_moe() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    return Qwen3MoeForCausalLM(config)


def test_moe_flops_count_the_top_k_experts_a_token_visits() -> None:
    # A token runs through 2 of the 8 experts of each layer: 82.7% MFU on a loaded 2-core CPU came
    # from counting all 8. The input embedding is a lookup (left out); the untied head is a matmul.
    model = _tiny_qwen3_moe()
    active = active_parameters(model, top_k=2, experts=8)
    head, final_norm = 100 * 64, 64
    assert active.total == 2 * (_ATTENTION + _ROUTER + 2 * _EXPERT) + final_norm + head
    everything = sum(p.numel() for p in model.parameters())
    assert everything == 2 * (_ATTENTION + _ROUTER + 8 * _EXPERT) + final_norm + head + 100 * 64
    assert rank_flops_per_token(model, 32) == 6 * active.total + 12 * 2 * 64 * 32
    # 6N of every parameter is 2.4x the FLOPs a token costs here: MFU read 2.4x too high.
    assert everything / active.total == pytest.approx(2.41, abs=0.01)


def _tiny_llama(tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


# A Llama layer of hidden 64, 2 of 4 heads for keys and values, MLP 128: q, k, v, o, 3 MLP weights, 2 norms.
_LLAMA_LAYER = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 128 + 2 * 64


@pytest.mark.parametrize("tied", [True, False])
def test_a_pipeline_stage_counts_its_own_layers_and_the_whole_pipeline_adds_up(tied: bool) -> None:
    from lmforge.distributed.pipeline_parallel import _cut_stage

    seq, head, final_norm = 32, 256 * 64, 64
    whole = rank_flops_per_token(_tiny_llama(tied), seq)
    assert whole == 6 * (4 * _LLAMA_LAYER + final_norm + head) + 12 * 4 * 64 * seq
    stages = []
    for stage in (0, 1):  # each stage built whole, then cut, as every pipeline rank does
        model = _tiny_llama(tied)
        _cut_stage(model, stage, 2, 1)
        stages.append(rank_flops_per_token(model, seq))
    # Stage 0: layers 0-1 and the embedding (a lookup); stage 1: layers 2-3, the final norm, the head.
    assert stages[0] == 6 * 2 * _LLAMA_LAYER + 12 * 2 * 64 * seq
    assert stages[1] == 6 * (2 * _LLAMA_LAYER + final_norm + head) + 12 * 2 * 64 * seq
    assert sum(stages) == whole
    # 1,182 tokens/s through both stages (each computes every token), peaks of 1 TFLOP/s: the run's
    # MFU is both stages' FLOPs over both peaks; rank 0's stage over the whole world read 3.4x lower.
    ranks = [RankFlops(flops, 1e12) for flops in stages]
    assert mfu(1182.0, ranks) == pytest.approx(1182.0 * whole / 2e12)
    assert mfu(1182.0, ranks) / (1182.0 * stages[0] / 2e12) > 2


def test_mfu_against_a_beaten_measured_peak_is_uncertain_not_capped() -> None:
    # A CPU peak measured while other work shared the cores is too low: 2 TFLOP/s achieved against a
    # measured 1 TFLOP/s proves it. No MFU (the old code said 100%), from then on, and the console says so.
    step = TrainStep(flops_per_token=1e9, peak_flops=1e12, peak_measured=True)
    assert step.utilisation(500.0) == pytest.approx(0.5)
    assert step.utilisation(2000.0) is None
    assert step.utilisation(500.0) is None  # the peak is known to be wrong: later windows too
    record = step.record({}, {"tokens_per_s": 500.0, "window_s": 1.0, "window_steps": 1}, guarded=True)
    assert "mfu" not in record and record["mfu_peak_uncertain"] is True
    assert format_step_line({"loss": 2.0, **record}, 3, 9, None) == (
        "step 3/9  loss 2.0000  tok/s 500  MFU n/a (peak uncertain)"
    )
    # A datasheet peak (a GPU) is not a measurement: a figure above it is still reported as it is.
    assert mfu(2000.0, [RankFlops(1e9, 1e12, measured=False)]) == pytest.approx(2.0)
