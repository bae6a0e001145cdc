"""The data report of a stream, built from the readers' saved states as the data is used.

Every reader (rank x dataloader worker) counts what it used in its state; merging the states of
all readers gives the report of everything trained on so far. The top-level keys are the cached
report's where they apply, plus "streaming": true and "mix" (the achieved tokens per source).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from lmforge.data.stats import LengthHistogram


def stream_report(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The data report of a text or chat stream from the states of all its readers (one per rank
    and dataloader worker, as `TextStream.state_dict` / `ChatStream.state_dict` give them)."""
    if not states:
        raise ValueError("a stream report needs the state of at least one reader")
    if states[0]["kind"] == "chat-stream":
        return _chat_report(states)
    first = states[0]
    block_length = int(first["block_length"])
    sources = [_merged_source(index, states) for index in range(len(first["sources"]))]
    histogram = LengthHistogram()
    for state in states:
        for source in state["sources"]:
            counts = source["counters"]["length_counts"]
            histogram.counts[: len(counts)] += np.asarray(counts, dtype=np.int64)
    documents = sum(source["documents"] for source in sources)
    blocks = sum(source["blocks"] for source in sources)
    mix_total = max(blocks * block_length, 1)
    train = {
        "sources": sources,
        "documents": documents,
        "empty_documents_skipped": sum(source["empty_documents_skipped"] for source in sources),
        "tokens": sum(source["tokens"] for source in sources),
        "eos_tokens": documents,
        "blocks": blocks,
        "length_histogram": histogram.to_json(),  # lengths of the documents used up, in tokens
    }
    return {
        "block_length": block_length,
        "eos_token_id": first["eos_token_id"],
        "train": train,
        "eval": None,
        "eval_from": "none",
        "train_blocks": blocks,
        "eval_blocks": 0,
        "streaming": True,
        "readers": len(states),
        "mix": [
            {
                "path": source["path"],
                "weight": source["weight"],
                "tokens": source["blocks"] * block_length,
                "share": source["blocks"] * block_length / mix_total,
            }
            for source in sources
        ],
    }


def _merged_source(index: int, states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One source's counts summed over the readers; its epochs are the fewest any reader completed
    (every document was used at least that often) and the most."""
    parts = [state["sources"][index] for state in states]
    counters = [part["counters"] for part in parts]
    return {
        "path": parts[0]["path"],
        "weight": states[0]["weights"][index],
        "files": parts[0]["files"],
        "documents": sum(c["documents"] for c in counters),
        "empty_documents_skipped": sum(c["empty_documents_skipped"] for c in counters),
        "tokens": sum(c["tokens"] for c in counters),
        "blocks": sum(c["blocks"] for c in counters),
        "epochs": min(part["epochs"] for part in parts),
        "epochs_max": max(part["epochs"] for part in parts),
    }


def reader_states(loader_state: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream states of every reader in a `StatefulDataLoader.state_dict()`: the dataset's
    own without workers, else each worker's (in worker order)."""
    if "dataset_state" in loader_state:
        return [loader_state["dataset_state"]]
    workers = loader_state["_snapshot"]["_worker_snapshots"]
    return [workers[name]["dataset_state"] for name in sorted(workers, key=lambda n: int(n.split("_")[-1]))]


def _chat_report(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The cached SFT report's keys that a stream can know as it goes (no duplicate counts, no
    packing statistics over the whole set), summed over the readers: what each has read, which for a
    packed stream is ahead of its resume position by the rows of its packing buffer."""
    states = [{**state, **state.get("read", {})} for state in states]
    first = states[0]
    bad: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    histogram = LengthHistogram()
    for state in states:
        bad.update(state["rows"]["bad_by_reason"])
        dropped.update(state["dropped"])
        counts = state["length_counts"]
        histogram.counts[: len(counts)] += np.asarray(counts, dtype=np.int64)
    sources = []
    for index, source in enumerate(first["sources"]):
        parts = [state["sources"][index] for state in states]
        sources.append(
            {
                "path": source["path"],
                "weight": first["weights"][index],
                "samples": sum(p["samples"] for p in parts),
                "tokens": sum(p["tokens"] for p in parts),
                "supervised_tokens": sum(p["supervised_tokens"] for p in parts),
                "epochs": min(p["epochs"] for p in parts),
                "epochs_max": max(p["epochs"] for p in parts),
            }
        )
    tokens = sum(source["tokens"] for source in sources)
    return {
        "rows": {
            "rows_read": sum(state["rows"]["rows_read"] for state in states),
            "rows_kept": sum(state["rows"]["rows_kept"] for state in states),
            "rows_bad": sum(bad.values()),
            "bad_by_reason": dict(bad.most_common()),
        },
        "dropped": dict(dropped),
        "truncated": {"train": sum(state["truncated"] for state in states)},
        "train": {
            "samples": sum(source["samples"] for source in sources),
            "tokens": tokens,
            "supervised_tokens": sum(source["supervised_tokens"] for source in sources),
            "length_histogram": histogram.to_json(),
            "sources": sources,
        },
        "eval": {"samples": 0},
        "chat_template": first["chat_template"],
        "train_on": first["train_on"],
        "packing": first["packing"],
        "streaming": True,
        "readers": len(states),
        "mix": [
            {
                "path": s["path"],
                "weight": s["weight"],
                "tokens": s["tokens"],
                "share": s["tokens"] / max(tokens, 1),
            }
            for s in sources
        ],
    }
