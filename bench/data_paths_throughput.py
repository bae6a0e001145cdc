"""Training tokens/s reading the token store and reading a stream, against reading the cache.

The same model, corpus, tokenizer, batch and steps, three ways of reading the data: the cache
(`data/text.py`, the baseline), the sharded token store (`data.store`, memory-mapped) and a stream
(`data.streaming: true`, tokenized and packed while training). Each is built first (not timed),
then `lmforge train` runs the three in turn, `--repeats` times, alternating; tokens/s is the
median of each run's logged `tokens_per_s` after `--warmup` steps, and the ratio is against the
cache run of the same repeat. Peak RSS of each training process is read from `VmHWM`.

    .venv/bin/python bench/data_paths_throughput.py --corpus /tmp/corpus-1g --files 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

MODEL = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4}
PATHS = {"cache": {}, "store": {"store": {"tasks": 2, "workers": 1}}, "stream": {"streaming": True}}


def config(root: Path, corpus: list[Path], name: str, steps: int, tokenizer: Path) -> Path:
    data = {
        "train": [{"path": str(file)} for file in corpus],
        "max_length": 256,
        "cache_dir": str(root / "cache"),
        **PATHS[name],
    }
    cfg = {
        "run": {"name": name, "seed": 0, "output_dir": str(root / "runs"), "overwrite": True},
        "model": {"preset": "llama-tiny", "config": MODEL},
        "tokenizer": {"path": str(tokenizer)},
        "data": data,
        "train": {
            "max_steps": steps,
            "micro_batch_size": 8,
            "lr": 1e-3,
            "precision": "fp32",
            "log_every": 1,
        },
        "monitor": {"loggers": []},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def lmforge(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "lmforge.cli.main", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def peak_rss_mb(process: subprocess.Popen[str]) -> float:
    """Wait for `process`, sampling its VmHWM (the kernel's peak resident set) until it exits."""
    peak = 0.0
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.append(process.stderr.read() if process.stderr else ""))
    reader.start()
    while process.poll() is None:
        try:
            for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) / 1024)
        except OSError:
            pass
        time.sleep(0.2)
    reader.join()
    if process.returncode != 0:
        raise RuntimeError("".join(stderr)[-3000:])
    return peak


def tokens_per_s(run: Path, warmup: int) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    values = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > warmup]
    return statistics.median(values)


def train_tokenizer(root: Path, corpus: list[Path]) -> Path:
    """One BPE tokenizer (vocab 8192) for every run, trained once on the first shard."""
    out = root / "tokenizer"
    result = subprocess.run(
        [sys.executable, "-m", "lmforge.cli.main", "tokenizer", "train", "--input", str(corpus[0]),
         "--vocab-size", "8192", "--out", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="a folder of .jsonl shards")
    parser.add_argument("--files", type=int, default=2, help="shards of it to use")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    corpus = sorted(args.corpus.glob("*.jsonl"))[: args.files]
    root = Path(tempfile.mkdtemp(prefix="lmforge-data-paths-"))
    tokenizer = train_tokenizer(root, corpus)
    configs = {name: config(root, corpus, name, args.steps, tokenizer) for name in PATHS}
    for name in ("cache", "store"):  # built before anything is timed
        prepared = subprocess.run(
            [sys.executable, "-m", "lmforge.cli.main", "prepare", str(configs[name])],
            capture_output=True,
            text=True,
        )
        if prepared.returncode != 0:
            raise RuntimeError(prepared.stderr[-3000:])
    results: dict[str, list[dict[str, float]]] = {name: [] for name in PATHS}
    for _ in range(args.repeats):
        for name, path in configs.items():
            rss = peak_rss_mb(lmforge("train", str(path)))
            results[name].append(
                {"tokens_per_s": tokens_per_s(root / "runs" / name, args.warmup), "peak_rss_mb": rss}
            )
    baseline = [r["tokens_per_s"] for r in results["cache"]]
    summary = {
        "corpus_bytes": sum(f.stat().st_size for f in corpus),
        "steps": args.steps,
        "load_average_1m": os.getloadavg()[0],
        "paths": {
            name: {
                "tokens_per_s": [round(r["tokens_per_s"], 1) for r in runs],
                "ratio_to_cache": [
                    round(r["tokens_per_s"] / b, 3) for r, b in zip(runs, baseline, strict=True)
                ],
                "peak_rss_mb": [round(r["peak_rss_mb"], 1) for r in runs],
            }
            for name, runs in results.items()
        },
    }
    print(json.dumps(summary, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
