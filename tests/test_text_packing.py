"""Pretraining data prep: documents in order with EOS, no lost tokens, caching, eval split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from lmforge.config.schema import DataConfig, SourceConfig, TokenizerTrainConfig
from lmforge.data import cache as data_cache
from lmforge.data import text
from lmforge.data.text import BlockDataset, prepare_pretraining_data
from lmforge.data.tokenizer import load_tokenizer, train_tokenizer
from lmforge.errors import UserInputError

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "café",
    "日本",
    "🚀",
]


def make_documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) + "\n" for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer(make_documents(300, seed=1), TokenizerTrainConfig(vocab_size=320, min_frequency=1))


def write_jsonl(path: Path, documents: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    return path


def reference_stream(tokenizer: PreTrainedTokenizerFast, documents: list[str]) -> np.ndarray:
    """Each document tokenized on its own by transformers' ordinary call, EOS after each."""
    ids: list[int] = []
    for document in documents:
        ids += tokenizer(document, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return np.array(ids, dtype=np.int32)


def prepare(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerFast, cache: Path, seed: int = 0
) -> text.PreparedText:
    return prepare_pretraining_data(cfg, tokenizer, seed=seed, cache_dir=cache)


@pytest.mark.parametrize(
    "batch_chars", [1_000_000, 50]
)  # one batch; many batches through the thread pipeline
def test_blocks_hold_every_document_in_order_with_eos(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch_chars: int
) -> None:
    monkeypatch.setattr(text, "_BATCH_CHARS", batch_chars)
    first, second = make_documents(40, seed=2), make_documents(25, seed=3)
    (tmp_path / "b.txt").write_text("\n\n".join(d.strip() for d in second), encoding="utf-8")
    cfg = DataConfig(
        train=[
            SourceConfig(path=str(write_jsonl(tmp_path / "a.jsonl", first))),
            SourceConfig(path=str(tmp_path / "b.txt"), split="paragraph"),
        ],
        max_length=16,
    )
    prepared = prepare(cfg, tokenizer, tmp_path / "cache")

    stream = reference_stream(tokenizer, first + [d.strip() for d in second])
    blocks = prepared.train_blocks
    assert blocks.dtype == np.int32 and blocks.shape == (len(stream) // 16, 16)
    np.testing.assert_array_equal(blocks.reshape(-1), stream[: blocks.size])
    report = prepared.report["train"]
    assert report["remainder_tokens_dropped"] == len(stream) - blocks.size < 16
    assert report["tokens"] + report["eos_tokens"] == len(stream)
    assert [s["documents"] for s in report["sources"]] == [40, 25]
    assert sum(s["tokens"] for s in report["sources"]) == report["tokens"]
    assert prepared.eval_blocks is None and prepared.report["eval_blocks"] == 0


def test_empty_documents_are_skipped_and_counted(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    documents = ["alpha beta", "", "   \n", "gamma delta"] * 10
    cfg = DataConfig(
        train=[SourceConfig(path=str(write_jsonl(tmp_path / "d.jsonl", documents)))], max_length=8
    )
    prepared = prepare(cfg, tokenizer, tmp_path / "cache")
    report = prepared.report["train"]
    assert (report["documents"], report["empty_documents_skipped"]) == (20, 20)
    stream = reference_stream(tokenizer, [d for d in documents if d.strip()])
    np.testing.assert_array_equal(prepared.train_blocks.reshape(-1), stream[: prepared.train_blocks.size])


def test_second_call_reuses_the_cache(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = DataConfig(
        train=[SourceConfig(path=str(write_jsonl(tmp_path / "d.jsonl", make_documents(50))))], max_length=8
    )
    first = prepare(cfg, tokenizer, tmp_path / "cache")
    assert not first.from_cache and first.cache_path == tmp_path / "cache" / first.fingerprint
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [first.fingerprint]  # no temp dirs left
    assert json.loads((first.cache_path / "meta.json").read_text())["report"] == first.report

    def no_tokenizing(*args: object) -> None:
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(text, "encode_documents", no_tokenizing)
    second = prepare(cfg, tokenizer, tmp_path / "cache")
    assert second.from_cache and second.fingerprint == first.fingerprint and second.report == first.report
    np.testing.assert_array_equal(second.train_blocks, first.train_blocks)
    assert isinstance(second.train_blocks, np.memmap)


def test_cache_is_invalidated_by_data_tokenizer_and_settings(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(50))
    cfg = DataConfig(train=[SourceConfig(path=str(data))], max_length=8)
    cache = tmp_path / "cache"
    base = prepare(cfg, tokenizer, cache)

    longer = prepare(cfg.model_copy(update={"max_length": 12}), tokenizer, cache)
    assert not longer.from_cache and longer.train_blocks.shape[1] == 12

    other_tokenizer = train_tokenizer(make_documents(300, seed=9), TokenizerTrainConfig(vocab_size=300))
    retokenized = prepare(cfg, other_tokenizer, cache)
    assert not retokenized.from_cache and retokenized.fingerprint != base.fingerprint

    write_jsonl(data, make_documents(50, seed=5))
    changed = prepare(cfg, tokenizer, cache)
    assert not changed.from_cache and changed.fingerprint not in {base.fingerprint, longer.fingerprint}
    assert len({base.fingerprint, longer.fingerprint, retokenized.fingerprint, changed.fingerprint}) == 4


def test_eval_fraction_holds_out_disjoint_seeded_blocks(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(120))
    all_blocks = prepare(
        DataConfig(train=[SourceConfig(path=str(data))], max_length=8), tokenizer, tmp_path / "c"
    )
    n = all_blocks.train_blocks.shape[0]
    cfg = DataConfig(train=[SourceConfig(path=str(data))], max_length=8, eval_fraction=0.1)
    split = prepare(cfg, tokenizer, tmp_path / "c", seed=7)

    n_eval = round(0.1 * n)
    assert split.eval_blocks is not None and split.eval_blocks.shape == (n_eval, 8)
    assert split.train_blocks.shape == (n - n_eval, 8)
    assert split.report["eval_from"] == "held_out_train_blocks" and split.report["eval_blocks"] == n_eval
    train_rows, eval_rows = text.split_holdout(n, 0.1, seed=7)
    assert not set(train_rows) & set(eval_rows) and len(train_rows) + len(eval_rows) == n
    np.testing.assert_array_equal(split.train_blocks, all_blocks.train_blocks[train_rows])  # order kept
    np.testing.assert_array_equal(split.eval_blocks, all_blocks.train_blocks[eval_rows])
    reseeded = prepare(cfg, tokenizer, tmp_path / "c", seed=8)
    assert reseeded.fingerprint != split.fingerprint
    assert not np.array_equal(reseeded.eval_blocks, split.eval_blocks)


def test_tiny_eval_fraction_still_holds_out_one_block(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(20))
    cfg = DataConfig(train=[SourceConfig(path=str(data))], max_length=8, eval_fraction=0.001)
    prepared = prepare(cfg, tokenizer, tmp_path / "cache")
    assert prepared.eval_blocks is not None and prepared.eval_blocks.shape[0] == 1


def test_eval_fraction_with_one_block_is_a_clear_error(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    document = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    assert 8 <= len(reference_stream(tokenizer, [document])) < 16  # exactly one block of 8
    data = write_jsonl(tmp_path / "d.jsonl", [document])
    cfg = DataConfig(train=[SourceConfig(path=str(data))], max_length=8, eval_fraction=0.2)
    with pytest.raises(UserInputError, match=r"only 1 block\(s\).*needs at least 2.*Fix"):
        prepare(cfg, tokenizer, tmp_path / "cache")


def test_eval_sources_are_packed_separately(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    train_docs, eval_docs = make_documents(30, seed=1), make_documents(10, seed=2)
    cfg = DataConfig(
        train=[SourceConfig(path=str(write_jsonl(tmp_path / "t.jsonl", train_docs)))],
        eval=[SourceConfig(path=str(write_jsonl(tmp_path / "e.jsonl", eval_docs)))],
        max_length=8,
        eval_fraction=0.5,  # ignored: eval sources win
    )
    prepared = prepare(cfg, tokenizer, tmp_path / "cache")
    stream = reference_stream(tokenizer, eval_docs)
    assert prepared.eval_blocks is not None and prepared.report["eval_from"] == "sources"
    np.testing.assert_array_equal(prepared.eval_blocks.reshape(-1), stream[: prepared.eval_blocks.size])
    assert prepared.train_blocks.shape[0] == len(reference_stream(tokenizer, train_docs)) // 8


def test_too_little_data_for_one_block_is_a_clear_error(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    cfg = DataConfig(train=[SourceConfig(path=str(write_jsonl(tmp_path / "d.jsonl", ["hi"])))], max_length=64)
    with pytest.raises(UserInputError, match=r"data.train: the data holds \d+ tokens.*max_length=64.*Fix"):
        prepare(cfg, tokenizer, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-written left behind


def test_crash_while_writing_leaves_no_cache(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = DataConfig(
        train=[SourceConfig(path=str(write_jsonl(tmp_path / "d.jsonl", make_documents(50))))], max_length=8
    )

    def crash(*args: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(data_cache, "_publish", crash)
        with pytest.raises(KeyboardInterrupt):
            prepare(cfg, tokenizer, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    assert not prepare(cfg, tokenizer, tmp_path / "cache").from_cache


def test_truncating_tokenizer_does_not_cut_documents(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    documents = make_documents(30)
    tokenizer.save_pretrained(tmp_path / "tok")
    truncating = load_tokenizer(str(tmp_path / "tok"))
    truncating.backend_tokenizer.enable_truncation(max_length=3)
    cfg = DataConfig(
        train=[SourceConfig(path=str(write_jsonl(tmp_path / "d.jsonl", documents)))], max_length=8
    )
    prepared = prepare(cfg, truncating, tmp_path / "cache")
    stream = reference_stream(tokenizer, documents)
    np.testing.assert_array_equal(prepared.train_blocks.reshape(-1), stream[: prepared.train_blocks.size])


def test_block_dataset_gives_long_tensors_with_labels(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    cfg = DataConfig(
        train=[SourceConfig(path=str(write_jsonl(tmp_path / "d.jsonl", make_documents(20))))], max_length=8
    )
    blocks = prepare(cfg, tokenizer, tmp_path / "cache").train_blocks
    dataset = BlockDataset(blocks)
    item = dataset[len(dataset) - 1]
    assert len(dataset) == blocks.shape[0] and set(item) == {"input_ids", "labels"}
    assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (8,)
    assert torch.equal(item["input_ids"], item["labels"])
    assert torch.equal(item["input_ids"], torch.from_numpy(np.asarray(blocks[-1], dtype=np.int64)))
