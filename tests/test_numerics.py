"""Numerics: real-token counting for every batch layout, throughput windows, perplexity."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import default_data_collator

from lmforge.data.collate import PackedCollator, PaddedCollator
from lmforge.train.numerics import (
    REAL_TOKENS_KEY,
    CountingCollator,
    ThroughputMeter,
    feature_tokens,
    flops_per_token,
    mfu,
    peak_flops,
    perplexity,
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
    # 1,000 tokens/s at 1 GFLOP per token on 2 devices of 1 TFLOP/s each: 50% utilisation.
    assert mfu(1000.0, 1e9, 1e12, 2) == pytest.approx(0.5)
    assert peak_flops(torch.device("cpu")) > 1e9  # a measured matmul peak on CPU


def test_cpu_peak_is_measured_in_the_precision_that_trains() -> None:
    # This CPU has bf16 units: a bf16 run measured against the fp32 peak showed MFU above 1.
    fp32, bf16 = peak_flops(torch.device("cpu"), "fp32"), peak_flops(torch.device("cpu"), "bf16")
    assert bf16 != fp32 and min(fp32, bf16) > 1e9


def test_mfu_never_passes_one_and_the_peak_follows_what_was_achieved() -> None:
    step = TrainStep(flops_per_token=1e9, peak_flops=1e12)
    assert step.utilisation(500.0) == pytest.approx(0.5)
    assert step.utilisation(2000.0) == 1.0  # 2 TFLOP/s achieved: the measured peak was low
    assert step.peak_flops == pytest.approx(2e12)
    assert step.utilisation(1000.0) == pytest.approx(0.5)
