"""Bad input a user can give, through the real CLI: each ends in exit code 2 with a message that
names the file or config key and says how to fix it, never in a traceback."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmforge.config.schema import AlertsConfig
from lmforge.errors import UserInputError
from lmforge.monitor.alerts import AlertSender
from lmforge.monitor.events import EventLog
from tests.conftest import SMALL_ARCH, run_cli
from tests.test_alerts import Receiver


def write_config(tmp_path: Path, data_path: str | Path, **train: Any) -> Path:
    """A tiny pretraining config reading `data_path`, with its own tokenizer."""
    config = {
        "run": {"name": "bad", "output_dir": str(tmp_path / "runs")},
        "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": str(data_path)}], "max_length": 32, "eval_fraction": 0},
        "train": {"max_steps": 1, "micro_batch_size": 2, "precision": "fp32", **train},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def assert_user_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit code 2, no traceback, and every one of `words` in the message."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for word in words:
        assert word in result.stderr, f"{word!r} not in: {result.stderr[-3000:]}"


def test_corrupt_parquet_names_the_file(tmp_path: Path) -> None:
    data = tmp_path / "train.parquet"
    data.write_bytes(os.urandom(2048))
    result = run_cli("train", str(write_config(tmp_path, data)))
    assert_user_error(result, str(data), "not a readable parquet file", "data.train.0.path", "Fix:")


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.txt"])
def test_empty_data_file_names_the_source_and_key(tmp_path: Path, name: str) -> None:
    data = tmp_path / name
    data.write_bytes(b"")
    result = run_cli("train", str(write_config(tmp_path, data)))
    assert_user_error(result, "data.train.0.path", str(data), "holds no rows", "0 bytes", "Fix:")
    assert "tokenizer.train" not in result.stderr  # the data is to blame, not the tokenizer


def test_directory_without_data_files_names_the_source_and_key(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    result = run_cli("train", str(write_config(tmp_path, data)))
    assert_user_error(result, "data.train.0.path", str(data), "holds no rows", "Fix:")


def test_readme_in_a_data_directory_is_not_training_data(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "README.md").write_text("# About this data\n\nCollected by hand.\n" * 20)
    only_readme = run_cli("train", str(write_config(tmp_path, data)))
    assert_user_error(only_readme, "data.train.0.path", "holds no rows", "README.md", "glob")

    rows = [{"text": f"the cat sat on the mat {i} times and then ran to the barn"} for i in range(40)]
    (data / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    prepared = run_cli("prepare", str(write_config(tmp_path, data)))
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    report = json.loads((tmp_path / "runs" / "bad" / "data_report.json").read_text())
    source = report["train"]["sources"][0]
    assert (source["files"], source["documents"]) == (1, 40)  # rows.jsonl only, no README paragraphs


def test_device_file_is_not_a_regular_file(tmp_path: Path) -> None:
    result = run_cli("train", str(write_config(tmp_path, "/dev/null")))
    assert_user_error(result, "data.train.0.path", "/dev/null", "not a regular file", "Fix:")
    assert "no such file" not in result.stderr


def test_config_path_that_is_a_directory(tmp_path: Path) -> None:
    write_config(tmp_path, "data.jsonl")
    result = run_cli("train", str(tmp_path))
    assert_user_error(result, str(tmp_path), "is a directory", "YAML", "cfg.yaml")
    assert "not found" not in result.stderr


def test_override_index_out_of_range_says_the_list_size(tmp_path: Path) -> None:
    result = run_cli("train", str(write_config(tmp_path, "data.jsonl")), "data.train.3.path=x")
    assert_user_error(
        result, "data.train.3.path=x", "data.train has 1 item (index 0)", "index 3 is out of range", "YAML"
    )


def test_duplicate_yaml_key_names_file_line_and_key(tmp_path: Path) -> None:
    path = write_config(tmp_path, "data.jsonl")
    lines = path.read_text().splitlines()
    at = lines.index("  max_steps: 1")
    lines[at + 1 : at + 1] = ["  lr: 0.001", "  lr: 0.01"]  # the second would silently win
    path.write_text("\n".join(lines) + "\n")
    result = run_cli("train", str(path))
    assert_user_error(
        result, f"{path}:{at + 3}: train.lr", "duplicate key", f"first set on line {at + 2}", "Fix:"
    )


def test_micro_batch_larger_than_the_training_set(tmp_path: Path, corpus: Path) -> None:
    result = run_cli("train", str(write_config(tmp_path, corpus, micro_batch_size=100_000)))
    assert_user_error(
        result, "train.micro_batch_size=100000", "larger than the training set", "block(s)", "lower"
    )
    assert not (tmp_path / "runs" / "bad" / "final").exists()


def test_generate_refuses_a_pickled_adapter_and_says_how_to_convert(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(tmp_path / "base"), "r": 4})
    )
    (adapter / "adapter_model.bin").write_bytes(os.urandom(256))
    result = run_cli("generate", str(adapter), "--prompt", "hi")
    assert_user_error(
        result, str(adapter / "adapter_model.bin"), "pickle", "save_pretrained", "safe_serialization=True"
    )


@pytest.fixture()
def receiver() -> Any:
    r = Receiver()
    yield r
    r.close()


@pytest.mark.parametrize("pass_run_dir", [True, False])
def test_stall_alert_sends_no_absolute_local_path(
    receiver: Receiver, tmp_path: Path, pass_run_dir: bool
) -> None:
    run_dir = tmp_path / "my runs" / "demo"  # a space: paths are kept whole, not cut at it
    stacks = run_dir / "stacks"
    outside = tmp_path / "elsewhere" / "corpus.jsonl"
    sender = AlertSender(
        AlertsConfig(webhook_url=receiver.url, kinds=["stall"]),
        "demo",
        run_dir=run_dir if pass_run_dir else None,
    )
    events = EventLog(run_dir / "events", listeners=[sender])
    # What the stall watchdog emits (train/guard_callback.py), plus a path outside the run.
    written = events.emit(
        "stall",
        4,
        f"no training progress for 60 s on rank 0; every thread's stack is in {stacks}; data {outside}.",
        rank=0,
        stacks=str(stacks),
    )
    assert str(stacks) in written["message"]  # the local record keeps the full path
    body = json.dumps(receiver.requests[0]["body"])
    assert str(tmp_path) not in body and "my runs" not in body
    event = receiver.requests[0]["body"]["event"]
    assert event["stacks"] == "stacks"
    assert event["message"].endswith("stack is in stacks; data corpus.jsonl.")
    assert "stack is in stacks; data corpus.jsonl." in receiver.requests[0]["body"]["text"]


def test_flash_attention_without_its_gpu_stops_before_any_work(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "corpus.txt")
    (tmp_path / "corpus.txt").write_text("some text to read\n" * 50)
    result = run_cli("train", str(config), "model.attn_implementation=flash_attention_2")
    assert_user_error(result, "model.attn_implementation: flash_attention_2", "sdpa")
    assert len(result.stderr.strip().splitlines()) <= 3  # one paragraph, not a 70-line ImportError
    assert not (tmp_path / "runs" / "bad" / "data_report.json").exists()


def test_a_sink_without_its_extra_stops_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library is made to look absent (whether or not this machine has it): the run stops at
    once naming the extra to install, before the tokenizer, data or model are touched."""
    import importlib.util

    from typer.testing import CliRunner

    from lmforge.cli.main import app

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "swanlab" else real_find_spec(name, *a)
    )
    (tmp_path / "corpus.txt").write_text("some text to read\n" * 50)
    config = write_config(tmp_path, tmp_path / "corpus.txt")
    result = CliRunner().invoke(app, ["train", str(config), "monitor.loggers=[tensorboard, swanlab]"])
    # `lmforge` maps a UserInputError to exit 2 with its message (main(), tested above).
    assert isinstance(result.exception, UserInputError), result.output
    assert "pip install 'swanlab>=0.10' 'protobuf<7'" in str(result.exception) and "monitor.loggers" in str(
        result.exception
    )
    assert not (tmp_path / "runs" / "bad" / "data_report.json").exists()
    assert not (tmp_path / "runs" / "bad" / "tokenizer").exists()
