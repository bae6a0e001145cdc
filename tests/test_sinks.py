"""W&B (offline) and MLflow (file store) sinks: what was logged reads back with the same steps and
values, a resumed run continues the same run without re-logging a step, and no secret reaches them."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lmforge.config.schema import MonitorConfig
from lmforge.errors import UserInputError
from lmforge.monitor.sink_step_axis import STATE_FILE
from lmforge.monitor.sinks import open_sinks

SECRET = "hf_sinksecret123456"
RECORDS = [
    {"step": 1, "loss": 4.0, "lr": 1e-4, "grad_norm": 2.0, "tokens_per_s": 1000.0},
    {"step": 2, "loss": 3.5, "lr": 2e-4, "grad_norm": 1.5, "tokens_per_s": 1100.0},
    {"step": 3, "loss": 3.0, "lr": 3e-4, "grad_norm": 1.0, "tokens_per_s": 1200.0, "eval_loss": 3.2},
]


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI", "SWANLAB_MODE", "SWANLAB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HF_TOKEN", SECRET)  # a credential in the environment must reach no sink
    # ... nor one in a command-line override (sinks must not record argv).
    monkeypatch.setattr(
        sys, "argv", ["lmforge", "train", "c.yaml", f"monitor.alerts.webhook_url=https://h/{SECRET}"]
    )


def _config() -> dict[str, Any]:
    return {"run": {"name": "demo"}, "train": {"lr": 3e-4, "max_steps": 6}, "note": f"pushed with {SECRET}"}


def wandb_records(path: Path) -> list[Any]:
    """The protobuf Records of an offline .wandb file (LevelDB log format)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, block, chunks = [], 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: one whole record
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def _wandb_history(path: Path) -> list[dict[str, float]]:
    """History rows of an offline .wandb file."""
    return [
        {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in wandb_records(path)
        if record.HasField("history")
    ]


def _wandb_rows(run_dir: Path) -> list[dict[str, float]]:
    rows = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):  # not latest-run/
        rows += _wandb_history(path)
    return [{k: v for k, v in row.items() if not k.startswith("_") or k == "_step"} for row in rows]


def _wandb_rows_when_written(run_dir: Path, last_step: int, timeout: float = 20.0) -> list[dict[str, float]]:
    """wandb-core (a separate process) may still be flushing the last session's file after finish()."""
    deadline = time.monotonic() + timeout
    while True:
        rows = _wandb_rows(run_dir)
        if any(int(row.get("_step", -1)) == last_step for row in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed (lmforge[wandb])")
def test_wandb_offline_logs_resumes_and_keeps_secrets_out(tmp_path: Path) -> None:
    cfg = MonitorConfig(loggers=["wandb"])
    (sink,) = open_sinks(cfg, tmp_path, "demo", _config(), resume_step=None)
    for record in RECORDS:
        sink.log(record)
    sink.log({"step": 3, "eval_ppl": 24.5})  # a second record at the same step adds new keys only
    sink.log({"step": 2, "loss": 9.0})  # backwards: refused
    sink.close()
    run_id = json.loads((tmp_path / STATE_FILE).read_text())["wandb"]["run_id"]
    assert run_id and sink.run_id == run_id

    # Resume from checkpoint step 2 after the first process reached step 3: the replayed step 3 is
    # not logged again, step 4 continues the same run.
    # wandb names offline session folders by the second they start in: two sessions within one
    # second would share a folder, which a real resume (a new process) never does.
    time.sleep(1.05 - time.time() % 1)
    (resumed,) = open_sinks(cfg, tmp_path, "demo", _config(), resume_step=2)
    assert resumed.run_id == run_id
    resumed.log({"step": 3, "loss": 7.0})
    resumed.log({"step": 4, "loss": 2.5})
    resumed.close()

    rows = _wandb_rows_when_written(tmp_path, last_step=4)
    by_step: dict[int, dict[str, float]] = {}
    for row in rows:
        by_step.setdefault(int(row["_step"]), {}).update(row)
    assert sorted(by_step) == [1, 2, 3, 4]
    assert [by_step[s]["loss"] for s in (1, 2, 3, 4)] == [4.0, 3.5, 3.0, 2.5]
    assert by_step[3]["eval_loss"] == 3.2 and by_step[3]["eval_ppl"] == 24.5
    assert by_step[2]["lr"] == pytest.approx(2e-4)
    assert [int(r["_step"]) for r in rows] == sorted(int(r["_step"]) for r in rows)
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))) == 2  # one run id, two sessions
    _assert_no_secret(tmp_path)


@pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="mlflow not installed (lmforge[mlflow])"
)
def test_mlflow_file_store_logs_and_resumes(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    cfg = MonitorConfig(loggers=["mlflow"], project="demo-project")
    (sink,) = open_sinks(cfg, tmp_path, "demo", _config(), resume_step=None)
    for record in RECORDS:
        sink.log(record)
    sink.log({"step": 3, "loss": 99.0})  # the same key at the same step: refused
    sink.close()

    (resumed,) = open_sinks(cfg, tmp_path, "demo", {**_config(), "extra": 1}, resume_step=2)
    resumed.log({"step": 2, "loss": 8.0})
    resumed.log({"step": 3, "loss": 7.0})
    resumed.log({"step": 4, "loss": 2.5, "lr": "nan"})
    resumed.close()

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(resumed.run_id)
    assert resumed.run_id == sink.run_id and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "demo-project"
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(history) == [(1, 4.0), (2, 3.5), (3, 3.0), (4, 2.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [(3, 3.2)]
    lr = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "lr"))
    assert lr[:3] == [(1, 1e-4), (2, 2e-4), (3, 3e-4)] and lr[3][0] == 4 and lr[3][1] != lr[3][1]  # NaN kept
    assert run.data.params["train.lr"] == "0.0003" and run.data.params["extra"] == "1"
    assert run.data.params["note"] == "pushed with ***REDACTED***"
    _assert_no_secret(tmp_path)


def _assert_no_secret(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(UserInputError, match=r"monitor.loggers.*wandb.*pip install 'lmforge\[wandb\]'"):
        open_sinks(MonitorConfig(loggers=["mlflow", "wandb"]), tmp_path, "demo", {}, None)
    assert not (tmp_path / "mlruns").exists()  # nothing opened before the check failed
    (tensorboard,) = open_sinks(MonitorConfig(loggers=["tensorboard"]), tmp_path, "demo", {}, None)
    assert tensorboard.name == "tensorboard"
    tensorboard.close()


def test_swanlab_offline(tmp_path: Path) -> None:
    # SwanLab is in the default install (protobuf is pinned below 7 for it); its offline run file is
    # read back with SwanLab's own reader.
    from swanlab.proto.swanlab.record.v1 import record_pb2
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (sink,) = open_sinks(MonitorConfig(loggers=["swanlab"]), tmp_path, "demo", _config(), None)
    for record in RECORDS:
        sink.log(record)
    sink.log({"step": 2, "loss": 9.0})  # backwards: refused
    sink.close()
    (path,) = (tmp_path / "swanlog").glob("run-*/run-*.swanlab")
    reader = DataStoreReader()
    reader.open(path)
    scalars = []
    for data in reader:
        entry = record_pb2.Record()
        entry.ParseFromString(data)
        if entry.WhichOneof("record_type") == "scalar":
            scalars.append((entry.scalar.key, entry.scalar.step, entry.scalar.value.number))
    reader.close()
    assert [(step, value) for key, step, value in scalars if key == "loss"] == [(1, 4.0), (2, 3.5), (3, 3.0)]
    assert ("eval_loss", 3, 3.2) in scalars
    metadata = next((tmp_path / "swanlog").glob("run-*/files/swanlab-metadata.json")).read_text()
    assert '"runtime":null' in metadata.replace(" ", "")  # no argv recorded
    _assert_no_secret(tmp_path)


def test_tensorboard_resume_floor_is_a_step_it_flushed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorBoard flushes every few seconds, not every step; the step a resume skips up to is
    recorded only once it is on disk, so steps a crash lost before a flush are logged again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lmforge.monitor import sinks

    monkeypatch.setattr(sinks, "TENSORBOARD_FLUSH_SECONDS", 3600.0)
    crashed = sinks.TensorBoardSink(tmp_path, "demo", "lmforge", {}, resume_step=None)
    crashed.log({"step": 1, "loss": 3.0})
    crashed.log({"step": 2, "loss": 2.0})
    state = tmp_path / STATE_FILE
    assert not state.exists() or "tensorboard" not in json.loads(state.read_text())
    resumed = sinks.TensorBoardSink(tmp_path, "demo", "lmforge", {}, resume_step=1)
    resumed.log({"step": 2, "loss": 2.5})  # replayed after the checkpoint of step 1: logged
    resumed.log({"step": 3, "loss": 1.0})
    resumed.close()
    assert json.loads(state.read_text())["tensorboard"]["last_step"] == 3
    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    assert {e.step: e.value for e in board.Scalars("loss")} == {1: 3.0, 2: 2.5, 3: 1.0}
