"""SFT data preparation: `lmforge prepare` vs a `datasets.map` pass of apply_chat_template.

Both read the same chat JSONL (OpenAI `messages` rows) with the same tokenizer and ChatML
template. Baseline, as HF examples do it: `load_dataset("json")` then
`Dataset.map(lambda row: tokenizer.apply_chat_template(row["messages"], tokenize=True,
return_dict=True))`, row by row. lmforge: `prepare_sft_data` with a fresh cache (it also
validates every row, builds loss masks, counts duplicates and writes the cache). Each side
runs in its own child process; runs alternate.

    .venv/bin/python bench/sft_prepare.py [--rows 20000 --repeats 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from synthetic_chat import write_synthetic_chat


def run_lmforge(data: str, tokenizer_dir: str, cache: str, queue: mp.Queue) -> None:
    from transformers import AutoTokenizer

    from lmforge.config.schema import DataConfig, SourceConfig
    from lmforge.data.sft import prepare_sft_data

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = DataConfig(train=[SourceConfig(path=data)], max_length=4096)
    started, cpu = time.perf_counter(), _cpu_seconds()
    prepared = prepare_sft_data(
        cfg, tokenizer, seed=0, cache_dir=Path(cache), quarantine_path=Path(cache) / "bad"
    )
    seconds = time.perf_counter() - started
    queue.put(
        {
            "seconds": seconds,
            "cpu_seconds": _cpu_seconds() - cpu,
            "rows": len(prepared.train),
            "peak_rss_mib": _peak_rss_mib(),
        }
    )


def run_baseline(data: str, tokenizer_dir: str, cache: str, queue: mp.Queue) -> None:
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    started, cpu = time.perf_counter(), _cpu_seconds()
    dataset = load_dataset("json", data_files=data, split="train", cache_dir=cache)
    tokenized = dataset.map(
        lambda row: tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True),
        remove_columns=["messages"],
    )
    seconds = time.perf_counter() - started
    queue.put(
        {
            "seconds": seconds,
            "cpu_seconds": _cpu_seconds() - cpu,
            "rows": len(tokenized),
            "peak_rss_mib": _peak_rss_mib(),
        }
    )


def _cpu_seconds() -> float:
    """CPU time of this process, its threads and its finished children (the tokenize workers):
    unlike wall time it barely moves when other jobs share the machine."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(target, *args: str) -> dict:  # type: ignore[no-untyped-def]
    queue: mp.Queue = mp.get_context("spawn").Queue()
    process = mp.get_context("spawn").Process(target=target, args=(*args, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--template",
        choices=["chatml", "qwen2", "llama3"],
        default="chatml",
        help="Chat template stored with the tokenizer both sides use (chatml has a direct renderer; "
        "the others are rendered by Jinja).",
    )
    opts = parser.parse_args()
    from lmforge.config.schema import TokenizerTrainConfig
    from lmforge.data.chat_templates import BUILTIN_TEMPLATES, ensure_template_tokens
    from lmforge.data.tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        data = out / "chat.jsonl"
        write_synthetic_chat(
            data, opts.rows, answer_words=(3.5, 0.8), max_answer_words=400, max_turns=3, system_share=0.5
        )
        tokenizer = train_tokenizer(
            data.read_text().splitlines()[:2000], TokenizerTrainConfig(vocab_size=2048)
        )
        ensure_template_tokens(tokenizer, opts.template)
        tokenizer.chat_template = BUILTIN_TEMPLATES[opts.template]
        tokenizer.save_pretrained(out / "tok")
        runs: dict[str, list[dict]] = {"baseline": [], "lmforge": []}
        for repeat in range(opts.repeats):
            runs["baseline"].append(
                measure(run_baseline, str(data), str(out / "tok"), str(out / f"hf{repeat}"))
            )
            runs["lmforge"].append(
                measure(run_lmforge, str(data), str(out / "tok"), str(out / f"lm{repeat}"))
            )
    for side, results in runs.items():
        rates = [r["rows"] / r["seconds"] for r in results]
        cpu = [1e6 * r["cpu_seconds"] / r["rows"] for r in results]
        print(
            f"{side:9s}: {statistics.median(rates):,.0f} rows/s  runs={[round(r) for r in rates]}  "
            f"CPU {statistics.median(cpu):,.0f} us/row  runs={[round(c) for c in cpu]}  "
            f"peak RSS {max(r['peak_rss_mib'] for r in results):.0f} MiB  rows={results[0]['rows']}"
        )
    ratio = statistics.median(r["rows"] / r["seconds"] for r in runs["lmforge"]) / statistics.median(
        r["rows"] / r["seconds"] for r in runs["baseline"]
    )
    print(f"ratio lmforge / datasets.map: {ratio:.2f}x (goal >= 2x)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
