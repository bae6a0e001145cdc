"""Streaming sources: the cache's blocks, disjoint and complete parts per rank and worker, the
mixture, exact resume through torchdata's StatefulDataLoader, the report, and bad input."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import PreTrainedTokenizerFast

from lmforge.config.schema import DataConfig, SourceConfig, TokenizerTrainConfig
from lmforge.data.collate import PackedCollator, PaddedCollator
from lmforge.data.sft import prepare_sft_data
from lmforge.data.streaming import ChatStream, TextStream, reader_states, stream_report
from lmforge.data.streaming.chat_stream import PACK_BUFFER
from lmforge.data.streaming.inputs import LocalInput
from lmforge.data.streaming.parts import StreamPart
from lmforge.data.text import prepare_pretraining_data
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import DataSourceLost, UserInputError
from tests.conftest import word_documents, write_jsonl

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "café", "日本", "🚀"]
BLOCK = 32


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer(make_documents(200, seed=1), TokenizerTrainConfig(vocab_size=300, min_frequency=1))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight shards of 40 documents (one empty document in shard 3), and a small second source."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "big").mkdir()
    for shard in range(8):
        documents = make_documents(40, seed=10 + shard)
        if shard == 3:
            documents[5] = "  "
        write_jsonl(root / "big" / f"shard-{shard}.jsonl", documents)
    write_jsonl(root / "small.jsonl", make_documents(30, seed=99))
    return root


def blocks_of(stream: TextStream, count: int) -> list[dict[str, torch.Tensor]]:
    return list(itertools.islice(iter(stream), count))


def test_one_source_gives_the_caches_blocks_in_order(
    tokenizer: PreTrainedTokenizerFast, corpus: Path, tmp_path: Path
) -> None:
    source = SourceConfig(path=str(corpus / "big" / "*.jsonl"))
    cached = prepare_pretraining_data(
        DataConfig(train=[source], max_length=BLOCK), tokenizer, seed=0, cache_dir=tmp_path
    ).train_blocks
    stream = TextStream([source], tokenizer, max_length=BLOCK, seed=0)
    samples = blocks_of(stream, len(cached) + 3)
    streamed = np.stack([s["input_ids"].numpy() for s in samples[: len(cached)]])
    assert np.array_equal(streamed, cached)
    assert samples[0]["input_ids"].dtype == torch.int64 and torch.equal(
        samples[0]["labels"], samples[0]["input_ids"]
    )
    assert set(samples[0]) == {"input_ids", "labels", "mix_source"} and int(samples[0]["mix_source"]) == 0
    # max_documents counts documents in reading order, as the cache does.
    capped = source.model_copy(update={"max_documents": 50})
    cached_capped = prepare_pretraining_data(
        DataConfig(train=[capped], max_length=BLOCK), tokenizer, seed=0, cache_dir=tmp_path
    ).train_blocks
    streamed_capped = blocks_of(TextStream([capped], tokenizer, max_length=BLOCK, seed=0), len(cached_capped))
    assert np.array_equal(np.stack([s["input_ids"].numpy() for s in streamed_capped]), cached_capped)
    # The stream goes on past the end of the data: its next epoch starts over, remainder carried.
    assert stream.state_dict()["sources"][0]["epochs"] == 1
    used = stream_report([stream.state_dict()])["train"]["sources"][0]
    assert used["documents"] >= 320 - 1 and used["empty_documents_skipped"] == 1  # epoch 0 used up


def test_remote_files_by_url_stream_the_same_blocks_as_the_local_path(
    tokenizer: PreTrainedTokenizerFast, corpus: Path, tmp_path: Path
) -> None:
    """A URL source is streamed by `datasets` over fsspec (s3://, gs://, https://); file:// is
    the one that needs no network, and must give what the local path gives."""
    local = TextStream(
        [SourceConfig(path=str(corpus / "big" / "*.jsonl"))], tokenizer, max_length=BLOCK, seed=0
    )
    remote_source = SourceConfig(path=f"file://{corpus / 'big'}/*.jsonl")
    remote = TextStream([remote_source], tokenizer, max_length=BLOCK, seed=0)
    expected, got = blocks_of(local, 40), blocks_of(remote, 40)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(expected, got, strict=True))
    with pytest.raises(UserInputError, match=r"remote files are read by their suffix.*\.jsonl"):
        TextStream([SourceConfig(path="file:///data/corpus.bin")], tokenizer, max_length=BLOCK, seed=0)
    with pytest.raises(UserInputError, match=r"could not stream these remote files.*s3fs"):
        TextStream(
            [SourceConfig(path="s3://no-such-bucket/corpus/*.jsonl")], tokenizer, max_length=BLOCK, seed=0
        )


@pytest.mark.parametrize("shards", ["*.jsonl", "shard-[01].jsonl"])
def test_parts_of_two_ranks_by_two_workers_read_each_document_once(corpus: Path, shards: str) -> None:
    """Eight files: whole files dealt to the 4 parts; two files: every 4th document each."""
    reader = LocalInput(SourceConfig(path=str(corpus / "big" / shards)), "data.train.0.path")
    in_order = [json.loads(line)["text"] for file in reader.paths for line in file.read_text().splitlines()]
    seen: list[str] = []
    for rank, worker in itertools.product(range(2), range(2)):
        documents = reader.documents(StreamPart(rank, 2, worker, 2), None)
        mine = [text for start, _, text in itertools.takewhile(lambda d: d[0]["epoch"] == 0, documents)]
        assert mine
        seen += mine
    assert sorted(seen) == sorted(in_order)


def loader(stream: TextStream, workers: int) -> StatefulDataLoader:
    return StatefulDataLoader(stream, batch_size=2, num_workers=workers)


def test_resume_continues_at_the_same_block_with_and_without_workers(
    tokenizer: PreTrainedTokenizerFast, corpus: Path
) -> None:
    sources = [
        SourceConfig(path=str(corpus / "big" / "shard-[0-5].jsonl")),
        SourceConfig(path=str(corpus / "small.jsonl"), weight=3.0),
    ]

    def stream() -> TextStream:
        return TextStream(sources, tokenizer, max_length=BLOCK, seed=0)

    for workers in (0, 2):
        whole = [batch["input_ids"] for batch in itertools.islice(loader(stream(), workers), 40)]
        first = loader(stream(), workers)
        head = [batch["input_ids"] for batch in itertools.islice(first, 17)]
        saved = json.loads(json.dumps(first.state_dict()))  # it is JSON: no tensors, no pickle
        resumed = loader(stream(), workers)
        resumed.load_state_dict(saved)
        tail = [batch["input_ids"] for batch in itertools.islice(resumed, 40 - 17)]
        assert all(torch.equal(a, b) for a, b in zip(whole, head + tail, strict=True)), workers
    # The lead's loader refuses the mismatch itself; the stream's own check says why.
    with pytest.raises(ValueError, match="saved with workers=2, this run has workers=1"):
        stream().load_state_dict(reader_states(saved)[0])


def test_mixture_follows_weights_and_budgets_and_the_report_counts_what_was_used(
    tokenizer: PreTrainedTokenizerFast, corpus: Path
) -> None:
    big = SourceConfig(path=str(corpus / "big"))
    small = SourceConfig(path=str(corpus / "small.jsonl"), weight=4.0, max_tokens=BLOCK * 60)
    stream = TextStream([big, small], tokenizer, max_length=BLOCK, seed=0)
    samples = blocks_of(stream, 300)
    sources = np.array([int(s["mix_source"]) for s in samples])
    small_bytes, big_bytes = stream.inputs[1].size_in_bytes, stream.inputs[0].size_in_bytes
    expected_small = 4 * small_bytes / (4 * small_bytes + big_bytes)
    assert abs((sources[:100] == 1).mean() - expected_small) < 0.02  # dealt by share, block by block
    assert (sources == 1).sum() == 60  # then the budget stops it
    report = stream_report([stream.state_dict()])
    assert report["streaming"] and report["train_blocks"] == 300 and report["eval_blocks"] == 0
    assert [m["tokens"] for m in report["mix"]] == [240 * BLOCK, 60 * BLOCK]
    small_report = report["train"]["sources"][1]
    assert small_report["epochs"] >= 1  # upsampled 4x: it was read more than once
    big_report = report["train"]["sources"][0]
    assert big_report["empty_documents_skipped"] == 1 and big_report["files"] == 8
    used = report["train"]["tokens"] + report["train"]["documents"]
    assert used <= 300 * BLOCK < used + 2 * 400  # the used-up documents; partly used ones not yet
    assert sum(report["train"]["length_histogram"]["counts"]) == report["train"]["documents"]


def test_every_source_with_a_budget_ends_the_stream(tokenizer: PreTrainedTokenizerFast, corpus: Path) -> None:
    source = SourceConfig(path=str(corpus / "small.jsonl"), max_tokens=BLOCK * 5 + 3)
    assert len(list(TextStream([source], tokenizer, max_length=BLOCK, seed=0))) == 5
    # Two ranks share the budget: together they deal it once.
    parts = [TextStream([source], tokenizer, max_length=BLOCK, seed=0, rank=r, world_size=2) for r in (0, 1)]
    assert [len(list(p)) for p in parts] == [3, 2]


def test_bad_sources_are_refused_when_the_stream_is_built(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(UserInputError, match=r"data.train.0.path.*no files found.*Fix"):
        TextStream([SourceConfig(path=str(tmp_path / "*.jsonl"))], tokenizer, max_length=BLOCK, seed=0)
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserInputError, match="could not stream it from the Hugging Face hub.*hf download"):
        TextStream(
            [SourceConfig(path="hf://lmforge-test/no-such-dataset")], tokenizer, max_length=BLOCK, seed=0
        )


def test_a_file_lost_mid_stream_raises_data_source_lost(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    for shard in range(2):
        write_jsonl(tmp_path / f"shard-{shard}.jsonl", make_documents(200, seed=shard))
    stream = iter(
        TextStream([SourceConfig(path=str(tmp_path / "*.jsonl"))], tokenizer, max_length=BLOCK, seed=0)
    )
    next(stream)
    (tmp_path / "shard-1.jsonl").unlink()
    with pytest.raises(DataSourceLost, match="shard-1.jsonl disappeared"):
        for _ in range(10_000):
            next(stream)


CHAT = Path(__file__).resolve().parents[1] / "examples" / "data" / "chat_messages.jsonl"


@pytest.fixture(scope="module")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer(
        CHAT.read_text().splitlines(), TokenizerTrainConfig(vocab_size=400, min_frequency=1)
    )


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """150 conversations of the example set with 2 malformed rows among them."""
    lines = CHAT.read_text().splitlines()[:150]
    lines[40:40] = ['{"messages": [broken']
    lines[120:120] = ["not json at all"]
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def chat_config(chat_file: Path, **settings: object) -> DataConfig:
    return DataConfig(
        train=[SourceConfig(path=str(chat_file), weight=1.5)],
        max_length=48,
        over_length="drop",
        on_bad_row="skip",
        max_bad_fraction=0.05,
        **settings,  # type: ignore[arg-type]
    )


def test_chat_stream_gives_the_cached_samples_and_counts(
    chat_tokenizer: PreTrainedTokenizerFast, chat_file: Path, tmp_path: Path
) -> None:
    cfg = chat_config(chat_file)
    cached = prepare_sft_data(
        cfg,
        chat_tokenizer,
        seed=0,
        cache_dir=tmp_path / "cache",
        quarantine_path=tmp_path / "cached_bad.jsonl",
    )
    stream = ChatStream(cfg, chat_tokenizer, seed=0, quarantine_path=tmp_path / "bad.jsonl")
    samples = list(itertools.islice(iter(stream), len(cached.train)))
    for index, sample in enumerate(samples):
        expected = cached.train.sample(index)
        assert sample == {"input_ids": expected["input_ids"].tolist(), "labels": expected["labels"].tolist()}
    report = stream_report([stream.state_dict()])
    assert report["streaming"] and report["train"]["samples"] == len(cached.train)
    assert report["rows"]["bad_by_reason"] == cached.report["rows"]["bad_by_reason"] == {"malformed JSON": 2}
    assert report["dropped"] == cached.report["dropped"] and report["dropped"]
    assert len((tmp_path / "bad.jsonl").read_text().splitlines()) == 2


def test_a_packed_chat_stream_reports_the_rows_it_has_read(
    chat_tokenizer: PreTrainedTokenizerFast, chat_file: Path, tmp_path: Path
) -> None:
    """Packing reads a buffer of PACK_BUFFER samples before its first row: the report counts them
    at once (its resume position stays at the buffer's start, which the resume test covers)."""
    stream = ChatStream(
        chat_config(chat_file, packing=True), chat_tokenizer, seed=0, quarantine_path=tmp_path / "b"
    )
    rows = iter(stream)
    assert stream_report([stream.state_dict()])["train"]["samples"] == 0
    next(rows)
    report = stream_report([stream.state_dict()])
    assert report["train"]["samples"] == PACK_BUFFER
    assert report["rows"]["rows_read"] >= PACK_BUFFER and report["train"]["tokens"] > 0


@pytest.mark.parametrize("packing", [False, True])
def test_chat_stream_resumes_exactly(
    chat_tokenizer: PreTrainedTokenizerFast, chat_file: Path, tmp_path: Path, packing: bool
) -> None:
    cfg = chat_config(chat_file, packing=packing)

    def chat_loader(workers: int) -> StatefulDataLoader:
        stream = ChatStream(cfg, chat_tokenizer, seed=0, quarantine_path=tmp_path / "bad.jsonl")
        return StatefulDataLoader(stream, batch_size=2, num_workers=workers, collate_fn=list)

    for workers in (0, 2):
        whole = list(itertools.islice(chat_loader(workers), 60))
        first = chat_loader(workers)
        head = list(itertools.islice(first, 23))
        saved = json.loads(json.dumps(first.state_dict()))
        resumed = chat_loader(workers)
        resumed.load_state_dict(saved)
        assert head + list(itertools.islice(resumed, 60 - 23)) == whole, workers
    # The cached path's collators take the stream's samples and rows unchanged.
    pad = chat_tokenizer.pad_token_id
    batch = (PackedCollator(pad) if packing else PaddedCollator(pad))(whole[0])
    assert batch["input_ids"].shape[0] == 2 and batch["labels"].shape == batch["input_ids"].shape
    if packing:  # rows as PackedDataset gives them: a list of samples, all within max_length
        assert all(sum(map(len, row["input_ids"])) <= cfg.max_length for batch in whole for row in batch)


def test_chat_stream_stops_when_too_many_rows_are_bad(
    chat_tokenizer: PreTrainedTokenizerFast, chat_file: Path, tmp_path: Path
) -> None:
    cfg = chat_config(chat_file).model_copy(update={"max_bad_fraction": 0.01})
    stream = ChatStream(cfg, chat_tokenizer, seed=0, quarantine_path=tmp_path / "bad.jsonl")
    with pytest.raises(UserInputError, match=r"2 of 1\d\d rows are bad.*max_bad_fraction=0.01"):
        list(itertools.islice(iter(stream), 1000))


def test_hub_source_is_split_by_node_and_resumes_from_its_state(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub dataset stands in as a local `datasets` streaming dataset (no network in tests)."""
    from datasets import load_dataset

    from lmforge.data.streaming import inputs

    files = sorted(str(path) for path in (corpus / "big").glob("*.jsonl"))
    monkeypatch.setattr(
        inputs,
        "open_remote_dataset",
        lambda path: load_dataset("json", data_files=files, split="train", streaming=True),
    )
    reader = inputs.HubInput(SourceConfig(path="hf://owner/corpus"), "data.train.0.path")
    halves = []
    for rank in range(2):
        documents = reader.documents(StreamPart(rank, 2, 0, 1), None)
        halves.append(list(itertools.takewhile(lambda d: d[0]["epoch"] == 0, documents)))
    in_order = [json.loads(line)["text"] for file in files for line in Path(file).read_text().splitlines()]
    assert sorted(text for half in halves for _, _, text in half) == sorted(in_order)
    saved = json.loads(json.dumps(halves[1][7][0]))  # the position before its 8th document, as JSON
    resumed = reader.documents(StreamPart(1, 2, 0, 1), saved)
    assert [text for _, _, text in itertools.islice(resumed, 3)] == [text for _, _, text in halves[1][7:10]]


def make_documents(count: int, seed: int) -> list[str]:
    return word_documents(WORDS, count, seed, max_words=60)
