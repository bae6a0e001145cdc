"""The GPU fast path: bf16 pretraining of a ~0.7B Llama on one GPU, bare HF Trainer vs lmforge with its
speed and memory levers (Liger kernels, torch.compile, paged 8-bit AdamW, activation offload).

Every variant trains the same model (same seed, data blocks, micro-batch, sequence length) in this one
process, one after another; the baseline runs first and last so drift shows. Per variant: steady-state
tokens/s (steps after --warmup), MFU (6N + attention FLOPs per token over the GPU's bf16 dense peak,
computed here by hand and read back from lmforge's metrics.jsonl), and the CUDA allocator's peak.

    python bench/gpu_fast_path.py --out DIR [--steps 40 --warmup 10 --seq-len 2048 --batch 8]
        [--variants bare,lmforge,liger,compile,layers,liger+layers,fp8+liger+layers,bare_liger,
                    bare_liger_compile,paged_adamw_8bit,offload]

Needs a CUDA GPU; variants whose package is missing (liger-kernel, bitsandbytes) are reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

from lmforge.config import load_config
from lmforge.data.run_data import prepare_data_for_run
from lmforge.models.build import build_model
from lmforge.run_layout import RunPaths
from lmforge.train.numerics import GPU_PEAK_FLOPS, flops_per_token
from lmforge.train.runner import run_training

# ~0.7B parameters with a 32k vocabulary: Llama layout, GQA 12/4, 24 layers of width 1536.
MODEL = {
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}

VARIANTS: dict[str, dict[str, Any]] = {
    "lmforge": {},
    "liger": {"kernels": "liger"},
    "compile": {"compile": "model"},
    "layers": {"compile": "layers"},
    "liger+compile": {"kernels": "liger", "compile": "model"},
    "liger+layers": {"kernels": "liger", "compile": "layers"},
    "fp8": {"precision": "fp8"},
    "fp8+liger+layers": {"precision": "fp8", "kernels": "liger", "compile": "layers"},
    "fp8_rowwise+liger+layers": {
        "precision": "fp8",
        "fp8": {"recipe": "rowwise"},
        "kernels": "liger",
        "compile": "layers",
    },
    "paged_adamw_8bit": {"optimizer": "paged_adamw_8bit"},
    "offload": {"gradient_checkpointing": True, "activation_offload": True},
    "checkpointing": {"gradient_checkpointing": True},
}


class StepClock(TrainerCallback):
    """The steady state's wall time: the device is waited for at the end of step `warmup` and of the
    last step only, so a side that lets the host run ahead of the GPU (no sync in its step) shows it."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = self.end = 0.0
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step not in (self.warmup, state.max_steps):
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if state.global_step == self.warmup:
            self.start = time.perf_counter()
        else:
            self.end, self.steps = time.perf_counter(), state.max_steps - self.warmup

    def steps_per_s(self) -> float:
        return self.steps / (self.end - self.start)


def config(out: Path, name: str, opts: argparse.Namespace, train_extra: dict[str, Any]) -> Any:
    return load_config(
        None,
        base={
            "run": {"name": name, "output_dir": str(out), "seed": 0, "overwrite": True},
            "model": {"preset": "llama-tiny", "config": MODEL},
            "tokenizer": {"train": {"vocab_size": 32000, "max_chars": 4_000_000}},
            "data": {
                "train": [{"path": "builtin:python-stdlib", "max_documents": 2000}],
                "max_length": opts.seq_len,
                "cache_dir": str(out / "cache"),
            },
            "train": {
                "max_steps": opts.steps,
                "micro_batch_size": opts.batch,
                "precision": "bf16",
                "log_every": 1,
                "resume": "never",
                **train_extra,
            },
            "monitor": {"loggers": []},
        },
    )


def run_bare(
    cfg: Any,
    tokenizer: Any,
    data: Any,
    out: Path,
    opts: argparse.Namespace,
    liger: bool = False,
    compile_model: bool = False,
) -> StepClock:
    """The HF Trainer as a careful user configures it (`liger`: its own `use_liger_kernel=True`;
    `compile_model`: its `torch_compile=True`)."""
    set_seed(cfg.run.seed)
    model = build_model(cfg.model, tokenizer, max_length=cfg.data.max_length)
    clock = StepClock(opts.warmup)
    args = TrainingArguments(
        output_dir=str(out / "bare"),
        max_steps=cfg.train.max_steps,
        per_device_train_batch_size=opts.batch,
        learning_rate=cfg.train.lr,
        lr_scheduler_type="cosine",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=True,
        use_liger_kernel=liger,
        torch_compile=compile_model,
        seed=cfg.run.seed,
        disable_tqdm=True,
    )
    Trainer(
        model=model, args=args, train_dataset=data.train, data_collator=data.collator, callbacks=[clock]
    ).train()
    return clock


def peak_flops() -> float:
    if not torch.cuda.is_available():
        return float("nan")
    name = torch.cuda.get_device_name()
    return next((value for key, value in GPU_PEAK_FLOPS if key in name), float("nan"))


def logged_mfu(run_dir: Path, warmup: int) -> float | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    values = [r["mfu"] for r in rows if "mfu" in r and r.get("step", 0) > warmup]
    return statistics.median(values) if values else None


def measure(
    name: str, opts: argparse.Namespace, out: Path, prepared: tuple[Any, Any], params: int
) -> dict[str, Any]:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    clock = StepClock(opts.warmup)
    extra = VARIANTS.get(name, {})
    cfg = config(out, name.replace("+", "_"), opts, extra)
    started = time.perf_counter()
    if name.startswith("bare"):
        tokenizer, data = prepared
        clock = run_bare(
            cfg, tokenizer, data, out, opts, liger="liger" in name, compile_model=name.endswith("compile")
        )
    else:
        run_training(cfg, extra_callbacks=[clock])
    steps_per_s = clock.steps_per_s()
    tokens_per_s = steps_per_s * opts.batch * opts.seq_len
    per_token = flops_per_token(params, MODEL["num_hidden_layers"], MODEL["hidden_size"], opts.seq_len)
    return {
        "variant": name,
        "tokens_per_s": round(tokens_per_s),
        "mfu": round(tokens_per_s * per_token / peak_flops(), 4),
        "mfu_logged": logged_mfu(out / cfg.run.name, opts.warmup),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if torch.cuda.is_available()
        else None,
        "params": params,
        "wall_s": round(time.perf_counter() - started, 1),
        "losses": logged_losses(out / cfg.run.name) if not name.startswith("bare") else None,
    }


def logged_losses(run_dir: Path) -> list[float]:
    """The run's training loss at each logged step (for comparing curves: bf16 vs fp8)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--variants", default="bare,lmforge,liger,compile,liger+compile,paged_adamw_8bit,offload,bare2"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-config", type=json.loads, default=None, help="fields of MODEL to override")
    opts = parser.parse_args()
    MODEL.update(opts.model_config or {})
    opts.out.mkdir(parents=True, exist_ok=True)
    prep_cfg = config(opts.out, "prep", opts, {})
    prepared = prepare_data_for_run(prep_cfg, RunPaths(opts.out / "prep"))
    with torch.device("meta"):  # the count only: no weights allocated
        params = sum(
            p.numel() for p in build_model(prep_cfg.model, prepared[0], max_length=opts.seq_len).parameters()
        )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if not opts.child:
        print(f"device: {device}, torch {torch.__version__}, {params / 1e9:.2f}B", flush=True)
    results = opts.out / "results.jsonl"
    if opts.child:
        try:
            row = measure(opts.variants, opts, opts.out, prepared, params)
        except Exception as err:  # a missing package or an unsupported lever: report it, go on
            traceback.print_exc()
            row = {"variant": opts.variants, "error": f"{type(err).__name__}: {err}"[:400]}
        print(json.dumps(row), flush=True)
        with results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return
    # One process per variant: Liger patches transformers' modelling classes for the whole process,
    # so a variant run after it would silently train with its kernels too.
    for name in opts.variants.split(","):
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", "--variants", name], check=False)


if __name__ == "__main__":
    main()
