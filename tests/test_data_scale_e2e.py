"""Pretraining from a stream and from the sharded token store, through the real CLI.

One corpus of jsonl shards serves every run: the token store trains the same loss curve as the
cache (same blocks, same order), and a stream of two weighted sources killed mid-run resumes to
bit-identical weights, its achieved mix logged and reported."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lmforge.data.corpus import builtin_files
from tests.conftest import SMALL_ARCH, run_cli

pytestmark = pytest.mark.slow

STEPS = 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Python standard-library modules as documents in 4 shards, and a tiny source of 3 snippets."""
    root = tmp_path_factory.mktemp("corpus")
    files = [f for f in builtin_files("builtin:python-stdlib") if f.stat().st_size < 40_000][:60]
    for shard in range(4):
        with (root / f"code-{shard}.jsonl").open("w") as out:
            for file in files[shard::4][:10]:
                out.write(json.dumps({"text": file.read_text(encoding="utf-8")}) + "\n")
    with (root / "notes.jsonl").open("w") as out:  # a tiny source, to be upsampled
        for file in files[40:43]:
            out.write(json.dumps({"text": file.read_text(encoding="utf-8")[:240]}) + "\n")
    return root


def write_config(tmp_path: Path, corpus: Path, name: str, **data: object) -> Path:
    config = {
        "run": {"name": name, "seed": 0, "output_dir": str(tmp_path / "runs")},
        "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
        "tokenizer": {"train": {"vocab_size": 512, "max_chars": 300_000}},
        "data": {
            "train": [{"path": str(corpus / "code-*.jsonl")}],
            "max_length": 64,
            "cache_dir": str(tmp_path / "cache"),
            **data,
        },
        "train": {
            "max_steps": STEPS,
            "micro_batch_size": 4,
            "lr": 1e-2,
            "precision": "fp32",
            "warmup_steps": 2,
            "log_every": 1,
            "save_every": 3,
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metrics(run) if "loss" in r]


def train(config: Path, *overrides: str) -> None:
    result = run_cli("train", str(config), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_token_store_trains_the_caches_loss_curve(tmp_path: Path, corpus: Path) -> None:
    train(write_config(tmp_path, corpus, "cached"))
    store = write_config(tmp_path, corpus, "stored", store={"tasks": 2, "workers": 1})
    prepared = run_cli("prepare", str(store))
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    train(store)
    cached, stored = losses(tmp_path / "runs" / "cached"), losses(tmp_path / "runs" / "stored")
    assert [step for step, _ in cached] == [step for step, _ in stored] == list(range(1, STEPS + 1))
    for (_, a), (_, b) in zip(cached, stored, strict=True):
        assert abs(a - b) <= 1e-6, (cached, stored)
    report = json.loads((tmp_path / "runs" / "stored" / "data_report.json").read_text())
    assert (
        report["train_blocks"]
        == json.loads((tmp_path / "runs" / "cached" / "data_report.json").read_text())["train_blocks"]
    )
    # One source: every block is from source 0, and the run logged the tokens it took from it.
    last = [r for r in metrics(tmp_path / "runs" / "stored") if "loss" in r][-1]
    assert last["mix_tokens_0"] == STEPS * 4 * 64


def test_a_weighted_stream_killed_mid_run_resumes_bitwise_and_reports_its_mix(
    tmp_path: Path, corpus: Path
) -> None:
    sources = [
        {"path": str(corpus / "code-*.jsonl")},
        # Its weight makes it about a third of the mix: far more than its size, so it is repeated.
        {"path": str(corpus / "notes.jsonl"), "weight": 400.0},
    ]
    settings = {"streaming": True, "train": sources}
    workers = "train.dataloader_workers=2"
    reference = write_config(tmp_path / "a", corpus, "stream", **settings)
    train(reference, workers)
    crashed_config = write_config(tmp_path / "b", corpus, "stream", **settings)
    crashed = run_cli("train", str(crashed_config), workers, "debug.crash_at_step=5")
    assert crashed.returncode == -signal.SIGKILL
    run = tmp_path / "b" / "runs" / "stream"
    assert (run / "checkpoints" / "step-3" / "data_state" / "rank-00000.json").is_file()
    train(crashed_config, workers)

    expected = load_file(tmp_path / "a" / "runs" / "stream" / "final" / "model.safetensors")
    resumed = load_file(run / "final" / "model.safetensors")
    for name, tensor in expected.items():
        assert torch.equal(tensor, resumed[name]), f"{name} differs after the streaming resume"
    assert losses(run) == losses(tmp_path / "a" / "runs" / "stream")

    # The achieved mix: logged per step and in the data report; the tiny source upsampled.
    trained = STEPS * 4 * 64
    last = [r for r in metrics(run) if "loss" in r][-1]
    assert last["mix_tokens_0"] + last["mix_tokens_1"] == trained
    assert 0.2 * trained < last["mix_tokens_1"] < 0.5 * trained
    report = json.loads((run / "data_report.json").read_text())
    assert report["streaming"] is True and report["train_blocks"] == STEPS * 4
    assert [entry["tokens"] for entry in report["mix"]] == [last["mix_tokens_0"], last["mix_tokens_1"]]
    assert "Mix of sources (trained on so far)" in (run / "report.html").read_text()
    code, notes = report["train"]["sources"]
    # Every reader (2 workers) has been through its part of the 3 snippets at least once; 6 used up.
    assert code["epochs"] == 0 and notes["epochs"] >= 1 and notes["documents"] >= 2 * 3, report["train"]
    assert (
        json.loads((run / "checkpoints" / "step-6" / "data_state" / "mix.json").read_text())["tokens"][1] > 0
    )


def test_two_processes_stream_their_own_parts_and_a_resume_on_one_is_refused(
    tmp_path: Path, corpus: Path
) -> None:
    from tests.test_distributed import torchrun

    config = write_config(tmp_path, corpus, "ddp-stream", streaming=True)
    launched = torchrun(config, "train.max_steps=3", "distributed.strategy=ddp")
    assert launched.returncode == 0, launched.stderr[-3000:]
    run = tmp_path / "runs" / "ddp-stream"
    states = sorted((run / "checkpoints" / "step-3" / "data_state").glob("rank-*.json"))
    assert [s.name for s in states] == ["rank-00000.json", "rank-00001.json"]
    # The two ranks read disjoint parts: the 4 shards are dealt 2 and 2 (files 0, 2 and 1, 3).
    firsts = [json.loads(s.read_text())["loader"]["dataset_state"]["sources"][0] for s in states]
    assert [f["position"]["file"] for f in firsts] != [None, None]
    report = json.loads((run / "data_report.json").read_text())
    assert report["readers"] == 2 and report["train_blocks"] == 3 * 4 * 2  # both ranks' blocks counted

    # On one process: the changed global batch is refused first; allowed, the stream's split is.
    refused = run_cli("train", str(config), "train.max_steps=6")
    assert refused.returncode == 2 and "8 on 2 process(es) -> 4 on 1" in refused.stderr, refused.stderr[
        -3000:
    ]
    refused = run_cli("train", str(config), "train.max_steps=6", "train.resume_changed=allow")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "streaming run of 2 process(es)" in refused.stderr and "data.store" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_shard_lost_mid_run_stops_it_with_a_checkpoint_and_the_same_command_resumes(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    files = tmp_path / "files"
    files.mkdir()
    for index in range(40):  # 40 input files: 40 shards, mapped one by one as the sampler reaches them
        body = "".join(f"def f{index}_{k}(x):\n    return x * {k} + {index}\n" for k in range(8))
        (files / f"part-{index:03d}.jsonl").write_text(json.dumps({"text": body}) + "\n")
    config = write_config(
        tmp_path, files, "lost", store={"tasks": 2, "workers": 1}, train=[{"path": str(files / "*.jsonl")}]
    )
    assert run_cli("prepare", str(config)).returncode == 0
    slow = "debug.faults=[{kind: slow_data, step: 4, seconds: 6}]"  # time to lose the shards before step 4
    process = subprocess.Popen(
        [sys.executable, "-m", "lmforge.cli.main", "train", str(config), slow],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    run = tmp_path / "runs" / "lost"
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step-3").is_dir() and process.poll() is None:
        assert time.monotonic() < deadline, "the run never reached its step-3 checkpoint"
        time.sleep(0.2)
    moved = tmp_path / "moved"
    moved.mkdir()
    shards = sorted((tmp_path / "cache").glob("store-*/train/source-000/*.tokens"))
    assert len(shards) == 40
    for shard in shards:  # the ones already mapped stay readable; the first one not yet mapped stops it
        shard.rename(moved / shard.name)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    assert ".tokens: a shard of the token store could not be opened" in stderr, stderr[-2000:]
    assert "is checkpointed" in stderr and "run the same command to resume" in stderr
    stopped_at = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
    assert 3 <= stopped_at < STEPS and not (run / "final").exists()

    for shard in shards:  # put them back: the same command resumes and finishes
        (moved / shard.name).rename(shard)
    train(config)
    assert [step for step, _ in losses(run)] == list(range(1, STEPS + 1))
    assert (run / "final" / "model.safetensors").is_file()
