"""The sharded token store: built by datatrove tasks, the cached path's blocks, the mix, resumable
builds, refusals of a damaged store, the Slurm script of a dry run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from transformers import PreTrainedTokenizerFast

from lmforge.config.schema import DataConfig, SourceConfig, TokenizerTrainConfig, TokenStoreConfig
from lmforge.data.text import prepare_pretraining_data
from lmforge.data.token_store import dataset as token_store_dataset
from lmforge.data.token_store.build import build_token_store
from lmforge.data.token_store.manifest import is_complete
from lmforge.data.token_store.pipeline import ENCODER_FILE, read_plan, task_encoder
from lmforge.data.token_store.store import open_token_store
from lmforge.data.tokenizer import train_tokenizer
from lmforge.errors import DataSourceLost, UserInputError
from tests.conftest import word_documents, write_jsonl

WORDS = "alpha beta gamma delta epsilon café 日本 🚀 the cat sat on a mat".split()  # noqa: SIM905
SEED = 3


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer(documents(300, seed=1), TokenizerTrainConfig(vocab_size=320, min_frequency=1))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five input files of three formats (jsonl, json, txt by paragraph), one empty document."""
    root = tmp_path_factory.mktemp("store-corpus")
    for number in range(3):
        write_jsonl(
            root / f"part-{number}.jsonl", documents(60, seed=10 + number) + ([""] if number == 1 else [])
        )
    (root / "part-3.json").write_text(
        json.dumps([{"text": t} for t in documents(40, seed=20)]), encoding="utf-8"
    )
    (root / "part-4.txt").write_text("\n\n".join(documents(50, seed=21)), encoding="utf-8")
    return root


def store_config(corpus: Path, **store: Any) -> DataConfig:
    return DataConfig(
        train=[SourceConfig(path=str(corpus), split="paragraph")],
        max_length=32,
        eval_fraction=0.1,
        store=TokenStoreConfig(**{"tasks": 2, "workers": 1, **store}),
    )


@pytest.fixture(scope="module")
def built(corpus: Path, tokenizer: PreTrainedTokenizerFast, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The corpus's store, built by 2 tasks of datatrove's local executor, and opened."""
    cache_dir = tmp_path_factory.mktemp("store-cache")
    cfg = store_config(corpus, workers=2)  # a real process pool once: what users run
    path = build_token_store(cfg, tokenizer, seed=SEED, cache_dir=cache_dir)
    return cfg, cache_dir, path, open_token_store(cfg, tokenizer, seed=SEED, cache_dir=cache_dir)


def test_one_source_gives_the_caches_blocks(built: Any, tokenizer: PreTrainedTokenizerFast) -> None:
    """Same train blocks in the same order, same held-out eval blocks, same counts in the report."""
    cfg, cache_dir, _, store = built
    cache = prepare_pretraining_data(
        cfg.model_copy(update={"store": None}), tokenizer, seed=SEED, cache_dir=cache_dir
    )
    assert len(store.train) == len(cache.train_blocks) > 100
    assert store.eval is not None and cache.eval_blocks is not None
    assert len(store.eval) == len(cache.eval_blocks) > 5
    for dataset, blocks in ((store.train, cache.train_blocks), (store.eval, cache.eval_blocks)):
        for index in range(len(blocks)):
            assert np.array_equal(dataset[index]["input_ids"].numpy(), blocks[index]), index
    sample = store.train[0]
    assert set(sample) == {"input_ids", "labels", "mix_source"}
    assert (
        sample["input_ids"].dtype == sample["labels"].dtype == torch.int64 and int(sample["mix_source"]) == 0
    )
    for key in (
        "documents",
        "empty_documents_skipped",
        "tokens",
        "eos_tokens",
        "blocks",
        "remainder_tokens_dropped",
    ):
        assert store.report["train"][key] == cache.report["train"][key], key
    assert store.report["train"]["length_histogram"] == cache.report["train"]["length_histogram"]
    assert {k: store.report[k] for k in ("train_blocks", "eval_blocks", "eval_from")} == {
        k: cache.report[k] for k in ("train_blocks", "eval_blocks", "eval_from")
    }
    source = store.report["train"]["sources"][0]
    assert (source["shards"], source["epochs"], source["planned_blocks"]) == (5, 1.0, len(store.train))


def test_shards_keep_documents_and_their_inputs(
    built: Any, corpus: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    _, _, path, store = built
    manifest = json.loads((path / "manifest.json").read_text())
    assert (
        manifest["tokenizer_fingerprint"]
        == json.loads((path / "plan.json").read_text())["tokenizer_fingerprint"]
    )
    shards = manifest["splits"]["train"][0]["shards"]
    assert [Path(s["input_path"]).name for s in shards] == sorted(p.name for p in corpus.iterdir())
    for entry in shards:
        stem = path / entry["shard"]
        tokens = np.fromfile(stem.with_suffix(".tokens"), dtype="<i4")
        ends = np.fromfile(stem.with_suffix(".index"), dtype="<i8")
        assert len(tokens) == entry["tokens"] and len(ends) == entry["documents"] and ends[-1] == len(tokens)
        assert (tokens[ends - 1] == tokenizer.eos_token_id).all()  # every document ends with EOS
        assert entry["input_sha256"] == hashlib.sha256(Path(entry["input_path"]).read_bytes()).hexdigest()
    assert manifest["totals"]["documents"] == store.report["train"]["documents"] == 60 * 3 + 40 + 50
    assert store.report["train"]["empty_documents_skipped"] == 1
    assert "Processing done" in (path / "logs" / "logs" / "task_00000.log").read_text()  # datatrove's own log


def test_weights_and_budgets_mix_blocks(built: Any, corpus: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """Weight 2.5 takes the source twice in order then a seeded half; max_tokens caps a source;
    data.eval sources are their own split of the store, read whole and in order."""
    _, cache_dir, _, _ = built
    cfg = DataConfig(
        train=[
            SourceConfig(path=str(corpus / "part-0.jsonl"), weight=2.5),
            SourceConfig(path=str(corpus / "part-1.jsonl"), max_tokens=32 * 10),
        ],
        eval=[SourceConfig(path=str(corpus / "part-3.json"))],
        max_length=32,
        store=TokenStoreConfig(tasks=2, workers=1),
    )
    path = build_token_store(cfg, tokenizer, seed=SEED, cache_dir=cache_dir)
    store = open_token_store(cfg, tokenizer, seed=SEED, cache_dir=cache_dir)
    eval_tokens = np.fromfile(path / "eval/source-000/file-000000.tokens", dtype="<i4")
    assert store.report["eval_from"] == "sources" and store.eval is not None
    assert len(store.eval) == len(eval_tokens) // 32 == store.report["eval_blocks"]
    assert np.array_equal(store.eval[1]["input_ids"].numpy(), eval_tokens[32:64])
    first, second = store.report["train"]["sources"]
    assert first["planned_blocks"] == round(2.5 * first["blocks"]) and first["epochs"] == pytest.approx(
        2.5, abs=0.05
    )
    assert second["planned_blocks"] == 10 < second["blocks"]
    mix = [int(store.train[i]["mix_source"]) for i in range(len(store.train))]
    assert mix.count(0) == first["planned_blocks"] and mix.count(1) == 10
    passes = [store.train[i]["input_ids"] for i in range(2 * first["blocks"])]
    assert all(
        (a == b).all() for a, b in zip(passes[: first["blocks"]], passes[first["blocks"] :], strict=True)
    )


def test_a_failed_task_is_redone_alone(
    corpus: Path, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    """Task 1's file is broken: task 0 finishes and is kept; after the fix only task 1 runs."""
    sources = tmp_path / "sources"
    sources.mkdir()
    for number in range(4):
        write_jsonl(sources / f"f{number}.jsonl", documents(30, seed=40 + number))
    good = (sources / "f1.jsonl").read_text()
    (sources / "f1.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')  # dealt to task 1
    cfg = store_config(sources, path=tmp_path / "store")
    with pytest.raises(UserInputError, match=r"f1.jsonl:2: invalid JSON"):
        build_token_store(cfg, tokenizer, seed=SEED, cache_dir=tmp_path)
    store = tmp_path / "store"
    assert not (store / "manifest.json").exists()
    assert sorted(p.name for p in (store / "logs" / "completions").iterdir()) == ["00000"]
    task0 = [store / "train" / "source-000" / f"file-{n:06d}.tokens" for n in (0, 2)]
    before = [p.stat().st_mtime_ns for p in [*task0, store / "logs" / "logs" / "task_00000.log"]]
    (sources / "f1.jsonl").write_text(good)
    build_token_store(cfg, tokenizer, seed=SEED, cache_dir=tmp_path)
    assert [p.stat().st_mtime_ns for p in [*task0, store / "logs" / "logs" / "task_00000.log"]] == before
    assert (store / "manifest.json").is_file() and not list(store.rglob("*.tmp"))
    assert len(open_token_store(cfg, tokenizer, seed=SEED, cache_dir=tmp_path).train) > 0
    assert is_complete(cfg, tokenizer, tmp_path)
    os.utime(sources / "f3.jsonl", ns=(1, 1))  # a source changed since the build
    assert not is_complete(cfg, tokenizer, tmp_path)
    with pytest.raises(
        UserInputError, match=r"f3.jsonl \(data.train.0.path\) changed since.*lmforge prepare"
    ):
        open_token_store(cfg, tokenizer, seed=SEED, cache_dir=tmp_path)


def _drop_manifest(store: Path) -> None:
    (store / "manifest.json").unlink()


def _drop_shard(store: Path) -> None:
    (store / "train/source-000/file-000002.tokens").unlink()


def _truncate_shard(store: Path) -> None:
    tokens = store / "train/source-000/file-000001.tokens"
    tokens.write_bytes(tokens.read_bytes()[:-6])


def _truncate_index(store: Path) -> None:
    index = store / "train/source-000/file-000001.index"
    index.write_bytes(index.read_bytes()[:-8])


def _other_tokenizer_shard(store: Path) -> None:
    sidecar = store / "train/source-000/file-000003.json"
    sidecar.write_text(
        sidecar.read_text().replace('"tokenizer_fingerprint": "', '"tokenizer_fingerprint": "0')
    )


def _manifest_mismatch(store: Path) -> None:
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["splits"]["train"][0]["shards"][4]["tokens"] += 1
    (store / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_drop_manifest, r"manifest.json: missing.*Fix: run lmforge prepare CONFIG --executor"),
        (_drop_shard, r"file-000002.tokens: shard listed in .*manifest.json is missing"),
        (_truncate_shard, r"file-000001.tokens: truncated or damaged"),
        (_truncate_index, r"file-000001.index: truncated or damaged"),
        (_other_tokenizer_shard, r"file-000003.json: shard tokenized with another tokenizer"),
        (_manifest_mismatch, r"manifest.json: does not match shard file-000004"),
    ],
)
def test_a_damaged_store_is_refused(
    built: Any, tokenizer: PreTrainedTokenizerFast, tmp_path: Path, damage: Any, message: str
) -> None:
    cfg, _, path, _ = built
    copy = tmp_path / "store"
    shutil.copytree(path, copy)
    damage(copy)
    moved = cfg.model_copy(update={"store": cfg.store.model_copy(update={"path": copy})})
    with pytest.raises(UserInputError, match=message):
        open_token_store(moved, tokenizer, seed=SEED, cache_dir=tmp_path)


def test_another_tokenizer_is_refused(built: Any, tmp_path: Path) -> None:
    cfg, _, path, _ = built
    other = train_tokenizer(documents(300, seed=2), TokenizerTrainConfig(vocab_size=300, min_frequency=1))
    moved = cfg.model_copy(update={"store": cfg.store.model_copy(update={"path": path})})
    with pytest.raises(UserInputError, match=r"tokenized with another tokenizer than this run's"):
        open_token_store(moved, other, seed=SEED, cache_dir=tmp_path)


def test_tasks_encode_without_torch_or_transformers_and_check_their_encoder(
    built: Any, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    """A task loads the pipeline module and the tokenizer's Rust backend from encoder.json alone (a
    pool of tasks starts in about a second, not the 5-7 s of importing torch and transformers); the
    encoder encodes as the run's tokenizer does, and one that is not the plan's is refused."""
    _, _, path, _ = built
    probe = "import sys, lmforge.data.token_store.pipeline; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout
    text = documents(5, seed=9)
    plan = read_plan(path)
    assert task_encoder(path, plan)(text) == [
        tokenizer(t, add_special_tokens=False)["input_ids"] for t in text
    ]
    copy = tmp_path / "store"
    shutil.copytree(path, copy)
    encoder = copy / ENCODER_FILE
    encoder.write_text(encoder.read_text(encoding="utf-8").replace('"alpha"', '"alphA"'), encoding="utf-8")
    with pytest.raises(
        UserInputError, match=r"encoder.json is not the encoder its plan was written with.*delete"
    ):
        task_encoder(copy, read_plan(copy))


def test_reading_maps_few_shards_and_names_one_that_vanished(
    built: Any, tokenizer: PreTrainedTokenizerFast, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one shard mapped at a time the blocks are the same; a shard deleted while training
    is named, with the fix, when a block needs it."""
    cfg, _, path, store = built
    copy = tmp_path / "store"
    shutil.copytree(path, copy)
    monkeypatch.setattr(token_store_dataset, "_OPEN_MAPS", 1)
    moved = cfg.model_copy(update={"store": cfg.store.model_copy(update={"path": copy})})
    reopened = open_token_store(moved, tokenizer, seed=SEED, cache_dir=tmp_path)
    for index in range(len(store.train)):
        assert (reopened.train[index]["input_ids"] == store.train[index]["input_ids"]).all()
    (copy / "train/source-000/file-000000.tokens").unlink()
    with pytest.raises(
        DataSourceLost, match=r"file-000000.tokens: a shard of the token store could not be opened"
    ):
        reopened.train[0]


def test_slurm_dry_run_writes_a_checked_script(
    corpus: Path, tokenizer: PreTrainedTokenizerFast, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = store_config(corpus, path=tmp_path / "store", executor="slurm", tasks=3, workers=-1)
    cfg.store.slurm.partition, cfg.store.slurm.cpus_per_task = "cpu", 4  # type: ignore[union-attr]
    store = build_token_store(cfg, tokenizer, seed=SEED, cache_dir=tmp_path, dry_run=True)
    script = (store / "logs" / "launch_script.slurm").read_text()
    directives = (
        "#SBATCH --array=0-2",
        "#SBATCH --partition=cpu",
        "#SBATCH --cpus-per-task=4",
        "#SBATCH --mem-per-cpu=2G",
    )
    for directive in directives:
        assert directive in script.splitlines()
    assert "launch_pickled_pipeline" in script and script in capsys.readouterr().out
    assert not list(store.rglob("*.tokens")) and not (store / "manifest.json").exists()


def test_slurm_without_sbatch_is_refused(
    corpus: Path, tokenizer: PreTrainedTokenizerFast, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off a cluster, submitting fails naming sbatch, after datatrove pickled its executor (dill)."""
    cfg = store_config(corpus, path=tmp_path / "store", executor="slurm", workers=-1)
    cfg.store.slurm.partition = "cpu"  # type: ignore[union-attr]
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    with pytest.raises(UserInputError, match=r"sbatch was not found.*--dry-run"):
        build_token_store(cfg, tokenizer, seed=SEED, cache_dir=tmp_path)
    assert (tmp_path / "store" / "logs" / "executor.pik").is_file()


def test_ray_without_ray_is_refused(corpus: Path, tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    pytest.importorskip("datatrove")
    if __import__("importlib").util.find_spec("ray") is not None:
        pytest.skip("ray is installed here")
    with pytest.raises(UserInputError, match="pip install ray"):
        build_token_store(store_config(corpus), tokenizer, seed=SEED, cache_dir=tmp_path, executor="ray")
    assert not list(tmp_path.rglob("*.tokens"))


def test_prepare_cli_dry_run_prints_the_plan(corpus: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from lmforge.cli.main import app

    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "store", "output_dir": str(tmp_path / "runs")},
                "model": {"preset": "llama-tiny"},
                "tokenizer": {"train": {"vocab_size": 300, "min_frequency": 1}},
                "data": {"train": [{"path": str(corpus), "split": "paragraph"}], "max_length": 32},
            }
        )
    )
    result = CliRunner().invoke(
        app, ["prepare", str(config), "--executor", "local", "--tasks", "2", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert "5 input files, 2 tasks (local)" in result.output and "task 1: 2 files" in result.output


def documents(count: int, seed: int) -> list[str]:
    return word_documents(WORDS, count, seed, max_words=40)
