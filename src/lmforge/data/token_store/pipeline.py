"""The token store's datatrove pipeline: one step that tokenizes a task's input files into shards.

What a task needs travels as files inside the store, not as pickled objects: `plan.json` (the
input files in order, with their sources' settings), `encoder.json` (the run tokenizer's Rust
backend, truncation and padding off, with its sha256 in the plan) and `tokenizer/` (the run's
tokenizer, saved with save_pretrained, which a tokenizer without a Rust backend is loaded from).
The step itself holds only the store's path, so what datatrove pickles for its workers (dill, for
Slurm and local pools alike) is a string. A task imports neither torch nor transformers (a slow
tokenizer aside): a pool of tasks starts in about a second.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.utils.logging import logger
from tokenizers import Tokenizer

from lmforge.config.schema import SourceConfig
from lmforge.data.encoding import BatchEncoder, encode_documents, join_with_eos, rust_encoder
from lmforge.data.sources import documents_of_file, is_empty_document
from lmforge.data.stats import LengthHistogram
from lmforge.data.token_store.shards import ShardInfo, ShardWriter, read_sidecar, shard_stem
from lmforge.errors import UserInputError

PLAN_FILE = "plan.json"
ENCODER_FILE = "encoder.json"
TOKENIZER_DIR = "tokenizer"
# Characters per tokenizer call, as the cached path: large batches keep the Rust backend busy.
_BATCH_CHARS = 2_000_000
_IN_FLIGHT = 2  # batches being encoded while the next is read; memory grows with it


@dataclass(frozen=True)
class InputFile:
    """One input file of the store, in the order the cached path reads it."""

    split: str
    source: int  # index in data.<split>
    number: int  # position among its source's files
    path: str
    size: int
    mtime_ns: int
    source_settings: str  # the SourceConfig as JSON: how its documents are read (split, text_field)


@dataclass(frozen=True)
class Plan:
    """What every task reads from `<store>/plan.json`."""

    files: list[InputFile]
    tokenizer_fingerprint: str
    eos_id: int
    encoder_sha256: str | None  # None: the tokenizer has no Rust backend (tasks load tokenizer/)


def write_plan(
    store: Path, files: list[InputFile], tokenizer_fp: str, eos_id: int, encoder: str | None
) -> None:
    """`<store>/plan.json` (and `encoder.json` when the tokenizer has a Rust backend, its JSON):
    what every task reads to find its files and encode them."""
    encoder_sha256 = None
    if encoder is not None:
        temporary = store / (ENCODER_FILE + ".tmp")
        temporary.write_text(encoder, encoding="utf-8")
        temporary.replace(store / ENCODER_FILE)
        encoder_sha256 = hashlib.sha256(encoder.encode()).hexdigest()
    plan = {
        "tokenizer_fingerprint": tokenizer_fp,
        "eos_id": eos_id,
        "encoder_sha256": encoder_sha256,
        "files": [asdict(f) for f in files],
    }
    (store / PLAN_FILE).write_text(json.dumps(plan, indent=1), encoding="utf-8")


def read_plan(store: Path) -> Plan:
    """The plan `write_plan` wrote."""
    plan = json.loads((store / PLAN_FILE).read_text(encoding="utf-8"))
    files = [InputFile(**f) for f in plan["files"]]
    return Plan(files, plan["tokenizer_fingerprint"], int(plan["eos_id"]), plan.get("encoder_sha256"))


def task_encoder(store: Path, plan: Plan) -> BatchEncoder:
    """The run's tokenizer as a task encodes with it: the Rust backend from encoder.json, checked
    against the plan's sha256 (no transformers import), else the saved tokenizer through transformers."""
    stale = "Fix: delete the store directory and run lmforge prepare again."
    if plan.encoder_sha256 is not None:
        text = (store / ENCODER_FILE).read_text(encoding="utf-8")
        if hashlib.sha256(text.encode()).hexdigest() != plan.encoder_sha256:
            raise UserInputError(
                f"{store / ENCODER_FILE} is not the encoder its plan was written with. {stale}"
            )
        return rust_encoder(Tokenizer.from_str(text))
    from transformers import AutoTokenizer

    from lmforge.data.tokenizer import batch_encoder, tokenizer_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(str(store / TOKENIZER_DIR), local_files_only=True)
    if tokenizer_fingerprint(tokenizer) != plan.tokenizer_fingerprint:
        raise UserInputError(
            f"{store / TOKENIZER_DIR}: the saved tokenizer does not reload as the run's tokenizer. {stale}"
        )
    return batch_encoder(tokenizer)


def files_of_task(files: list[InputFile], rank: int, tasks: int) -> list[InputFile]:
    """The files task `rank` tokenizes: dealt round-robin, like datatrove's readers (`get_shard`)."""
    return files[rank::tasks]


class TokenizeShards(PipelineStep):
    """Tokenizes this task's input files, one shard per file; a shard already complete for the
    same input (a task killed after it) is kept."""

    name = "lmforge token store"
    type = "Tokenizer"

    def __init__(self, store: str) -> None:
        super().__init__()
        self.store = store

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        store = Path(self.store)
        plan = read_plan(store)
        fingerprint, eos_id = plan.tokenizer_fingerprint, plan.eos_id
        encode = task_encoder(store, plan)
        for item in files_of_task(plan.files, rank, world_size):
            stem = shard_stem(store, item.split, item.source, item.number)
            done = read_sidecar(stem)
            if done is not None and _same_input(done, item, fingerprint):
                logger.info(f"kept {stem.name}: already tokenized")
                continue
            info = _tokenize_file(item, stem, encode, eos_id, fingerprint)
            self.stat_update("documents", value=info.documents)
            self.stat_update("tokens", value=info.tokens, unit="file")
            logger.info(f"{item.path}: {info.documents} documents, {info.tokens} tokens -> {stem}")
        return iter(())


def _same_input(done: ShardInfo, item: InputFile, fingerprint: str) -> bool:
    return (done.input_path, done.input_size, done.input_mtime_ns, done.tokenizer_fingerprint) == (
        item.path,
        item.size,
        item.mtime_ns,
        fingerprint,
    )


def _tokenize_file(item: InputFile, stem: Path, encode: Any, eos_id: int, fingerprint: str) -> ShardInfo:
    source = SourceConfig.model_validate_json(item.source_settings)
    path = Path(item.path)
    counts = {"documents": 0, "empty": 0}
    histogram = LengthHistogram()
    writer = ShardWriter(stem)
    try:
        for flat, lengths in _encoded(encode, _batches(documents_of_file(path, source), counts)):
            writer.append(join_with_eos(flat, lengths, eos_id), np.cumsum(lengths + 1))
            histogram.add(lengths)
    except BaseException:
        writer.abandon()
        raise
    stat = path.stat()
    info = ShardInfo(
        source=item.source,
        split=item.split,
        input_path=item.path,
        input_size=stat.st_size,
        input_mtime_ns=stat.st_mtime_ns,
        input_sha256=_sha256(path),
        tokenizer_fingerprint=fingerprint,
        documents=counts["documents"],
        empty_documents_skipped=counts["empty"],
        tokens=writer.tokens,
        length_histogram=histogram.to_json(),
    )
    writer.commit(info)
    return info


def _batches(documents: Iterator[str], counts: dict[str, int]) -> Iterator[list[str]]:
    """Non-empty documents in batches of about _BATCH_CHARS characters; empty ones counted."""
    batch: list[str] = []
    chars = 0
    for text in documents:
        if is_empty_document(text):
            counts["empty"] += 1
            continue
        counts["documents"] += 1
        batch.append(text)
        chars += len(text)
        if chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encoded(encode: Any, batches: Iterator[list[str]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(flat ids, lengths) per batch, in order. As in the cached path, two batches are encoded at
    once (the Rust backend releases the GIL) while the next one is read, so its cores stay busy
    at batch ends."""
    pending: deque[Future[tuple[np.ndarray, np.ndarray]]] = deque()
    with ThreadPoolExecutor(max_workers=2) as pool:
        for batch in batches:
            pending.append(pool.submit(encode_documents, encode, batch))
            if len(pending) > _IN_FLIGHT:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
