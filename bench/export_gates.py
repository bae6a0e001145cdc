"""Quantized exports, measured: (1) quantize time and peak RSS of lmforge's GGUF quantization
(llama.cpp's `llama_model_quantize` through llama-cpp-python, export/gguf_quantize.py) against
llama.cpp's own `llama-quantize` tool on the same f16 GGUF, each in a fresh child process, sides
alternating; (2) the gates' numbers (perplexity increase, top-1 agreement, task accuracy) of every
export precision (GGUF types, ONNX f32 / int8, compressed-tensors fp8 / w8a16 / w4a16) of one model against the model itself, on a data file, through `ckpt verify`.

    # (1) needs the tool: build it from llama-cpp-python's sdist (vendor/llama.cpp):
    #     cmake -S vendor/llama.cpp -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-quantize
    .venv/bin/python bench/export_gates.py quantize --llama-quantize build/bin/llama-quantize --repeats 3
    # (2) on a run's final/ (an adapter run: the merged model) and its held-out QA rows:
    .venv/bin/python bench/export_gates.py gates --model runs/quickstart/finetune/final \\
        --data runs/quickstart/data/groups_test.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF_TYPES = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0", "q3_k_m", "q2_k")


def timed(command: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of `command`, a fresh child process (its own rusage from wait4)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{command[0]} failed ({os.waitstatus_to_exitcode(status)})")
    return seconds, usage.ru_maxrss / 1024


def big_llama(out: Path, hidden: int, layers: int, vocab: int) -> Path:
    """A random Llama of the given shape with a trained tokenizer (time and memory only)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(
        ["the cat sat on the mat and the dog sat on the log\n"] * 200, TokenizerTrainConfig(vocab_size=300)
    )
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 256 * 256,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64 // 4 or 1,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float16)
    model.resize_token_embeddings(vocab)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def prepare_f16(opts: argparse.Namespace) -> None:
    """(child process) The model and its f16 GGUF, written by lmforge."""
    from lmforge.export.convert import convert

    out = Path(opts.out)
    model = Path(opts.model) if opts.model else big_llama(out / "model", opts.hidden, opts.layers, 32000)
    convert(model, "gguf", out / "f16", dtype="f16")


def bench_quantize(opts: argparse.Namespace) -> None:
    # The model is built in a child: a child's peak RSS (ru_maxrss) starts at its parent's RSS
    # at fork time, so this process stays small (no torch) for the sides' numbers to be their own.
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        given = ["--model", opts.model] if opts.model else []
        subprocess.run(
            [
                sys.executable,
                __file__,
                "prepare",
                "--out",
                str(out),
                "--hidden",
                str(opts.hidden),
                "--layers",
                str(opts.layers),
                *given,
            ],
            check=True,
        )
        source = out / "f16" / "model-f16.gguf"
        sides = {
            "llama-quantize": lambda dst: [
                opts.llama_quantize,
                str(source),
                str(dst),
                opts.type.upper(),
                str(os.cpu_count()),
            ],
            "lmforge": lambda dst: [
                sys.executable,
                "-c",
                "import sys; from pathlib import Path; from lmforge.export.gguf_quantize import quantize; "
                "quantize(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])",
                str(source),
                str(dst),
                opts.type,
            ],
        }
        results: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
        sizes: dict[str, int] = {}
        for repeat in range(opts.repeats):
            order = list(sides) if repeat % 2 == 0 else list(sides)[::-1]
            for side in order:
                dst = out / f"{side}-{repeat}.gguf"
                results[side].append(timed(sides[side](dst)))
                sizes[side] = dst.stat().st_size
                dst.unlink()
                print(
                    f"{side:15} run {repeat}: {results[side][-1][0]:.2f} s, peak RSS {results[side][-1][1]:.0f} MiB, load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        median = {
            side: (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
            for side, runs in results.items()
        }
        print(
            f"f16 GGUF {source.stat().st_size / 2**20:.0f} MiB -> {opts.type}: lmforge / llama-quantize time "
            f"{median['lmforge'][0] / median['llama-quantize'][0]:.3f}x, peak RSS "
            f"{median['lmforge'][1] / median['llama-quantize'][1]:.3f}x; output bytes equal: "
            f"{sizes['lmforge'] == sizes['llama-quantize']}"
        )
        print(
            json.dumps(
                {
                    "bench": "gguf_quantize",
                    "type": opts.type,
                    "f16_bytes": source.stat().st_size,
                    "runs": results,
                    "sizes": sizes,
                }
            )
        )


def bench_gates(opts: argparse.Namespace) -> None:
    from lmforge.errors import UserInputError
    from lmforge.export.convert import convert
    from lmforge.export.verify import verify

    model, data = Path(opts.model), Path(opts.data)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        formats = [("gguf", dtype) for dtype in GGUF_TYPES] + [("onnx", "f32"), ("onnx", "int8")]
        formats += [
            ("compressed-tensors", "fp8"),
            ("compressed-tensors", "w8a16"),
            ("compressed-tensors", "w4a16"),
        ]
        if opts.imatrix_data:  # the k-quants again, with llama.cpp's importance matrix from that file
            formats += [("gguf", f"{dtype}+imatrix") for dtype in ("q4_k_m", "q3_k_m", "q2_k")]
        for fmt, label in formats:
            if opts.only and fmt != opts.only:
                continue
            dtype, _, imatrix = label.partition("+")
            target = out / f"{fmt}-{label}"
            start = time.perf_counter()
            try:
                convert(
                    model, fmt, target, dtype=dtype, imatrix_data=Path(opts.imatrix_data) if imatrix else None
                )
            except UserInputError as refused:  # a scheme that does not fit this model's sizes
                print(f"| {fmt} {label} | refused: {refused} |", flush=True)
                continue
            seconds = time.perf_counter() - start
            verdict = verify(target, against=model, data=data)
            parity = verdict.parity
            accuracy = parity.get("accuracy") or {}
            rows.append(
                {
                    "format": f"{fmt} {label}",
                    "precision": verdict.precision,
                    "runtime": verdict.runtime,
                    "bytes": sum(
                        f.stat().st_size
                        for f in target.iterdir()
                        if f.suffix in (".gguf", ".onnx", ".data", ".safetensors")
                    ),
                    "convert_s": round(seconds, 1),
                    "ppl_increase": parity["ppl_increase"],
                    "top1_agreement": parity["top1_agreement"],
                    "accuracy": accuracy.get("artifact"),
                    "accuracy_reference": accuracy.get("reference"),
                    "accuracy_drop": accuracy.get("drop"),
                    "passed": verdict.passed,
                    "failures": verdict.failures,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(
        "| export | precision | MiB | perplexity increase | top-1 agreement | accuracy (trained) | passes its default gates |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        accuracy = (
            f"{row['accuracy']:.1%} ({row['accuracy_reference']:.1%})" if row["accuracy"] is not None else "-"
        )
        print(
            f"| {row['format']} | {row['precision']} | {row['bytes'] / 2**20:.1f} | {row['ppl_increase']:+.2%} | "
            f"{row['top1_agreement']:.1%} | {accuracy} | {'yes' if row['passed'] else 'no: ' + '; '.join(row['failures'])} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    quantize = commands.add_parser("quantize", help="lmforge's quantization vs llama-quantize")
    quantize.add_argument("--llama-quantize", required=True, help="path of llama.cpp's llama-quantize")
    quantize.add_argument(
        "--model", help="HF model directory (default: a random Llama of --hidden / --layers)"
    )
    quantize.add_argument("--hidden", type=int, default=1024)
    quantize.add_argument("--layers", type=int, default=12)
    quantize.add_argument("--type", default="q4_k_m")
    quantize.add_argument("--repeats", type=int, default=3)
    prepare = commands.add_parser("prepare", help="(used by quantize) the model and its f16 GGUF")
    prepare.add_argument("--out", required=True)
    prepare.add_argument("--model")
    prepare.add_argument("--hidden", type=int, default=1024)
    prepare.add_argument("--layers", type=int, default=12)
    gates = commands.add_parser("gates", help="every precision's gate numbers on one model")
    gates.add_argument("--model", required=True)
    gates.add_argument("--data", required=True)
    gates.add_argument("--only", help="one format (gguf, onnx, compressed-tensors)")
    gates.add_argument(
        "--imatrix-data",
        help="also the k-quants with an importance matrix from this file (llama.cpp tools on PATH)",
    )
    opts = parser.parse_args()
    if opts.command != "prepare":
        loads = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"load average before: {loads} on {os.cpu_count()} cores", flush=True)
    {"quantize": bench_quantize, "prepare": prepare_f16, "gates": bench_gates}[opts.command](opts)


if __name__ == "__main__":
    main()
