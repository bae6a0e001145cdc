"""The numbers a training step is judged by, computed in one place.

Real (non-pad) tokens are counted per batch by `CountingCollator` and accumulated in
`state.num_input_tokens_seen` by the Trainer (so they survive a resume); this module also
turns counts and wall-clock times into per-window throughput, and losses into perplexity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


def perplexity(loss: float) -> float:
    """exp(loss), inf when it overflows or the loss is not finite."""
    if not math.isfinite(loss):
        return math.inf
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@dataclass
class ThroughputMeter:
    """Wall time and tokens of the optimizer steps since the last logged window.

    `step_time_s` is the mean time from a step's start to its end (forward, backward,
    optimizer); `tokens_per_s` divides the window's non-pad tokens by the window's wall
    time from its first step start to its last step end, so data loading counts.
    """

    clock: Callable[[], float] = field(default=time.perf_counter)
    _window_start: float | None = None
    _step_start: float = 0.0
    _step_seconds: float = 0.0
    _steps: int = 0
    _tokens_at_window_start: int = 0
    _last_end: float = 0.0
    _last_tokens: int = 0

    def step_started(self, tokens_seen: int) -> None:
        now = self.clock()
        if self._window_start is None:
            self._window_start = now
            self._tokens_at_window_start = tokens_seen
        self._step_start = now

    def step_ended(self, tokens_seen: int) -> None:
        self._last_end = self.clock()
        self._step_seconds += self._last_end - self._step_start
        self._steps += 1
        self._last_tokens = tokens_seen

    def take_window(self) -> dict[str, float]:
        """Throughput of the steps since the previous call, and start a new window."""
        if self._window_start is None or self._steps == 0:
            return {}
        wall = max(self._last_end - self._window_start, 1e-9)
        tokens = self._last_tokens - self._tokens_at_window_start
        window = {
            "tokens_per_s": tokens / wall,
            "step_time_s": self._step_seconds / self._steps,
            "window_s": wall,
            "window_steps": self._steps,
        }
        self._window_start, self._step_seconds, self._steps = None, 0.0, 0
        return window


# Batch key carrying the number of real (non-pad) tokens; the Trainer removes it before the
# model sees the batch. Counted before collation because after it, packed padding and sample
# starts look alike in the mask, and a pad id may equal a real token id (pad == eos).
REAL_TOKENS_KEY = "lmforge_real_tokens"


def feature_tokens(feature: Mapping[str, Any]) -> int:
    """Real tokens in one dataset item: a sample, a fixed block, or a packed row of samples."""
    ids = feature["input_ids"]
    first = ids[0] if len(ids) else None
    if isinstance(first, list | tuple) or getattr(first, "ndim", 0) >= 1:  # one sequence per packed sample
        return sum(len(piece) for piece in ids)
    return len(ids)


class CountingCollator:
    """Wraps a collator and adds the batch's real-token count under REAL_TOKENS_KEY."""

    def __init__(self, inner: Callable[[list[Any]], dict[str, Any]]) -> None:
        self.inner = inner

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        batch = self.inner(features)
        batch[REAL_TOKENS_KEY] = torch.tensor(sum(feature_tokens(f) for f in features), dtype=torch.int64)
        return batch


# Dense bf16 peak FLOP/s per device (vendor datasheets, without sparsity), matched by name.
GPU_PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("4090", 165e12),
    ("3090", 71e12),
    ("V100", 125e12),
    ("T4", 65e12),
)
_cpu_peaks: dict[torch.dtype, float] = {}
# The matmul dtype each training precision runs its linear layers in (autocast on CPU and GPU).
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def flops_per_token(
    parameters: int, layers: int, hidden: int, seq_len: int, *, trainable: int | None = None
) -> float:
    """Training FLOPs per token (PaLM, appendix B), counted for the method that trains.

    Each weight costs 2 FLOPs per token forward and 2 backward for the activation gradient;
    the weight gradient (another 2) is computed only for trainable weights, so a full run
    is 6N and a LoRA or freeze run is 4N + 2 * trainable. Attention scores and values add
    12 * L * d * T (d = heads x head_dim = hidden size) either way: activations flow back
    through every layer whatever is frozen. Recomputation under gradient checkpointing is
    not counted (that is hardware FLOPs, not model FLOPs)."""
    trained = parameters if trainable is None else trainable
    return 4.0 * parameters + 2.0 * trained + 12.0 * layers * hidden * seq_len


def peak_flops(device: torch.device, precision: str = "fp32") -> float:
    """Peak FLOP/s of one device: the datasheet value for known GPUs, else the measured matmul
    peak of this CPU in the dtype the run computes in (bf16 runs about 3x fp32 on CPUs with
    bf16 units, so an fp32 peak put a bf16 run's MFU above 1)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_FLOPS:
            if key in name:
                return value
    return measured_matmul_flops(PRECISION_DTYPES.get(precision, torch.float32))


def measured_matmul_flops(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 8) -> float:
    """Best-of-N matmul throughput on this CPU in `dtype` (measured once per process and dtype,
    ~0.3 s). The best of several runs is the least disturbed by other work on the machine."""
    if dtype not in _cpu_peaks:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        torch.mm(a, b)  # warm-up
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        _cpu_peaks[dtype] = 2 * size**3 / best
    return _cpu_peaks[dtype]


def mfu(tokens_per_s: float, flops_per_tok: float, peak: float, devices: int) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak of all devices."""
    return tokens_per_s * flops_per_tok / (peak * devices)


def memory_metrics() -> dict[str, float]:
    """Process RSS, and the CUDA allocator's allocated / reserved / peak, in GB."""
    import psutil

    metrics = {"rss_gb": psutil.Process().memory_info().rss / 1e9}
    if torch.cuda.is_available():
        metrics["gpu_mem_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
        metrics["gpu_mem_reserved_gb"] = torch.cuda.memory_reserved() / 1e9
        metrics["gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return metrics
