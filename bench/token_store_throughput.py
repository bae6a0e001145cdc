"""Tokenization throughput and peak memory: the sharded token store (datatrove tasks) vs the cache.

One generated corpus (bench/corpus_gen.py: JSONL shards of Python-stdlib paragraphs), one
tokenizer trained on its first shard, then each variant tokenizes the whole corpus from scratch
in its own fresh child process:
- cache: `prepare_pretraining_data` (the single-process cached path);
- store-N: `build_token_store` with N tasks of datatrove's local executor (N workers at once).
Printed: one JSON line per variant: tokens (EOS included), seconds, tokens/s, ratio to the cache,
`max_rss_mib` (getrusage of the reaped children: the variant's own process and the pool
processes it waited for) and `tree_rss_mib` (the peak sum of RSS over the variant's process tree,
sampled every 0.1 s: what several concurrent tasks hold together), then the load average: on a
shared machine time is noisy, memory is not.

    .venv/bin/python bench/token_store_throughput.py [--mb 100 --shards 16 --variants cache,store-1,store-2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from corpus_gen import write_corpus


def prepare_inputs(workdir: Path, megabytes: int, shards: int) -> tuple[Path, Path]:
    """The corpus and a tokenizer trained on its first shard, made once per workdir."""
    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.tokenizer import train_tokenizer

    corpus, tokenizer_dir = workdir / "corpus", workdir / "tokenizer"
    if not corpus.is_dir():
        write_corpus(corpus, megabytes * 1_000_000, shards, seed=0)
    if not tokenizer_dir.is_dir():
        first = sorted(corpus.glob("*.jsonl"))[0]
        texts = (json.loads(line)["text"] for line in first.open(encoding="utf-8"))
        tokenizer = train_tokenizer(texts, TokenizerTrainConfig(vocab_size=8192, max_chars=5_000_000))
        tokenizer.save_pretrained(str(tokenizer_dir))
    return corpus, tokenizer_dir


def run_variant(variant: str, corpus: Path, tokenizer_dir: Path, workdir: Path) -> dict[str, Any]:
    """Tokenize the corpus with `variant` into a fresh directory; tokens and seconds."""
    from lmforge.config.schema import DataConfig, SourceConfig, TokenStoreConfig
    from lmforge.data.text import prepare_pretraining_data
    from lmforge.data.token_store.build import build_token_store
    from lmforge.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tokenizer_dir))
    out = workdir / "runs" / f"{variant}-{time.time_ns()}"
    source = [SourceConfig(path=str(corpus))]
    started = time.perf_counter()
    if variant == "cache":
        cfg = DataConfig(train=source, max_length=1024, eval_fraction=0.0)
        report = prepare_pretraining_data(cfg, tokenizer, seed=0, cache_dir=out).report["train"]
        tokens = report["tokens"] + report["eos_tokens"]
    else:
        tasks = int(variant.split("-")[1])
        store_cfg = TokenStoreConfig(path=out / "store", tasks=tasks, workers=tasks)
        cfg = DataConfig(train=source, max_length=1024, eval_fraction=0.0, store=store_cfg)
        store = build_token_store(cfg, tokenizer, seed=0, cache_dir=out)
        tokens = json.loads((store / "manifest.json").read_text())["totals"]["tokens"]
    return {"tokens": tokens, "seconds": time.perf_counter() - started}


def _tree_rss_bytes(root: int) -> int:
    """RSS summed over `root` and its descendants, from /proc."""
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        try:
            with open(f"/proc/{pid}/statm") as statm:
                total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for thread in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{thread}/children") as children:
                    pending.extend(int(child) for child in children.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def measure(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the variant in a child of this fresh process: its peak RSS is the children's alone."""
    command = [sys.executable, __file__, "--run", variant, "--workdir", str(args.workdir)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak_tree = 0
    while child.poll() is None:
        peak_tree = max(peak_tree, _tree_rss_bytes(child.pid))
        time.sleep(0.1)
    assert child.stdout is not None and child.returncode == 0, f"{variant} failed ({child.returncode})"
    result = json.loads(child.stdout.read().strip().splitlines()[-1])
    max_rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        **result,
        "max_rss_mib": round(max_rss_kib / 1024, 1),
        "tree_rss_mib": round(peak_tree / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=100, help="corpus size in MB")
    parser.add_argument("--shards", type=int, default=16, help="input files of the corpus")
    parser.add_argument("--variants", default="cache,store-1,store-2")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lmforge-bench-token-store"))
    parser.add_argument("--run", help=argparse.SUPPRESS)  # inside the measured child
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the fresh process that measures it
    args = parser.parse_args()
    if args.run:
        corpus, tokenizer_dir = args.workdir / "corpus", args.workdir / "tokenizer"
        print(json.dumps(run_variant(args.run, corpus, tokenizer_dir, args.workdir)))
        return
    if args.measure:
        print(json.dumps(measure(args.measure, args)))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    corpus, _ = prepare_inputs(args.workdir, args.mb, args.shards)
    corpus_bytes = sum(f.stat().st_size for f in corpus.iterdir())
    cache_rate = None
    for variant in args.variants.split(","):
        command = [sys.executable, __file__, "--measure", variant, "--workdir", str(args.workdir)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rate = result["tokens"] / result["seconds"]
        cache_rate = rate if variant == "cache" else cache_rate
        ratio = round(rate / cache_rate, 3) if cache_rate else None
        line = {"variant": variant, "corpus_mb": round(corpus_bytes / 1e6, 1), **result}
        print(json.dumps({**line, "tokens_per_s": round(rate), "ratio_to_cache": ratio}), flush=True)
    print(json.dumps({"loadavg": os.getloadavg(), "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
