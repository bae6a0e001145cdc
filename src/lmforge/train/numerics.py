"""The numbers a training step is judged by, computed in one place.

Real (non-pad) tokens are counted per batch by `CountingCollator` and accumulated in
`state.num_input_tokens_seen` by the Trainer (so they survive a resume); this module also
turns counts and wall-clock times into per-window throughput, and losses into perplexity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
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
# Which training source a sample of a mixed stream or token store came from; counted, never fed to the model.
MIX_SOURCE_KEY = "mix_source"


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
# fp8 counts as bf16 (torchtitan's convention): its float8 matmuls show as MFU above a bf16 run's.
PRECISION_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
}


def flops_per_token(
    parameters: float, layers: float, hidden: int, seq_len: int, *, trainable: float | None = None
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


# The tensor-parallel dimension of lmforge's device meshes (distributed/tensor_parallel.py): a weight
# split over it is computed in parts, one per rank. A split over any other dimension (FSDP's
# dp_shard, expert parallelism's ep) is storage only or serves other ranks' tokens: computed whole.
TENSOR_DIM = "tp"


@dataclass(frozen=True)
class ActiveParameters:
    """The weights one token runs through on this rank, in elements: `total` of them, `trainable`
    of which also get a weight gradient; `layers` is the attention layers this rank computes
    (a pipeline stage's own, each counted by its share of the heads under tensor parallelism)."""

    total: float
    trainable: float
    layers: float


def compute_share(param: torch.Tensor) -> float:
    """The fraction of a weight's matmul this rank computes: 1 / tensor degree for a tensor-parallel
    DTensor, 1 for anything else (FSDP gathers the whole weight before computing with it)."""
    mesh: Any = getattr(param, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    parts = 1
    for dim, placement in enumerate(getattr(param, "placements", ())):
        if placement.is_shard() and dim < len(names) and names[dim] == TENSOR_DIM:
            parts *= mesh.size(dim)
    return 1.0 / parts


def active_parameters(
    model: torch.nn.Module,
    *,
    top_k: int | None = None,
    experts: int | None = None,
    skip: tuple[str, ...] = (),
) -> ActiveParameters:
    """This rank's `ActiveParameters`, by the usual conventions (Kaplan et al., torchtitan):

    - input embedding tables are a lookup, not a matmul: left out (a table tied to the output head
      is the head's matmul: counted once);
    - routed experts (parameters under `.experts.`): a token visits `top_k` of `experts`, so they
      count top_k / experts of their size; shared experts, routers and attention count whole;
    - a pipeline stage counts the parameters it holds, a tensor-parallel rank its shard
      (`compute_share`); DeepSpeed ZeRO-3's partitioned parameters by their whole size;
    - parameters and attention layers whose names hold a piece of `skip` are left out (a VLM's
      image side, counted per image instead: `vlm_rank_flops`)."""
    getter: Any = getattr(model, "get_output_embeddings", None)
    head = getattr(getter() if callable(getter) else None, "weight", None)
    lookups = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding) and module.weight is not head
    }
    routed = top_k / experts if top_k and experts else 1.0
    total = trainable = 0.0
    for name, param in model.named_parameters():
        if id(param) in lookups or _skipped(name, skip):
            continue
        size = getattr(param, "ds_numel", None) or param.numel()
        size *= compute_share(param) * (routed if ".experts." in f".{name}" else 1.0)
        total += size
        trainable += size if param.requires_grad else 0.0
    layers = 0.0
    for name, module in model.named_modules():
        attention = name.endswith("self_attn") and not _skipped(name, skip)
        weights = list(module.parameters()) if attention else []
        layers += compute_share(weights[0]) if weights else 0.0
    return ActiveParameters(total, trainable, layers)


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return any(piece in f".{name}." for piece in skip)


def rank_flops_per_token(model: Any, seq_len: int, *, skip: tuple[str, ...] = ()) -> float:
    """Training FLOPs per token of the part of `model` this rank computes (`flops_per_token` over
    `active_parameters`, an MoE's top-k read from its config; `skip` as there)."""
    from lmforge.models.moe import expert_count  # transformers: only where a model is measured

    config = model.config.get_text_config()
    experts = expert_count(model.config)
    top_k = getattr(config, "num_experts_per_tok", None) if experts else None
    active = active_parameters(model, top_k=top_k, experts=experts, skip=skip)
    layers = active.layers or float(getattr(config, "num_hidden_layers", 0))
    return flops_per_token(
        active.total, layers, getattr(config, "hidden_size", 0), seq_len, trainable=active.trainable
    )


@dataclass(frozen=True)
class VlmFlops:
    """A vision-language model's training FLOPs, in its two currencies: `text_per_token` for each
    position of the text sequence (image tokens included: the text model runs on them like on
    words, and lmforge's token count holds them), `per_image` for each image the vision tower
    and projector encode."""

    text_per_token: float
    per_image: float

    def step(self, tokens: float, images: float) -> float:
        """Model FLOPs of a step of `tokens` sequence positions and `images` images."""
        return tokens * self.text_per_token + images * self.per_image

    def per_token(self, tokens: float, images: float) -> float:
        """A step's FLOPs spread over its tokens: what `RankFlops.flops_per_token` holds for a VLM,
        so that `mfu` stays one formula for every model (0 for a step without tokens)."""
        return self.step(tokens, images) / tokens if tokens else 0.0


def vlm_rank_flops(model: Any, seq_len: int) -> VlmFlops:
    """This rank's `VlmFlops` of a vision-language model: the text side as `rank_flops_per_token`
    with the image side's parameters and attention layers left out, the image side by
    `vision_flops_per_image`, trained as its parameters' `requires_grad` say. The image side is
    counted whole on every rank (lmforge does not split a vision tower)."""
    from lmforge.models.vision import vision_flops_per_image, vision_parameter_markers

    tower, projector = vision_parameter_markers(model.config)
    trained = [(name, p.requires_grad) for name, p in model.named_parameters()]
    return VlmFlops(
        text_per_token=rank_flops_per_token(model, seq_len, skip=(tower, projector)),
        per_image=vision_flops_per_image(
            model.config,
            trainable_vision=any(grad for name, grad in trained if _skipped(name, (tower,))),
            trainable_projector=any(grad for name, grad in trained if _skipped(name, (projector,))),
        ),
    )


def peak_flops(device: torch.device, precision: str = "fp32") -> float:
    """Peak FLOP/s of one device: the datasheet value for known GPUs, else the measured matmul
    peak of this CPU in the dtype the run computes in (bf16 runs about 3x fp32 on CPUs with
    bf16 units, so an fp32 peak put a bf16 run's MFU above 1)."""
    return datasheet_peak(device) or measured_matmul_flops(PRECISION_DTYPES.get(precision, torch.float32))


def datasheet_peak(device: torch.device) -> float | None:
    """The vendor's dense bf16 peak of a known GPU; None where the peak has to be measured (CPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_FLOPS:
            if key in name:
                return value
    return None


def measured_matmul_flops(dtype: torch.dtype = torch.float32, budget_s: float = 0.3) -> float:
    """Best-of-N matmul throughput on this CPU in `dtype`, measured once per process and dtype in
    about `budget_s`. The best of several runs is the least disturbed by other work on the machine.
    The matrices grow from 256 to 1024 while one product is quick: a CPU without bf16 units
    emulates bf16 at ~1 GFLOP/s, where one 1024 product takes 2.4 s (a fixed size spent 22 s
    measuring before a bf16 run's first step on such a CPU)."""
    if dtype not in _cpu_peaks:
        size = 256
        while True:
            best = _best_matmul_seconds(size, dtype, budget_s)
            if size >= 1024 or best > budget_s / 32:  # large enough to keep the cores busy
                break
            size *= 2
        _cpu_peaks[dtype] = 2 * size**3 / best
    return _cpu_peaks[dtype]


def _best_matmul_seconds(size: int, dtype: torch.dtype, budget_s: float, repeats: int = 8) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    best, spent = math.inf, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent > budget_s:
            break
    return best


@dataclass(frozen=True)
class RankFlops:
    """One rank's side of MFU: the training FLOPs per token of its own part of the model
    (`rank_flops_per_token`), its device's peak FLOP/s, and whether that peak is a measurement of
    this machine (a CPU: other work on the cores can make it low) or a datasheet value."""

    flops_per_token: float
    peak: float
    measured: bool = False


def mfu(tokens_per_s: float, ranks: Sequence[RankFlops], token_share: float = 1.0) -> float | None:
    """Model FLOPs utilisation: every rank's achieved FLOP/s over its own peak, summed over ranks
    (sum achieved / sum peaks). A rank computes `token_share` of the run's `tokens_per_s` (1 / data
    ranks: a tensor or pipeline group shares its batch, a context group splits its sequences) with
    its own part of the model. None when a rank beats a measured peak: that peak was measured low
    and any figure against it would be made up."""
    achieved = [tokens_per_s * token_share * rank.flops_per_token for rank in ranks]
    if any(rank.measured and done > rank.peak for rank, done in zip(ranks, achieved, strict=True)):
        return None
    return sum(achieved) / sum(rank.peak for rank in ranks)


def memory_metrics() -> dict[str, float]:
    """Process RSS, and the CUDA allocator's allocated / reserved / peak, in GB."""
    import psutil

    metrics = {"rss_gb": psutil.Process().memory_info().rss / 1e9}
    if torch.cuda.is_available():
        metrics["gpu_mem_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
        metrics["gpu_mem_reserved_gb"] = torch.cuda.memory_reserved() / 1e9
        metrics["gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return metrics
