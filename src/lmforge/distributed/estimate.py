"""Per-device memory of a training job under each distributed strategy.

Model states follow DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`,
`estimate_zero3_model_states_mem_needs`) so the numbers agree with what DeepSpeed users
already trust. Per parameter, under mixed precision (bf16/fp16), DeepSpeed counts
2 bytes of 16-bit weights + 18 bytes of "optimizer-side" state: 2 16-bit grads, 4 fp32
grads, 4 fp32 master weights and 8 of AdamW moments. In fp32 there is no 16-bit copy and
no master: 4 weights + 4 grads + 8 moments, of which 12 are optimizer-side.
CPU figures use DeepSpeed's `additional_buffer_factor` of 1.5 (pinned buffers and copies).

Activations per decoder layer: Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models") give s*b*h*(34 + 5*a*s/h) bytes in 16-bit for a
GPT layer (LayerNorm, 4h GELU MLP). Llama-style layers (RMSNorm, SwiGLU MLP of width I,
grouped KV of width kv) as HF implements them save, per token, in elements: 2h per RMSNorm
(input and normalised) x2, the rotated q (h) and k (kv), v (kv), the attention output and
its contiguous copy for o_proj (2h), and 4I in the MLP (gate, silu(gate), up, their
product) = 7h + 2kv + 4I, in the compute dtype. We use that count (it reduces to
Korthikanti's 34 bytes/token/h in 16-bit for h = kv, I = 2.7h, give or take 10%). A Mixture-of-
Experts layer (k experts per token of width I_e, E experts) saves instead, per token, the router's
logits and probabilities (2E) and, for each of its k routed copies, the gathered input (h), the
expert's 4 I_e and its output before the routing weight (h): 2E + k(2h + 4I_e) for the 4I, plus
4 I_s for a shared expert every token runs (Qwen2-MoE, DeepSeek). Layers left dense in a MoE
(DeepSeek's first_k_dense_replace, Qwen2-MoE's mlp_only_layers) are counted as MoE layers.
Under tensor parallelism without sequence parallelism (transformers' tp_plans shard nothing along
the sequence) the norms' inputs and outputs (4h) stay whole on every rank and the rest divides by
t: Korthikanti's s*b*h*(10 + 24/t) with Llama's counts, 4h + (3h + 2kv + 4I)/t.
sdpa/flash attention store no score matrix; eager attention adds b*a*s*s scores: softmax
output, dropout output and mask (2w + 1 bytes), plus the fp32 softmax under mixed precision. With gradient checkpointing only each
layer's input (h per token) is kept, plus one layer recomputed in full during backward.

The logits term: b*s*V logits in the compute dtype, their fp32 upcast for the loss (none
when already fp32), the fp32 log-softmax cross entropy saves, and during backward two more
fp32 b*s*V gradients (of the log-softmax and of the logits) while every activation is still
alive -- the lm_head's backward runs first, so this is where the step peaks.

The recipe moves these terms: the optimizer's own state replaces AdamW's 8 bytes of moments per
parameter (Lion 4, 8-bit AdamW 2, Adafactor's factored moments ~0, Muon 4 on the hidden
matrices, GaLore 12r/h on its projected matrices); selective checkpointing
(train.checkpoint_every N) keeps whole layers between the checkpointed ones; activation
offload leaves one layer's working set on the device (the rest waits in host memory); the
chunked cross-entropy holds one chunk's fp32 logits and their gradients instead of the batch's.

A vision-language model (a `models.vision` preset, or a model.path whose config has a
vision_config) adds its vision tower and projector to the model states (as trained, like every
weight here: a tower frozen by train.vision needs only its weights, so the figure is an upper
bound), and each image's tower activations (`vision_activation_bytes`) to
the activations, one image per sample assumed. Its image tokens are positions of the text
sequence, inside data.max_length; the text figures are the text model's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from lmforge.config.hub_names import not_here_and_no_hub
from lmforge.config.schema import CHUNKED_LOSS_TOKENS, LmforgeConfig, OptimizerConfig
from lmforge.errors import UserInputError
from lmforge.models.build import architecture_kwargs, config_for_model
from lmforge.models.presets import POSITION_KEYS
from lmforge.models.vision import (
    FAMILY_IMAGE_TOKENS,
    VISION_PRESETS,
    add_image_tokens,
    frame_tokens_per_image,
    image_tokens_per_image,
    is_vision_config,
    preset_family,
    vision_activation_bytes,
    vision_flops_per_image,
    vision_parts,
    vision_preset_config,
)

# DeepSpeed's default additional_buffer_factor for CPU memory.
CPU_BUFFER_FACTOR = 1.5
# Fraction of device memory a plan may use; the rest is left for the CUDA context,
# allocator fragmentation and temporaries the formulas do not count.
HEADROOM = 0.10
# Cheapest first: less sharding means less communication.
STRATEGY_ORDER = (
    "ddp",
    "zero1",
    "zero2",
    "fsdp",
    "zero3",
    "zero3+offload_optimizer",
    "zero3+offload_params",
)


@dataclass(frozen=True)
class ModelShape:
    """What the memory formulas need to know about the model."""

    total_params: int
    largest_layer_params: int
    hidden_size: int
    num_layers: int
    num_heads: int
    kv_size: int
    intermediate_size: int
    vocab_size: int
    embedding_params: int = 0  # input embeddings and output head (once when tied)
    num_kv_heads: int = 0
    num_experts: int = 0  # experts per MoE layer; 0 for a dense model
    expert_params: int = 0  # parameters inside the experts (split by expert parallelism)
    experts_per_token: int = 0  # k, the experts each token is routed to
    expert_intermediate_size: int = 0  # I_e, the width of one expert's MLP
    shared_expert_intermediate_size: int = 0  # the always-on shared experts' width (Qwen2-MoE, DeepSeek)
    expert_layer_params: int = 0  # one layer's experts module (FSDP gathers it whole without EP)
    largest_dense_layer_params: int = 0  # the largest module outside the experts
    model_type: str = ""
    has_tp_plan: bool = False  # transformers ships a tensor-parallel plan for this architecture
    vocab_source: str = (
        "tokenizer"  # where vocab_size came from: tokenizer | model.config | architecture default
    )


@dataclass(frozen=True)
class StrategyMemory:
    """Bytes per device (GPU) and per node (CPU) for one strategy."""

    strategy: str
    model_states_gpu: int
    model_states_cpu: int
    activations: int
    logits: int
    total_gpu: int
    fits: bool | None


# Images per training sample the estimate of a VLM assumes (the shapes task has one per row).
IMAGES_PER_SAMPLE = 1


@dataclass(frozen=True)
class VisionEstimate:
    """The image side of a vision-language model's estimate (absent for a text model)."""

    model_type: str
    vision_tower_params: int
    projector_params: int
    text_params: int
    trainable: bool  # assumed, like every weight in the estimate (an upper bound for a frozen tower)
    images_per_sample: int  # assumed, IMAGES_PER_SAMPLE
    image_size: int
    image_tokens_per_image: int
    sequence_tokens_per_image: int  # the image tokens and the processor's tokens framing them
    activations_per_image: int  # bytes, with train.gradient_checkpointing as configured
    activations: int  # micro_batch_size x images_per_sample images, in every strategy's activations
    flops_per_image: float  # training FLOPs of tower and projector (numerics.VlmFlops.per_image)


@dataclass(frozen=True)
class Estimate:
    """Every strategy's memory and the recommended one (None when nothing fits or no budget)."""

    model: ModelShape
    gpus_per_node: int
    nodes: int
    gpu_mem_bytes: int | None
    headroom: float
    mixed_precision: bool
    micro_batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    activations_no_checkpointing: int
    activations_checkpointing: int
    strategies: list[StrategyMemory]
    recommended: str | None
    optimizer: str = "adamw"
    optimizer_state_bytes_per_param: float = 8.0
    checkpoint_every: int = 1
    activation_offload: bool = False
    activations_offloaded_to_cpu: int = 0
    chunked_cross_entropy: bool = False
    logits_full: int = 0
    logits_chunked: int = 0
    vision: VisionEstimate | None = None

    def to_dict(self) -> dict[str, Any]:
        """Every field; `vision` only for a vision-language model, so a text model's is as before."""
        fields = asdict(self)
        if self.vision is None:
            del fields["vision"]
        return fields


def model_shape(config: LmforgeConfig, hf_config: Any = None) -> ModelShape:
    """Parameter counts from the model config (`hf_config`, read from `config` when not given), built
    on the meta device (no weights allocated). A VLM's counts include its vision tower and projector;
    its widths, layers and vocabulary are its text model's."""
    hf_config = _hf_config(config) if hf_config is None else hf_config
    auto = AutoModelForImageTextToText if is_vision_config(hf_config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(hf_config, trust_remote_code=config.model.trust_remote_code)
    total = sum(p.numel() for p in model.parameters())  # parameters() dedups tied weights
    sizes = {name: sum(p.numel() for p in m.parameters(recurse=False)) for name, m in model.named_modules()}
    largest = max(sizes.values())
    in_experts = {name: ".experts." in f".{name}." for name in sizes}
    embeddings = {
        id(p): p.numel()
        for module in (model.get_input_embeddings(), model.get_output_embeddings())
        if module is not None
        for p in module.parameters()
    }
    from lmforge.distributed.layout import expert_count

    text_config = hf_config.get_text_config()
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads)
    experts = expert_count(text_config) or 0
    routed = int(getattr(text_config, "num_experts_per_tok", None) or 0) if experts else 0
    expert_width = (
        int(getattr(text_config, "moe_intermediate_size", None) or text_config.intermediate_size)
        if experts
        else 0
    )
    expert_params = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return ModelShape(
        num_kv_heads=kv_heads,
        num_experts=experts,
        expert_params=expert_params,
        experts_per_token=routed,
        expert_intermediate_size=expert_width,
        shared_expert_intermediate_size=_shared_expert_width(text_config) if experts else 0,
        expert_layer_params=max((n for name, n in sizes.items() if in_experts[name]), default=0),
        largest_dense_layer_params=max(n for name, n in sizes.items() if not in_experts[name]),
        model_type=str(text_config.model_type),
        has_tp_plan=bool(getattr(text_config, "base_model_tp_plan", None)),
        vocab_source=_vocab_source(config),
        total_params=total,
        largest_layer_params=largest,
        hidden_size=int(text_config.hidden_size),
        num_layers=int(text_config.num_hidden_layers),
        num_heads=int(text_config.num_attention_heads),
        kv_size=int(getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads)
        * int(
            getattr(text_config, "head_dim", None)
            or text_config.hidden_size // text_config.num_attention_heads
        ),
        intermediate_size=int(
            getattr(text_config, "intermediate_size", None)
            or getattr(text_config, "n_inner", None)
            or 4 * text_config.hidden_size
        ),
        vocab_size=int(text_config.vocab_size),
        embedding_params=sum(embeddings.values()),
    )


def _shared_expert_width(text_config: Any) -> int:
    """The MLP width every token also runs through next to its routed experts (0: none)."""
    if getattr(text_config, "shared_expert_intermediate_size", None):
        return int(text_config.shared_expert_intermediate_size)
    shared = int(getattr(text_config, "n_shared_experts", None) or 0)
    return shared * int(getattr(text_config, "moe_intermediate_size", None) or 0)


def _hf_config(config: LmforgeConfig) -> Any:
    cfg = config.model
    if cfg.path:
        fix = "point model.path at a HF model directory (its config.json is all the estimate reads)"
        offline = not_here_and_no_hub("model.path", cfg.path, f"Set model.path to a local copy; {fix}.")
        if offline:
            raise UserInputError(offline)
        try:
            return AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserInputError(
                f"model.path: cannot read the config of {cfg.path!r} ({reason}). Fix: {fix}"
            ) from None
    if cfg.preset in VISION_PRESETS:
        if cfg.config:
            raise UserInputError(
                f"model.config: the vision preset {cfg.preset!r} takes no overrides yet; remove model.config"
            )
        return vision_preset_config(cfg.preset, _vision_vocab(config))
    kwargs = architecture_kwargs(cfg)
    model_type = kwargs.pop("model_type")
    vocab = None if "vocab_size" in (cfg.config or {}) else _vocab_size(config)
    if vocab is not None:
        kwargs["vocab_size"] = vocab
    for key in POSITION_KEYS:  # as build_model: the position table grows to max_length
        if key in kwargs:
            kwargs[key] = max(kwargs[key], config.data.max_length)
    return config_for_model(model_type, kwargs)


def _vocab_source(config: LmforgeConfig) -> str:
    if config.model.path:
        return "model.path"
    if "vocab_size" in (config.model.config or {}):
        return "model.config"
    if config.tokenizer.train is not None or config.tokenizer.path:
        return "tokenizer"
    return "architecture default"


def _vision_vocab(config: LmforgeConfig) -> int | None:
    """A vision preset's vocabulary: the tokenizer's once `build_vision_model` has added its
    family's image tokens to it; None without a tokenizer (LlamaConfig's default)."""
    preset = config.model.preset
    assert preset is not None
    if config.tokenizer.train is not None:
        return config.tokenizer.train.vocab_size + len(FAMILY_IMAGE_TOKENS[preset_family(preset)])
    if config.tokenizer.path is None:
        return None
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer.path)
    add_image_tokens(tokenizer, preset)
    return len(tokenizer)


def vision_estimate(
    hf_config: Any, *, batch: int, seq: int, weight_bytes: int, checkpointing: bool, sdpa: bool
) -> VisionEstimate:
    """The image side of a VLM's estimate, IMAGES_PER_SAMPLE images per sample, all of it trained;
    refused when data.max_length cannot hold a sample's images."""
    parts = vision_parts(hf_config)
    per_image = image_tokens_per_image(hf_config)
    frames = frame_tokens_per_image(hf_config)
    framed = per_image + frames
    if IMAGES_PER_SAMPLE * framed > seq:
        raise UserInputError(
            f"data.max_length: {seq} tokens cannot hold a sample's {IMAGES_PER_SAMPLE} image(s) of {framed} "
            f"tokens each ({per_image} image tokens and {frames} around them); raise it"
        )
    acts = vision_activation_bytes(
        hf_config, weight_bytes=weight_bytes, sdpa=sdpa, checkpointing=checkpointing
    )
    return VisionEstimate(
        model_type=str(hf_config.model_type),
        vision_tower_params=parts["vision_tower"],
        projector_params=parts["projector"],
        text_params=parts["text"],
        trainable=True,
        images_per_sample=IMAGES_PER_SAMPLE,
        image_size=int(hf_config.vision_config.image_size),
        image_tokens_per_image=per_image,
        sequence_tokens_per_image=framed,
        activations_per_image=acts,
        activations=batch * IMAGES_PER_SAMPLE * acts,
        flops_per_image=vision_flops_per_image(hf_config, trainable_vision=True),
    )


def _vocab_size(config: LmforgeConfig) -> int | None:
    """The tokenizer's vocabulary, or None when the config names no tokenizer (an architecture
    estimated on its own keeps its config class's default vocab_size)."""
    if config.tokenizer.train is not None:
        return config.tokenizer.train.vocab_size
    path = config.tokenizer.path or config.model.path
    if path is None:
        return None
    return len(AutoTokenizer.from_pretrained(path))


def mlp_elements(shape: ModelShape) -> tuple[int, int]:
    """Per token, the elements the MLP saves for backward: (kept whole on every tensor rank,
    divided by the tensor degree). Dense: 4I, all column-split. MoE: the router's 2E whole, and
    per routed copy the input and output (2h, whole) and the expert's 4 I_e (split), plus a shared
    expert's 4 I_s."""
    if shape.num_experts and shape.experts_per_token:
        k, shared = shape.experts_per_token, 4 * shape.shared_expert_intermediate_size
        return (
            2 * shape.num_experts + 2 * k * shape.hidden_size,
            4 * k * shape.expert_intermediate_size + shared,
        )
    return 0, 4 * shape.intermediate_size


def activation_bytes(
    shape: ModelShape,
    *,
    batch: int,
    seq: int,
    weight_bytes: int,
    checkpointing: bool,
    sdpa: bool,
    every: int = 1,
    offload: bool = False,
    tensor: int = 1,
) -> int:
    """Saved activations of all decoder layers for one micro-batch on the device (see the module
    docstring): with checkpointing every `every`-th layer keeps only its input; with offload
    only the layer being computed holds its activations there. `tensor`: the tensor-parallel
    degree, without sequence parallelism (the norms and the checkpointed inputs stay whole)."""
    tokens, h = batch * seq, shape.hidden_size
    mlp_whole, mlp_split = mlp_elements(shape)
    whole = 4 * h + mlp_whole  # the two norms' inputs and outputs (what TP cannot split)
    split = 3 * h + 2 * shape.kv_size + mlp_split  # q, k, v, attention output and its copy, MLP
    per_layer = tokens * (whole * tensor + split) * weight_bytes // tensor
    if not sdpa:
        # softmax output, dropout output and its 1-byte mask (HF runs dropout in training even at
        # p=0), plus the fp32 softmax kept under mixed precision: Korthikanti's 5 bytes in 16-bit.
        score_bytes = 2 * weight_bytes + 1 + (0 if weight_bytes == 4 else 4)
        per_layer += batch * shape.num_heads * seq * seq * score_bytes // tensor  # the heads split
    if offload:
        return per_layer
    if checkpointing:
        recomputed = -(-shape.num_layers // every)  # layers 0, every, 2 x every, ...
        kept = shape.num_layers - recomputed
        return recomputed * tokens * h * weight_bytes + kept * per_layer + per_layer
    return shape.num_layers * per_layer


def chunked_logits_bytes(shape: ModelShape, *, batch: int, seq: int) -> int:
    """The chunked cross-entropy: one chunk's fp32 logits, its log-softmax and the two fp32
    gradients, recomputed chunk by chunk in backward."""
    n = min(CHUNKED_LOSS_TOKENS, batch * seq) * shape.vocab_size
    return 4 * n + 4 * n + 8 * n


def optimizer_state_bytes(shape: ModelShape, optimizer: OptimizerConfig) -> float:
    """Bytes per parameter of the optimizer's own state (AdamW: two fp32 moments, 8)."""
    p = max(shape.total_params, 1)
    hidden = max(shape.total_params - shape.embedding_params, 0)  # the 2-D matrices of the layers
    rest = p - hidden
    if optimizer.name in ("adamw_8bit", "paged_adamw_8bit"):
        return 2.0
    if optimizer.name == "lion":
        return 4.0
    if optimizer.name == "adafactor":
        return 0.0  # factored second moments (rows + columns), no first moment
    if optimizer.name == "muon":
        return (4 * hidden + 8 * rest) / p  # one momentum buffer; AdamW for embeddings and head
    if optimizer.name == "galore":
        projected = min(12 * optimizer.galore.rank / shape.hidden_size, 8.0)
        return (projected * hidden + 8 * rest) / p
    return 8.0


def fits_budget(total: float, budget: float | None) -> bool | None:
    """The one "fits" verdict of the strategy table and the layout planner (None: no budget given)."""
    return None if budget is None else total <= budget


def logits_bytes(shape: ModelShape, *, batch: int, seq: int, weight_bytes: int) -> int:
    """Logits, their fp32 upcast, the saved log-softmax and the two fp32 gradients of backward."""
    n = batch * seq * shape.vocab_size
    upcast = 0 if weight_bytes == 4 else 4 * n
    return n * weight_bytes + upcast + 4 * n + 8 * n


def model_states(
    shape: ModelShape, strategy: str, *, gpus_per_node: int, nodes: int, mixed: bool, moments: float = 8.0
) -> tuple[int, int]:
    """(GPU bytes per device, CPU bytes per node) of weights, grads and optimizer states
    (`moments`: the optimizer's bytes per parameter, AdamW's 8 by default)."""
    p, n_gpu = shape.total_params, gpus_per_node * nodes
    w = 2 if mixed else 4  # bytes of the weights the model computes with
    # DeepSpeed's partitionable bytes per parameter, with the optimizer's moments for AdamW's 8.
    optim_side = int(round((18 if mixed else 12) - 8 + moments))
    largest = 4 * shape.largest_layer_params
    if strategy == "ddp":
        return w * p + optim_side * p, int(4 * p * gpus_per_node * CPU_BUFFER_FACTOR)
    if strategy == "zero1":  # only the fp32 grads/master/moments shard, the 16-bit grads do not
        return w * p + w * p + (optim_side - w) * p // n_gpu, int(4 * p * gpus_per_node * CPU_BUFFER_FACTOR)
    if strategy == "zero2":
        return w * p + optim_side * p // n_gpu, int(4 * p * gpus_per_node * CPU_BUFFER_FACTOR)
    if strategy in ("zero3", "fsdp"):  # FSDP full shard holds the same states as ZeRO-3
        return largest + optim_side * p // n_gpu, int(
            shape.largest_layer_params * 4 * gpus_per_node * CPU_BUFFER_FACTOR
        )
    if strategy == "zero3+offload_optimizer":
        return largest + w * p // n_gpu, int(p * (optim_side - w) / nodes * CPU_BUFFER_FACTOR)
    if strategy == "zero3+offload_params":
        return largest, int(p * optim_side / nodes * CPU_BUFFER_FACTOR)
    raise ValueError(f"unknown strategy {strategy!r}")


def estimate_memory(config: LmforgeConfig, *, gpus: int, gpu_mem_bytes: int | None, nodes: int) -> Estimate:
    """Memory per device of every strategy for `config`, and the cheapest that fits `gpu_mem_bytes`.

    `gpus` is per node. Precision "auto" is taken as bf16 (what it picks on a GPU).
    """
    if gpus < 1 or nodes < 1:
        raise UserInputError(f"--gpus and --nodes must be at least 1 (got gpus={gpus}, nodes={nodes})")
    hf_config = _hf_config(config)
    shape = model_shape(config, hf_config)
    mixed = config.train.precision != "fp32"
    w = 2 if mixed else 4
    batch, seq = config.train.micro_batch_size, config.data.max_length
    sdpa = config.model.attn_implementation != "eager"
    train = config.train
    every = train.checkpoint_every
    vision = {
        ckpt: vision_estimate(hf_config, batch=batch, seq=seq, weight_bytes=w, checkpointing=ckpt, sdpa=sdpa)
        if is_vision_config(hf_config)
        else None
        for ckpt in (False, True)
    }
    images = {ckpt: part.activations if part else 0 for ckpt, part in vision.items()}
    acts = {
        ckpt: activation_bytes(
            shape, batch=batch, seq=seq, weight_bytes=w, checkpointing=ckpt, sdpa=sdpa, every=every
        )
        + images[ckpt]
        for ckpt in (False, True)
    }
    activations = acts[train.gradient_checkpointing]
    offloaded = 0
    if train.activation_offload:  # the vision tower's activations stay on the device
        on_device = activation_bytes(
            shape, batch=batch, seq=seq, weight_bytes=w, checkpointing=False, sdpa=sdpa, offload=True
        )
        kept = images[train.gradient_checkpointing]
        offloaded, activations = activations - kept - on_device, on_device + kept
    full_logits = logits_bytes(shape, batch=batch, seq=seq, weight_bytes=w)
    chunked_logits = chunked_logits_bytes(shape, batch=batch, seq=seq)
    logits = chunked_logits if train.chunked_cross_entropy else full_logits
    moments = optimizer_state_bytes(shape, train.optimizer)
    budget = None if gpu_mem_bytes is None else gpu_mem_bytes * (1 - HEADROOM)
    rows = []
    for name in STRATEGY_ORDER:
        gpu, cpu = model_states(shape, name, gpus_per_node=gpus, nodes=nodes, mixed=mixed, moments=moments)
        cpu += offloaded * gpus
        total = gpu + activations + logits
        rows.append(StrategyMemory(name, gpu, cpu, activations, logits, total, fits_budget(total, budget)))
    recommended = next((r.strategy for r in rows if r.fits), None)
    return Estimate(
        model=shape,
        gpus_per_node=gpus,
        nodes=nodes,
        gpu_mem_bytes=gpu_mem_bytes,
        headroom=HEADROOM,
        mixed_precision=mixed,
        micro_batch_size=batch,
        seq_len=seq,
        gradient_checkpointing=config.train.gradient_checkpointing,
        activations_no_checkpointing=acts[False],
        activations_checkpointing=acts[True],
        strategies=rows,
        recommended=recommended,
        optimizer=train.optimizer.name,
        optimizer_state_bytes_per_param=moments,
        checkpoint_every=every,
        activation_offload=train.activation_offload,
        activations_offloaded_to_cpu=offloaded,
        chunked_cross_entropy=train.chunked_cross_entropy,
        logits_full=full_logits,
        logits_chunked=chunked_logits,
        vision=vision[train.gradient_checkpointing],
    )
