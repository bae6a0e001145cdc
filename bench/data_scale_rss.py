"""Peak memory of preparing and of training at two corpus sizes: it must not grow with the corpus.

For each corpus (folders written by bench/corpus_gen.py, e.g. 1 GB and 10 GB): `lmforge prepare`
building the sharded token store, then `lmforge train` reading that store, then `lmforge train`
reading the corpus as a stream. Peak RSS is of the whole process tree (the store's tasks run in
child processes), sampled every 0.2 s with psutil; each training run is `--steps` optimizer steps
of a small model, so the corpus size is the only thing that changes between the two columns.

    .venv/bin/python bench/data_scale_rss.py --corpus /tmp/corpus-1g --corpus /tmp/corpus-10g --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

MODEL = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 2}


def tree_rss_mb(process: psutil.Process) -> float:
    total = 0
    for member in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += member.memory_info().rss
    return total / 2**20


def run_measured(*args: str) -> dict[str, float]:
    """Run `lmforge ARGS`; its wall time and the peak RSS of its process tree."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:  # a pipe would fill up and stall a long run
        process = subprocess.Popen(
            [sys.executable, "-m", "lmforge.cli.main", *args], stdout=log, stderr=log, text=True
        )
        watched = psutil.Process(process.pid)
        peak = 0.0
        while process.poll() is None:
            with contextlib.suppress(psutil.Error):
                peak = max(peak, tree_rss_mb(watched))
            time.sleep(0.2)
        if process.returncode != 0:
            log.seek(0)
            raise RuntimeError(log.read()[-3000:])
    return {"seconds": round(time.perf_counter() - started, 1), "peak_rss_mb": round(peak, 1)}


def config(
    root: Path, corpus: Path, name: str, tokenizer: Path, steps: int, tasks: int, **data: object
) -> Path:
    cfg = {
        "run": {"name": name, "seed": 0, "output_dir": str(root / "runs"), "overwrite": True},
        "model": {"preset": "llama-tiny", "config": MODEL},
        "tokenizer": {"path": str(tokenizer)},
        "data": {
            "train": [{"path": str(corpus / "*.jsonl")}],
            "max_length": 256,
            "cache_dir": str(root / "cache"),
            **data,
        },
        "train": {"max_steps": steps, "micro_batch_size": 8, "lr": 1e-3, "precision": "fp32", "log_every": 5},
        "monitor": {"loggers": []},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, action="append", required=True)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lmforge-data-rss-"))
    first_shard = sorted(args.corpus[0].glob("*.jsonl"))[0]
    tokenizer = root / "tokenizer"
    subprocess.run(
        [sys.executable, "-m", "lmforge.cli.main", "tokenizer", "train", "--input", str(first_shard),
         "--vocab-size", "8192", "--out", str(tokenizer)],
        check=True, capture_output=True,
    )  # fmt: skip
    results = []
    for corpus in args.corpus:
        size = sum(f.stat().st_size for f in corpus.glob("*.jsonl"))
        store = config(
            root,
            corpus,
            f"store-{corpus.name}",
            tokenizer,
            args.steps,
            args.tasks,
            store={"tasks": args.tasks},
        )
        stream = config(
            root, corpus, f"stream-{corpus.name}", tokenizer, args.steps, args.tasks, streaming=True
        )
        results.append(
            {
                "corpus": str(corpus),
                "corpus_bytes": size,
                "prepare_store": run_measured("prepare", str(store)),
                "train_from_store": run_measured("train", str(store)),
                "train_from_stream": run_measured("train", str(stream)),
                "load_average_1m": os.getloadavg()[0],
            }
        )
        print(json.dumps(results[-1]), flush=True)
    if not args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
