"""SFT packing on one GPU: padded batches vs packed rows under sdpa's 4-D block mask, under
FlexAttention (transformers' block mask from the position ids: the blocks between samples are
skipped) and, where flash-attn is installed, padding-free varlen batches under flash_attention_2.

Every variant is an `lmforge train` of the same ~0.5B Llama (bf16, same seed, data and
hyperparameters) on conversations whose lengths spread like real SFT data (lognormal, 40 to
`--max-length` tokens), each in its own process (FlexAttention's and compile's state are process
wide). Per variant: lmforge's `tokens_per_s` (real tokens: padding never counts) and `mfu`, median
over the steps after `--warmup`, and the CUDA allocator's peak. The first variant is the baseline
of the ratios.

    python bench/gpu_packing.py --out DIR [--variants padded,packed_sdpa,packed_flex,padding_free_flash]
        [--steps 40 --warmup 10 --max-length 2048 --batch 8] [--set train.kernels=liger ...]

`--set` adds lmforge overrides to every variant (a lever on top of each path). Needs a CUDA GPU
for flex and flash; `--smoke` runs a tiny model for a few steps (CPU too: padded and packed_sdpa
only) to check the script itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

# ~0.5B parameters: Llama layout, 16 layers of width 1536, GQA 12/4, MLP 4096, an untied 32k vocabulary.
MODEL = {
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}
SMOKE_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2}  # fmt: skip

VARIANTS: dict[str, dict[str, Any]] = {
    "padded": {"data.packing": False, "model.attn_implementation": "sdpa"},
    "packed_sdpa": {"data.packing": True, "model.attn_implementation": "sdpa"},
    "packed_flex": {"data.packing": True, "model.attn_implementation": "flex_attention"},
    "padding_free_flash": {"data.padding_free": True, "model.attn_implementation": "flash_attention_2"},
}


def write_data(out: Path, rows: int, max_length: int, seed: int) -> Path:
    """Alpaca rows cut from the standard library's source, answer lengths lognormal in words."""
    from lmforge.data.corpus import iter_builtin_documents

    rng = random.Random(seed)
    words: list[str] = []
    for document in iter_builtin_documents("builtin:python-stdlib"):
        words.extend(document.split())
        if len(words) > 3_000_000:
            break
    path = out / "sft.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        for _ in range(rows):
            prompt, answer = (
                rng.randint(8, 40),
                min(int(rng.lognormvariate(math.log(120), 0.9)), max_length // 2),
            )
            start = rng.randrange(len(words) - prompt - answer)
            row = {
                "instruction": " ".join(words[start : start + prompt]),
                "output": " ".join(words[start + prompt : start + prompt + answer]),
            }
            handle.write(json.dumps(row) + "\n")
    return path


def write_tokenizer(out: Path, vocab: int) -> Path:
    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.corpus import iter_builtin_documents
    from lmforge.data.tokenizer import train_tokenizer

    texts = []
    for document in iter_builtin_documents("builtin:python-stdlib"):
        texts.append(document)
        if sum(map(len, texts)) > 4_000_000:
            break
    path = out / "tokenizer"
    train_tokenizer(texts, TokenizerTrainConfig(vocab_size=vocab)).save_pretrained(path)
    return path


def config_for(out: Path, name: str, opts: argparse.Namespace, data: Path, tokenizer: Path) -> dict[str, Any]:
    return {
        "run": {"name": name, "output_dir": str(out), "seed": 0, "overwrite": True},
        "model": {"preset": "llama-tiny", "config": SMOKE_MODEL if opts.smoke else MODEL, "dtype": "float32"},
        "tokenizer": {"path": str(tokenizer)},
        "data": {"train": [{"path": str(data)}], "max_length": opts.max_length, "over_length": "truncate",
                 "cache_dir": str(out / "cache")},
        "train": {"stage": "sft", "max_steps": opts.steps, "micro_batch_size": opts.batch,
                  "precision": "fp32" if opts.smoke else "bf16", "log_every": 1, "resume": "never",
                  "save_every": None},
        "monitor": {"loggers": [], "eval_generations": None},
    }  # fmt: skip


def child(opts: argparse.Namespace) -> None:
    """One variant, in this process: lmforge's training, then its figures as one JSON line."""
    import torch
    import yaml

    from lmforge.config import load_config
    from lmforge.train.runner import run_training

    name = opts.variants
    base = config_for(opts.out, name, opts, opts.out / "sft.jsonl", opts.out / "tokenizer")
    path = opts.out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(base))
    overrides = [f"{key}={json.dumps(value)}" for key, value in VARIANTS[name].items()] + list(opts.set)
    run_training(load_config(path, overrides))
    rows = [json.loads(line) for line in (opts.out / name / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if r.get("step", 0) > opts.warmup and "tokens_per_s" in r]
    figures = {
        "variant": name,
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steady)),
        "mfu": round(statistics.median(r["mfu"] for r in steady if "mfu" in r), 4) if steady else None,
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if torch.cuda.is_available()
        else None,
        "steps": len(steady),
    }
    print("RESULT " + json.dumps(figures), flush=True)


def runnable(name: str) -> str | None:
    """Why this machine cannot run `name`, or None."""
    import torch

    gpu_only = VARIANTS[name]["model.attn_implementation"] in ("flex_attention", "flash_attention_2")
    if gpu_only and not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if name == "padding_free_flash" and importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    return None


def without_option(argv: list[str], option: str) -> list[str]:
    """`argv` without `option VALUE` / `option=VALUE`."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            kept.append(arg)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="rows per micro-batch (packed rows or samples)")
    parser.add_argument("--rows", type=int, default=40_000, help="conversations written")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--set", action="append", default=[], help="an lmforge override for every variant")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny model for a few steps (checks the script)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.smoke:
        opts.steps, opts.warmup, opts.max_length, opts.rows, opts.vocab = 6, 2, 256, 400, 500
    if opts.child:
        child(opts)
        return
    opts.out.mkdir(parents=True, exist_ok=True)
    write_data(opts.out, opts.rows, opts.max_length, seed=0)
    write_tokenizer(opts.out, opts.vocab)
    results = []
    for name in opts.variants.split(","):
        why = runnable(name)
        if why is not None:
            print(f"{name:20} skipped: {why}", flush=True)
            continue
        argv = without_option(sys.argv[1:], "--variants")
        done = subprocess.run(
            [sys.executable, __file__, *argv, "--variants", name, "--child"], capture_output=True, text=True
        )
        found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not found:
            print(f"{name:20} failed:\n{done.stderr[-3000:]}", flush=True)
            continue
        results.append(json.loads(found[-1].removeprefix("RESULT ")))
        print(json.dumps(results[-1]), flush=True)
    if results:
        base = results[0]
        for row in results:
            print(
                f"{row['variant']:20} {row['tokens_per_s']:>9,} real tokens/s ({row['tokens_per_s'] / base['tokens_per_s']:.2f}x)"
                f"  MFU {row['mfu']}  peak GPU {row['peak_gpu_gib']} GiB"
            )


if __name__ == "__main__":
    main()
