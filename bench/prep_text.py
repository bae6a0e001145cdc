"""Benchmark: pretraining text preparation, lmforge vs the Hugging Face run_clm.py recipe.

Both sides read the same JSONL corpus (the Python stdlib repeated until it holds at least
--min-tokens tokens), use the same byte-level BPE tokenizer (vocab 8192, trained once
here), append EOS to every document and cut the stream into blocks of --block tokens.
Each side runs in its own child process so its peak RSS (VmHWM) is its own.

    .venv/bin/python bench/prep_text.py            # about 4-5 minutes on 2 cores

The baseline is written as transformers' examples/pytorch/language-modeling/run_clm.py
does it: load_dataset("json") -> Dataset.map(tokenize, batched=True) ->
Dataset.map(group_texts, batched=True) with itertools.chain. Runs fully offline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

REPEATS_NOTE = "best of {n} run(s) per side, alternating sides (this VM's timings are noisy)"


def _memory_kib(key: str) -> int:
    """VmHWM (peak resident set) or VmRSS of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return -1


def _cpu_s() -> float:
    """CPU seconds used so far by this process, all threads (robust to other load on the machine)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def build_corpus(workdir: Path, min_tokens: int, vocab_size: int) -> dict[str, Any]:
    """Train the shared tokenizer and write corpus.jsonl; returns what was built."""
    from lmforge.config.schema import SourceConfig, TokenizerTrainConfig
    from lmforge.data.sources import iter_documents
    from lmforge.data.tokenizer import train_tokenizer

    documents = list(iter_documents(SourceConfig(path="builtin:python-stdlib")))
    tokenizer = train_tokenizer(documents, TokenizerTrainConfig(vocab_size=vocab_size))
    tokenizer.save_pretrained(workdir / "tokenizer")
    encodings = tokenizer.backend_tokenizer.encode_batch_fast(documents, add_special_tokens=False)
    tokens_per_pass = sum(len(e) for e in encodings) + len(documents)
    passes = math.ceil(min_tokens / tokens_per_pass)
    with (workdir / "corpus.jsonl").open("w", encoding="utf-8") as handle:
        for _ in range(passes):
            for text in documents:
                handle.write(json.dumps({"text": text}) + "\n")
    return {
        "documents": passes * len(documents),
        "tokens_with_eos": passes * tokens_per_pass,
        "passes_over_stdlib": passes,
        "corpus_mb": round((workdir / "corpus.jsonl").stat().st_size / 1e6, 1),
    }


def run_lmforge(workdir: Path, block: int) -> dict[str, Any]:
    """lmforge's prepare_pretraining_data into a fresh cache directory (no reuse)."""
    from transformers import AutoTokenizer

    from lmforge.config.schema import DataConfig, SourceConfig
    from lmforge.data.text import prepare_pretraining_data

    tokenizer = AutoTokenizer.from_pretrained(workdir / "tokenizer", local_files_only=True)
    rss_after_imports = _memory_kib("VmRSS")
    cache = Path(tempfile.mkdtemp(prefix="lmforge-cache-", dir=workdir))
    cfg = DataConfig(train=[SourceConfig(path=str(workdir / "corpus.jsonl"))], max_length=block)
    started, cpu_started = time.perf_counter(), _cpu_s()
    prepared = prepare_pretraining_data(cfg, tokenizer, seed=0, cache_dir=cache)
    total, cpu = time.perf_counter() - started, _cpu_s() - cpu_started
    assert not prepared.from_cache
    blocks = np.asarray(prepared.train_blocks)
    train = prepared.report["train"]
    result = {
        "total_s": total,
        "cpu_s": cpu,
        "pack_s": prepared.timings["pack_s"],
        "tokenize_s": prepared.timings["tokenize_s"],
        "read_s": prepared.timings["read_s"],
        "tokens": train["tokens"] + train["eos_tokens"],
        "blocks": int(blocks.shape[0]),
        "first_block_sha256": hashlib.sha256(blocks[0].tobytes()).hexdigest(),
        "rss_after_imports_kib": rss_after_imports,
    }
    shutil.rmtree(cache)
    return result


def run_hf_recipe(workdir: Path, block: int) -> dict[str, Any]:
    """The run_clm.py recipe with `datasets` (fresh cache directory, default batch size 1000)."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(workdir / "tokenizer", local_files_only=True)
    rss_after_imports = _memory_kib("VmRSS")
    cache = tempfile.mkdtemp(prefix="hf-cache-", dir=workdir)
    eos = tokenizer.eos_token

    def tokenize_function(examples: dict[str, list[Any]]) -> Any:
        # EOS as text: the tokenizer maps it to the EOS id, the cheapest way to add it here.
        return tokenizer([text + eos for text in examples["text"]])

    def group_texts(examples: dict[str, list[Any]]) -> dict[str, list[Any]]:
        # Verbatim from run_clm.py (the per-batch remainder is dropped, as there).
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        total_length = (total_length // block) * block
        result = {
            k: [t[i : i + block] for i in range(0, total_length, block)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    started, cpu_started = time.perf_counter(), _cpu_s()
    raw = datasets.load_dataset(
        "json", data_files=str(workdir / "corpus.jsonl"), split="train", cache_dir=cache
    )
    loaded = time.perf_counter()
    tokenized = raw.map(tokenize_function, batched=True, remove_columns=["text"])
    tokenized_at = time.perf_counter()
    grouped = tokenized.map(group_texts, batched=True)
    finished, cpu = time.perf_counter(), _cpu_s() - cpu_started
    lengths = tokenized.data.column("input_ids").combine_chunks().value_lengths()
    first = np.asarray(grouped[0]["input_ids"], dtype=np.int32)
    return {
        "total_s": finished - started,
        "cpu_s": cpu,
        "pack_s": finished - tokenized_at,
        "tokenize_s": tokenized_at - loaded,
        "read_s": loaded - started,
        "tokens": int(np.asarray(lengths).sum()),
        "blocks": grouped.num_rows,
        "first_block_sha256": hashlib.sha256(first.tobytes()).hexdigest(),
        "rss_after_imports_kib": rss_after_imports,
    }


def run_side_in_child(side: str, workdir: Path, block: int) -> dict[str, Any]:
    """Run one side in a fresh interpreter; its peak RSS is then its own."""
    command = [sys.executable, __file__, "--worker", side, "--workdir", str(workdir), "--block", str(block)]
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(workdir / "hf_home"),
    }
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"{side} worker failed with exit code {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(corpus: dict[str, Any], runs: dict[str, list[dict[str, Any]]], block: int) -> dict[str, Any]:
    best = {side: min(results, key=lambda r: r["total_s"]) for side, results in runs.items()}
    ours, theirs = best["lmforge"], best["hf"]
    ours_pack = min(r["pack_s"] for r in runs["lmforge"])
    theirs_pack = min(r["pack_s"] for r in runs["hf"])
    return {
        "corpus": corpus,
        "block_length": block,
        "note": REPEATS_NOTE.format(n=len(runs["lmforge"])),
        "lmforge": {
            **ours,
            "tokens_per_s": ours["tokens"] / ours["total_s"],
            "peak_rss_mib": _peak_mib(runs["lmforge"]),
        },
        "hf": {
            **theirs,
            "tokens_per_s": theirs["tokens"] / theirs["total_s"],
            "peak_rss_mib": _peak_mib(runs["hf"]),
        },
        "end_to_end_speedup": theirs["total_s"] / ours["total_s"],
        "packing_speedup": theirs_pack / ours_pack,
        "cpu_time_ratio": min(r["cpu_s"] for r in runs["hf"]) / min(r["cpu_s"] for r in runs["lmforge"]),
        "first_block_identical": ours["first_block_sha256"] == theirs["first_block_sha256"],
        "all_lmforge_totals_s": [round(r["total_s"], 2) for r in runs["lmforge"]],
        "all_hf_totals_s": [round(r["total_s"], 2) for r in runs["hf"]],
    }


def _peak_mib(results: list[dict[str, Any]]) -> float:
    return round(max(r["peak_rss_kib"] for r in results) / 1024, 1)


def print_table(summary: dict[str, Any]) -> None:
    ours, theirs = summary["lmforge"], summary["hf"]
    rows = [
        ("tokens (with EOS)", f"{ours['tokens']:,}", f"{theirs['tokens']:,}"),
        ("blocks", f"{ours['blocks']:,}", f"{theirs['blocks']:,}"),
        ("end-to-end s", f"{ours['total_s']:.2f}", f"{theirs['total_s']:.2f}"),
        ("end-to-end CPU s", f"{ours['cpu_s']:.2f}", f"{theirs['cpu_s']:.2f}"),
        ("end-to-end tokens/s", f"{ours['tokens_per_s']:,.0f}", f"{theirs['tokens_per_s']:,.0f}"),
        ("read s", f"{ours['read_s']:.2f}", f"{theirs['read_s']:.2f}"),
        ("tokenize s", f"{ours['tokenize_s']:.2f}", f"{theirs['tokenize_s']:.2f}"),
        ("packing s", f"{ours['pack_s']:.3f}", f"{theirs['pack_s']:.2f}"),
        ("peak RSS MiB", f"{ours['peak_rss_mib']}", f"{theirs['peak_rss_mib']}"),
        (
            "RSS after imports MiB",
            f"{ours['rss_after_imports_kib'] / 1024:.0f}",
            f"{theirs['rss_after_imports_kib'] / 1024:.0f}",
        ),
    ]
    print(f"\ncorpus: {summary['corpus']}; block {summary['block_length']}; {summary['note']}")
    print(f"{'':24}{'lmforge':>16}{'HF run_clm':>16}")
    for name, a, b in rows:
        print(f"{name:24}{a:>16}{b:>16}")
    print(f"end-to-end speedup: {summary['end_to_end_speedup']:.2f}x (goal >= 2x)")
    print(f"packing speedup:    {summary['packing_speedup']:.1f}x (goal >= 20x)")
    print(f"CPU-time ratio:     {summary['cpu_time_ratio']:.2f}x (HF CPU seconds / lmforge CPU seconds)")
    print(f"first block identical: {summary['first_block_identical']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--min-tokens", type=int, default=20_000_000)
    parser.add_argument("--block", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3, help="runs per side; the best is reported")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="default: a temporary directory, removed after"
    )
    parser.add_argument("--worker", choices=["lmforge", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="also print the summary as JSON")
    args = parser.parse_args()
    if args.worker:
        run = run_lmforge if args.worker == "lmforge" else run_hf_recipe
        result = run(args.workdir, args.block)
        print(json.dumps({**result, "peak_rss_kib": _memory_kib("VmHWM")}))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lmforge-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        print(f"building corpus and tokenizer in {workdir} ...", flush=True)
        corpus = build_corpus(workdir, args.min_tokens, args.vocab_size)
        runs: dict[str, list[dict[str, Any]]] = {"lmforge": [], "hf": []}
        for attempt in range(args.repeats):
            for side in ("lmforge", "hf"):
                runs[side].append(run_side_in_child(side, workdir, args.block))
                print(f"run {attempt + 1} {side}: {runs[side][-1]['total_s']:.2f} s", flush=True)
        summary = summarise(corpus, runs, args.block)
        print_table(summary)
        if args.json:
            print(json.dumps(summary, indent=2))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
