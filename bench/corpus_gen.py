"""Write a pretraining corpus of a given size as JSONL shards, for the data-at-scale benchmarks.

Documents are built from the built-in Python-stdlib corpus: each is a random run of 5 to 40
paragraphs of it, so the text tokenizes like real code and prose, and no two documents are
alike. Deterministic from `--seed`; about 150 MB/s on one core (writing is the cost).

    .venv/bin/python bench/corpus_gen.py --gb 10 --shards 64 --out /tmp/corpus-10g
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from lmforge.data.corpus import builtin_files

_PARAGRAPH = re.compile(r"\n\s*\n")


def paragraphs() -> list[str]:
    """Every non-empty paragraph of the built-in corpus's modules."""
    found: list[str] = []
    for file in builtin_files("builtin:python-stdlib"):
        found.extend(p for p in _PARAGRAPH.split(file.read_text(encoding="utf-8")) if p.strip())
    return found


def write_corpus(out: Path, total_bytes: int, shards: int, seed: int) -> dict[str, int]:
    """Shards `out/part-NNNNN.jsonl` of {"text": ...} rows, `total_bytes` in all."""
    out.mkdir(parents=True, exist_ok=True)
    pool = paragraphs()
    rng = np.random.default_rng(seed)
    per_shard = total_bytes // shards
    documents = 0
    for shard in range(shards):
        written = 0
        with (out / f"part-{shard:05d}.jsonl").open("w", encoding="utf-8") as handle:
            while written < per_shard:
                start = int(rng.integers(0, len(pool)))
                count = int(rng.integers(5, 41))
                text = "\n\n".join(pool[(start + i) % len(pool)] for i in range(count))
                line = json.dumps({"text": text}) + "\n"
                handle.write(line)
                written += len(line)
                documents += 1
    return {
        "bytes": sum(f.stat().st_size for f in out.glob("*.jsonl")),
        "documents": documents,
        "shards": shards,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, required=True, help="corpus size in GB (1e9 bytes)")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(json.dumps(write_corpus(args.out, int(args.gb * 1e9), args.shards, args.seed)))


if __name__ == "__main__":
    main()
