"""FSDP2 alone vs FSDP2 x tensor parallelism (data_shard 2 x tensor 2), FSDP2 x pipeline
(data_shard 2 x pipeline 2, 1F1B, two pipeline micro-batches) and FSDP2 x context parallelism
(data_shard 2 x context 2) on 4 processes: training throughput and peak memory per rank at the
same global batch, side by side in one invocation.

Same model, data, seed and global batch: FSDP2 alone runs 4 data ranks x `--micro` sequences,
the 2-D layouts 2 data ranks x 2 `--micro` (each tensor group, pipeline or context group of 2
ranks reads one batch). `--batch group` instead gives every batch group (a data rank, or a
tensor / pipeline / context group) `--micro` sequences: the global batch then halves under the 2-D
layouts, and context parallelism's point shows, half of every sequence per rank. Each run's
throughput is the median `tokens_per_s` (global, every token counted once) of its logged steps
after `--warmup` (metrics.jsonl); its memory is each rank's peak RSS (getrusage, written by the
worker at the end of training). Runs alternate the `--layouts` for `--repeats` rounds. On CPU
(gloo) the tensor-parallel all-reduces run inside every layer, so expect TP to lose throughput and
save per-rank memory; the ratios, not the absolute figures, carry over between machines.

    .venv/bin/python bench/fsdp_vs_tp.py                      # llama, hidden 512 x 8 layers (~30M)
    .venv/bin/python bench/fsdp_vs_tp.py --hidden 128 --layers 2 --steps 6 --warmup 2 --seq 64   # smoke
    .venv/bin/python bench/fsdp_vs_tp.py --layouts "fsdp,fsdp x cp" --seq 2048 --micro 1   # long sequences
    .venv/bin/python bench/fsdp_vs_tp.py --layouts "fsdp,fsdp x cp" --seq 4096 --micro 1 --batch group

Under torchrun the same file is the worker (`--worker CONFIG`): `lmforge train`'s run_training
with a callback that records the rank's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

PROCESSES = 4
# Layout name -> the `distributed:` degrees it adds to strategy fsdp.
LAYOUTS: dict[str, dict[str, int]] = {
    "fsdp": {},
    "fsdp x tp": {"tensor_parallel": 2},
    "fsdp x pp": {"pipeline_parallel": 2, "pipeline_microbatches": 2},
    "fsdp x cp": {"context_parallel": 2},
}


def write_config(out: Path, name: str, args: argparse.Namespace, *, degrees: dict[str, int]) -> Path:
    model_ranks = [
        degrees.get(key, 1) for key in ("tensor_parallel", "pipeline_parallel", "context_parallel")
    ]
    data_ranks = PROCESSES // (model_ranks[0] * model_ranks[1] * model_ranks[2])
    config = {
        "run": {"name": name, "output_dir": str(out), "seed": 0, "overwrite": True},
        "model": {
            "preset": "llama-tiny",
            "config": {
                "hidden_size": args.hidden,
                "intermediate_size": args.hidden * 11 // 4,
                "num_hidden_layers": args.layers,
                "num_attention_heads": args.hidden // 64 if args.hidden >= 256 else 4,
                "num_key_value_heads": max(args.hidden // 128, 2) if args.hidden >= 256 else 2,
            },
        },
        "tokenizer": {"train": {"vocab_size": args.vocab, "max_chars": 3_000_000}},
        "data": {
            "train": [{"path": "builtin:python-stdlib", "max_documents": 400}],
            "max_length": args.seq,
            "cache_dir": str(out / "cache"),
        },
        "train": {
            "max_steps": args.steps,
            # The same global batch (PROCESSES x micro sequences), or micro per batch group.
            "micro_batch_size": args.micro if args.batch == "group" else args.micro * PROCESSES // data_ranks,
            "precision": "fp32",
            "resume": "never",
            "save_every": None,
            "log_every": 1,
        },
        "distributed": {"strategy": "fsdp", **degrees},
        "monitor": {"eval_generations": None, "loggers": []},
    }
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def timed_run(
    out: Path, name: str, args: argparse.Namespace, *, degrees: dict[str, int]
) -> tuple[float, list[int]]:
    """(median global tokens/s after the warm-up, peak RSS bytes of each rank)."""
    config = write_config(out, name, args, degrees=degrees)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(PROCESSES),
        "--master_port", str(_free_port()), __file__, "--worker", str(config),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
    run_dir = out / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_s"] for r in records if r.get("step", 0) > args.warmup and "tokens_per_s" in r]
    rss = [json.loads((run_dir / f"peak_rss_rank{r}.json").read_text())["bytes"] for r in range(PROCESSES)]
    return statistics.median(steady), rss


def worker(config_path: Path) -> None:
    """One rank of a run: lmforge's training, then this rank's peak RSS into the run directory."""
    from transformers import TrainerCallback

    from lmforge.config import load_config
    from lmforge.train.runner import run_training

    class PeakRss(TrainerCallback):  # type: ignore[misc]
        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
            (Path(cfg.run.dir) / f"peak_rss_rank{os.environ['RANK']}.json").write_text(
                json.dumps({"bytes": peak})
            )

    cfg = load_config(config_path)
    run_training(cfg, extra_callbacks=[PeakRss()])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=2, help="sequences per rank under FSDP2 alone")
    parser.add_argument(
        "--batch",
        choices=("global", "group"),
        default="global",
        help="global: the same global batch for every layout; group: --micro sequences per batch group",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument(
        "--layouts", default="fsdp,fsdp x tp,fsdp x pp", help="comma-separated, of " + ", ".join(LAYOUTS)
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    names = [name.strip() for name in args.layouts.split(",")]
    runs: dict[str, list[tuple[float, list[int]]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        warm = argparse.Namespace(**{**vars(args), "steps": 2, "warmup": 0})
        timed_run(out, "warm", warm, degrees={})  # the tokenizer and the data cache, shared by all
        for repeat in range(args.repeats):
            for name in names:
                tokens, rss = timed_run(out, f"{name.replace(' ', '')}-{repeat}", args, degrees=LAYOUTS[name])
                runs[name].append((tokens, rss))
                peak = ", ".join(f"{b / 2**20:.0f}" for b in rss)
                print(f"{name:9} {tokens:9.0f} tokens/s  peak RSS per rank (MiB): {peak}", flush=True)
    batch = (
        f"global batch {PROCESSES * args.micro}"
        if args.batch == "global"
        else f"{args.micro} per batch group"
    )
    print(f"model: llama hidden {args.hidden} x {args.layers} layers, seq {args.seq}, {batch}")
    base_tokens = statistics.median(t for t, _ in runs[names[0]])
    base_rss = statistics.median(max(r) for _, r in runs[names[0]])
    for name in names:
        tokens = statistics.median(t for t, _ in runs[name])
        rss = statistics.median(max(r) for _, r in runs[name])
        print(
            f"{name:9}: {tokens:9.0f} tokens/s ({tokens / base_tokens:.3f}x), max peak RSS {rss / 2**20:.0f} MiB "
            f"({rss / base_rss:.3f}x of {names[0]})"
        )


if __name__ == "__main__":
    main()
