"""Chunked next-token cross-entropy vs transformers' loss on materialised logits: peak memory and
time of one forward+backward of the output head and the loss.

Same hidden states (batch x seq x width, float32, seed 0), same bias-free head, same labels (every
token a target, as in pretraining, so skipping ignored tokens does not help the chunked side):
- full: `ForCausalLMLoss(head(hidden), labels)` from transformers, the loss every HF causal LM uses;
- torch op: `chunked_next_token_loss` with the head module, i.e. torch's chunked
  `F.linear_cross_entropy`;
- checkpoint: `chunked_next_token_loss` with a callable head (as a LoRA-adapted or soft-capped
  head takes), chunks under `torch.utils.checkpoint`.
Each side at each vocabulary runs in its own fresh child process, so its peak RSS (`ru_maxrss`,
taken above the RSS just before the first forward) is its own. The children fix glibc's mmap
threshold at 1 MiB (MALLOC_MMAP_THRESHOLD_): by default glibc raises it up to 32 MiB as blocks are
freed and then keeps freed blocks below it in the heap, so RSS counted dead chunks (checkpoint at
vocab 32k: 448 MiB with the default, 203 MiB fixed; full: 385 both). --default-malloc shows that. Time is the median of --repeats
forward+backward after one warm-up. The `uptime` load
average is printed with the timings: on a shared machine time is noisy, memory is not.

    .venv/bin/python bench/chunked_ce.py [--batch 2 --seq 512 --width 512 --chunk-tokens 256 \\
        --vocabs 150000,32000 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("full", "torch op", "checkpoint")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_child(variant: str, batch: int, seq: int, width: int, vocab: int, chunk: int, repeats: int) -> dict:
    """One side in this (fresh) process: peak RSS over the start, and seconds per forward+backward."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lmforge.train.chunked_loss import chunked_next_token_loss

    def loss_fn(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if variant == "full":
            return ForCausalLMLoss(head(hidden), labels, head.out_features)
        how = head if variant == "torch op" else (lambda h: head(h))
        return chunked_next_token_loss(hidden, how, labels, chunk_tokens=chunk)

    # A first call on a tiny problem: the code paths' lazy imports and registrations (80 MiB for
    # checkpoint and torch's op) happen here, not inside the measured peak.
    loss_fn(
        torch.nn.Linear(width, 16), torch.randn(1, 4, width, requires_grad=True), torch.ones(1, 4).long()
    ).backward()

    torch.manual_seed(0)
    head = torch.nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(batch, seq, width, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq))
    start = rss_bytes()
    seconds = []
    for _ in range(repeats + 1):
        hidden.grad, head.weight.grad = None, None
        began = time.perf_counter()
        loss = loss_fn(head, hidden, labels)
        loss.backward()
        seconds.append(time.perf_counter() - began)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "peak_mib": (peak - start) / 2**20,
        "seconds": statistics.median(seconds[1:]),
        "all_seconds": seconds,
        "loss": loss.item(),
    }


def load_average() -> str:
    return os.getloadavg().__repr__()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--vocabs", default="150000,32000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--default-malloc", action="store_true", help="leave glibc's mmap threshold dynamic")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.batch, args.seq, args.width)
    if args.child:
        vocab = int(args.vocabs)
        print(json.dumps(run_child(args.child, *shape, vocab, args.chunk_tokens, args.repeats)))
        return

    import torch

    print(
        f"batch {args.batch} x seq {args.seq}, width {args.width}, chunks of {args.chunk_tokens} tokens, "
        f"float32, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{'default' if args.default_malloc else 'fixed 1 MiB'} glibc mmap threshold"
    )
    print(f"load average (1, 5, 15 min) at start: {load_average()}")
    rows = []
    for vocab in map(int, args.vocabs.split(",")):
        results = {}
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--child", variant, "--vocabs", str(vocab)]
            cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--width", str(args.width)]
            cmd += ["--chunk-tokens", str(args.chunk_tokens), "--repeats", str(args.repeats)]
            env = os.environ if args.default_malloc else {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
            results[variant] = json.loads(out.strip().splitlines()[-1])
            runs = ", ".join(f"{s:.2f}" for s in results[variant]["all_seconds"])
            print(f"  vocab {vocab:,} {variant:10} runs (s, first is warm-up): {runs}", flush=True)
        logits_mib = args.batch * args.seq * vocab * 4 / 2**20
        full = results["full"]
        for variant in VARIANTS:
            r = results[variant]
            rows.append(
                f"| {vocab:,} | {logits_mib:,.0f} | {variant} | {r['peak_mib']:,.0f} | "
                f"{r['peak_mib'] / full['peak_mib']:.2f} | {r['seconds']:.2f} | "
                f"{r['seconds'] / full['seconds']:.2f} | {r['loss']:.6f} |"
            )
    print(f"load average (1, 5, 15 min) at end: {load_average()}")
    print()
    print(
        "| vocab | fp32 logits (MiB) | side | peak over start (MiB) | peak / full | fwd+bwd (s) | time / full | loss |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
