"""train.precision fp8 against bf16 on one GPU: the step time and the loss of a Llama whose linear
layers lmforge converts to torchao's float8 ones (train/fp8.py), both under bf16 autocast over fp32
weights, AdamW (fused), the same seed and batches, compiled (torch.compile of the whole model:
float8's casts are fused there; eager float8 is slower than bf16) or eager with --eager.

Each variant builds its model afresh in this process, one after another: bf16 first, then each
recipe. Per variant: ms per step (mean over the steps after --warmup), the first and last losses,
and the CUDA allocator's peak.

    python bench/fp8_step.py [--hidden 4096 --intermediate 11008 --layers 4 --heads 32 --kv-heads 8]
        [--batch 4 --seq 2048 --steps 30 --warmup 10] [--variants bf16,tensorwise,rowwise] [--eager]

Needs a CUDA GPU of compute capability 8.9+ and torchao (the fp8 extra); run from the repository
root with lmforge importable (PYTHONPATH=src, or installed).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lmforge.config.schema import Fp8Config
from lmforge.train.fp8 import convert_linears_to_float8
from lmforge.train.precision import require_fp8_device

VOCAB = 32000


def build(args: argparse.Namespace, variant: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).cuda()
    if variant != "bf16":
        convert_linears_to_float8(model, Fp8Config(recipe=variant), fsdp=False)
    return model


def batches(args: argparse.Namespace) -> list[torch.Tensor]:
    """Arithmetic progressions of token ids: learnable, so the loss falls within the steps."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(args.steps):
        start = torch.randint(0, VOCAB, (args.batch, 1), generator=generator)
        stride = torch.randint(1, 4, (args.batch, 1), generator=generator)
        rows.append(((start + stride * torch.arange(args.seq)) % VOCAB).cuda())
    return rows


def measure(args: argparse.Namespace, variant: str, data: list[torch.Tensor]) -> dict[str, Any]:
    model = build(args, variant)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    forward = model if args.eager else torch.compile(model)
    torch.cuda.reset_peak_memory_stats()
    losses, started = [], 0.0
    for step, ids in enumerate(data):
        if step == args.warmup:
            torch.cuda.synchronize()
            started = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.cuda.synchronize()
    ms = (time.perf_counter() - started) / (args.steps - args.warmup) * 1000
    return {
        "variant": variant,
        "ms_per_step": round(ms, 1),
        "tokens_per_s": round(args.batch * args.seq / ms * 1000),
        "first_loss": round(losses[0], 4),
        "last_loss": round(losses[-1], 4),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--variants", default="bf16,tensorwise,rowwise")
    parser.add_argument("--eager", action="store_true", help="no torch.compile")
    args = parser.parse_args()
    require_fp8_device(use_cuda=torch.cuda.is_available())
    data = batches(args)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    baseline = None
    for variant in args.variants.split(","):
        result = measure(args, variant, data)
        baseline = baseline or result["ms_per_step"]
        result["x_first"] = round(baseline / result["ms_per_step"], 2)
        print(json.dumps(result), flush=True)
        torch._dynamo.reset()  # the next variant compiles its own model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
