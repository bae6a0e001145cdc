"""At the end of a run, W&B (offline) and MLflow (file store) hold its data report as the run's
input, its final/ model as the run's output, a table of sample generations and its summary, read
back from what they wrote; no secret reaches them; a failure to publish never fails the run."""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lmforge.config import load_config
from lmforge.evaluate.samples import Prompt, sample_generations, sample_prompts
from lmforge.monitor.events import EventLog, read_events
from lmforge.monitor.metrics import read_metrics
from lmforge.monitor.run_monitor import RunMonitor
from lmforge.run_layout import RunPaths
from lmforge.train.runner import run_training
from tests.conftest import ROOT, SMALL_ARCH, save_tiny_llama
from tests.test_sinks import wandb_records

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

SECRET = "hf_artifactsecret98765"
ALPACA = ROOT / "examples" / "data" / "arithmetic_alpaca.jsonl"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """A tiny pretraining run with eval data, logged to W&B offline and MLflow's file store, with a
    secret in its config (a webhook that never fires), in the environment and on its command line."""
    tmp = tmp_path_factory.mktemp("published")
    config = {
        "run": {"name": "pub", "output_dir": str(tmp / "runs"), "seed": 0},
        "model": {"preset": "llama-tiny", "config": SMALL_ARCH},
        "tokenizer": {"train": {"vocab_size": 300}},
        "data": {"train": [{"path": str(corpus)}], "max_length": 64, "eval_fraction": 0.1},
        "train": {
            **{"max_steps": 4, "micro_batch_size": 4, "lr": 3e-3, "precision": "fp32"},
            **{"log_every": 1, "eval_every": 2, "warmup_steps": 0},
        },
        "monitor": {
            "loggers": ["wandb", "mlflow"],
            "alerts": {"webhook_url": f"https://127.0.0.1:9/hook/{SECRET}", "kinds": ["stall"]},
        },
    }
    with pytest.MonkeyPatch.context() as patch:
        for name in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI"):
            patch.delenv(name, raising=False)
        patch.setenv("WANDB_SILENT", "true")
        patch.setenv("WANDB_DATA_DIR", str(tmp / "wandb-data"))  # W&B's staging copies, kept in tmp
        patch.setenv("HF_TOKEN", SECRET)
        patch.setattr(sys, "argv", ["lmforge", "train", "c.yaml", f"x.webhook_url=https://h/{SECRET}"])
        outcome = run_training(load_config(None, base=config))
    assert outcome.steps == 4
    return outcome.run_dir


@pytest.mark.slow
def test_wandb_offline_run_holds_dataset_model_and_generations(run_dir: Path) -> None:
    paths = RunPaths(run_dir)
    records = _wandb_records(run_dir)
    artifacts = [r.artifact for r in records if r.HasField("artifact")]
    (dataset,) = [a for a in artifacts if a.type == "dataset"]
    (model,) = [a for a in artifacts if a.type == "model"]

    # The dataset is the run's input (use_after_commit: `wandb sync` records the use), logged before
    # the model, the run's output: W&B's lineage reads dataset -> run -> model.
    assert dataset.use_after_commit and not model.use_after_commit
    assert artifacts.index(dataset) < artifacts.index(model)
    manifest = json.loads(paths.manifest.read_text())
    assert dataset.name == f"data-{manifest['data_fingerprint'][:16]}"
    assert json.loads(dataset.metadata)["data_fingerprint"] == manifest["data_fingerprint"]
    (report,) = dataset.manifest.contents
    assert report.path == "data_report.json" and report.digest == _md5(paths.data_report)

    # The model artifact holds exactly the files of final/, with their digests.
    final_files = {p.relative_to(paths.final).as_posix(): p for p in paths.final.rglob("*") if p.is_file()}
    assert "model.safetensors" in final_files
    assert {e.path: e.digest for e in model.manifest.contents} == {
        name: _md5(path) for name, path in final_files.items()
    }
    metrics = read_metrics(paths.metrics)
    final_loss = [r["loss"] for r in metrics if "loss" in r][-1]
    metadata = json.loads(model.metadata)
    assert model.name == "pub-model" and metadata["stage"] == "pretrain" and metadata["steps"] == 4
    assert metadata["final_loss"] == pytest.approx(final_loss)
    assert metadata["best_eval_loss"] == pytest.approx(
        min(r["eval_loss"] for r in metrics if "eval_loss" in r)
    )

    # The generations: a table of 4 rows at the last step, its file in the offline run's media.
    rows = [_items(r.history.item) for r in records if r.HasField("history")]
    (table_row,) = [row for row in rows if "samples/generations" in row]
    assert table_row["_step"] == 4 and table_row["samples/generations"]["nrows"] == 4
    (table_file,) = (run_dir / "wandb").glob("offline-run-*/files/media/table/samples/generations_4_*.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["prompt", "completion", "reference"] and len(table["data"]) == 4
    assert all(
        prompt and isinstance(completion, str) and reference
        for prompt, completion, reference in table["data"]
    )

    summary: dict[str, Any] = {}
    for record in records:
        if record.HasField("summary"):
            summary.update(_items(record.summary.update))
    assert summary["steps"] == 4 and summary["final_loss"] == pytest.approx(final_loss)
    assert "train_loss" in summary and summary["best_eval_step"] in (2, 4)
    (opened,) = [r.run for r in records if r.HasField("run")]
    config = {item.key: json.loads(item.value_json) for item in opened.config.update}
    assert config["train"]["lr"] == 3e-3  # the config, logged when the run opened
    _assert_no_secret(run_dir)
    _assert_no_secret(run_dir.parents[1] / "wandb-data")


@pytest.mark.slow
def test_mlflow_run_holds_data_input_logged_model_and_generations(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.entities import LoggedModelStatus
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    paths = RunPaths(run_dir)
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "lmforge"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["train.lr"] == "0.003"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"data", "samples", "summary.json"}
    assert [a.path for a in client.list_artifacts(run.info.run_id, "data")] == ["data/data_report.json"]

    manifest = json.loads(paths.manifest.read_text())
    (data_input,) = run.inputs.dataset_inputs
    assert data_input.dataset.digest == manifest["data_fingerprint"][:36]
    assert {t.key: t.value for t in data_input.tags} == {"mlflow.data.context": "train"}

    (output,) = run.outputs.model_outputs
    (logged,) = client.search_logged_models([experiment.experiment_id])
    assert logged.model_id == output.model_id and output.step == 4
    model = client.get_logged_model(logged.model_id)
    assert model.status == LoggedModelStatus.READY
    assert model.source_run_id == run.info.run_id and model.params["stage"] == "pretrain"
    stored = Path(model.artifact_location.removeprefix("file://"))
    assert {p.relative_to(stored).as_posix(): _md5(p) for p in stored.rglob("*") if p.is_file()} == {
        p.relative_to(paths.final).as_posix(): _md5(p) for p in paths.final.rglob("*") if p.is_file()
    }
    final_loss = [r["loss"] for r in read_metrics(paths.metrics) if "loss" in r][-1]
    assert {m.key: m.value for m in model.metrics}["final_loss"] == pytest.approx(final_loss)

    table_path = client.download_artifacts(run.info.run_id, "samples/generations.json", str(run_dir.parent))
    table = json.loads(Path(table_path).read_text())
    assert table["columns"] == ["prompt", "completion", "reference"] and len(table["data"]) == 4
    _assert_no_secret(run_dir)


@pytest.mark.slow
def test_lora_sft_run_publishes_its_adapter_and_replies(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter run: the logged model is final/ with its adapter and names its base model; the
    samples are prompted with the rendered user turn and referenced by the dataset's answers."""
    from mlflow.tracking import MlflowClient
    from transformers import AutoTokenizer

    base = save_tiny_llama(AutoTokenizer.from_pretrained(run_dir / "final"), tmp_path / "base")
    config = {
        "run": {"name": "lora", "output_dir": str(tmp_path / "runs"), "seed": 0},
        "model": {"path": str(base)},
        "data": {"train": [{"path": str(ALPACA)}], "max_length": 128, "eval_fraction": 0.05},
        "train": {
            "stage": "sft",
            "method": "lora",
            "max_steps": 2,
            "micro_batch_size": 4,
            "precision": "fp32",
        },
        "monitor": {"loggers": ["mlflow"]},
    }
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    outcome = run_training(load_config(None, base=config))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(outcome.run_dir / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "lmforge"]
    (model,) = client.search_logged_models([experiment.experiment_id])
    assert model.params == {"stage": "sft", "adapter": "LORA", "base_model": str(base)}
    stored = Path(model.artifact_location.removeprefix("file://"))
    assert (stored / "adapter" / "adapter_model.safetensors").is_file()
    assert not (stored / "model.safetensors").exists()  # no merge was asked for

    (run,) = client.search_runs([experiment.experiment_id])
    path = client.download_artifacts(run.info.run_id, "samples/generations.json", str(tmp_path))
    table = json.loads(Path(path).read_text())
    answers = {json.loads(line)["output"] for line in ALPACA.read_text().splitlines()}
    assert len(table["data"]) == 4
    for prompt, _, reference in table["data"]:
        assert "<|im_start|>user" in prompt and prompt.endswith("<|im_start|>assistant\n")
        assert reference in answers


def test_a_failed_publish_is_an_event_not_an_error(tmp_path: Path) -> None:
    """A sink that fails to publish leaves a publish_failed event; the other sinks still publish;
    a run whose final/ cannot be read for samples says why instead of failing."""

    class Publisher:
        def __init__(self, name: str, fail: bool) -> None:
            self.name, self.fail = name, fail
            self.runs: list[Any] = []

        def log(self, record: dict[str, Any]) -> None: ...

        def close(self) -> None: ...

        def publish_run(self, run: Any) -> None:
            if self.fail:
                raise OSError(28, "No space left on device")
            self.runs.append(run)

    broken, working = Publisher("wandb", fail=True), Publisher("mlflow", fail=False)
    paths = RunPaths(tmp_path)
    monitor = RunMonitor(EventLog(paths.events), sinks=[broken, working])
    data = type("Data", (), {"eval": None, "train": []})()
    monitor.publish_run(
        paths,
        "demo",
        stage="sft",
        data=data,
        trainer_summary={"train_loss": 1.5},
        generate=sample_generations,
    )  # type: ignore[arg-type]
    (event,) = read_events(paths.events)
    assert event["kind"] == "publish_failed" and "wandb" in event["message"]
    assert "No space left" in event["message"] and str(paths.final) in event["message"]
    (published,) = working.runs
    assert published.samples == [] and published.samples_note.startswith("no sample generations")
    assert published.summary == {"train_loss": 1.5, "steps": 0}
    rm = RunMonitor(EventLog(tmp_path / "rm"), sinks=[working])
    rm.publish_run(paths, "demo", stage="rm", data=data, trainer_summary={}, generate=sample_generations)  # type: ignore[arg-type]
    assert "reward model" in working.runs[-1].samples_note


@pytest.mark.slow
def test_prompts_of_every_row_kind(run_dir: Path) -> None:
    """SFT samples are prompted with their unsupervised head and referenced by their reply; packed
    rows split into samples; dpo rows render their prompt turns, the chosen answer is the reference;
    a kto row labelled bad has no reference; pretraining blocks are cut after their first tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    ids = tokenizer("the cat sat on a mat", add_special_tokens=False)["input_ids"]
    reply = tokenizer("the dog ran", add_special_tokens=False)["input_ids"]
    sft = {"input_ids": ids + reply, "labels": [-100] * len(ids) + reply}
    packed = {"input_ids": [ids + reply, reply + ids], "labels": [[-100] * len(ids) + reply, reply + ids]}
    assert sample_prompts([sft], tokenizer, 4) == [Prompt(ids, "the dog ran")]
    (first, second) = sample_prompts([packed], tokenizer, 4)
    assert first == Prompt(ids, "the dog ran") and second.ids == (reply + ids)[: len(reply + ids) // 2]

    messages = [{"role": "user", "content": "the cat"}]
    dpo = {"prompt": messages, "chosen": [{"role": "assistant", "content": "sat"}], "rejected": []}
    kto = {"prompt": messages, "completion": [{"role": "assistant", "content": "ran"}], "label": False}
    ((dpo_ids, dpo_ref, _), (_, kto_ref, _)) = sample_prompts([dpo, kto], tokenizer, 4)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(dpo_ids) == rendered and dpo_ref == "sat" and kto_ref is None

    block = {"input_ids": list(range(5, 69)), "labels": list(range(5, 69))}
    ((head, reference, images),) = sample_prompts([block], tokenizer, 1)
    assert not images  # text rows carry no images
    assert head == list(range(5, 21)) and reference == tokenizer.decode(
        list(range(21, 53)), skip_special_tokens=True
    )


def _md5(path: Path) -> str:
    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


def _items(items: Any) -> dict[str, Any]:
    """A history row or summary update as {key: value}, nested keys joined under their first part."""
    row: dict[str, Any] = {}
    for item in items:
        keys = [item.key] if item.key else list(item.nested_key)
        value = json.loads(item.value_json)
        if len(keys) == 1:
            row[keys[0]] = value
        else:
            row.setdefault(keys[0], {})[keys[-1]] = value
    return row


def _wandb_records(run_dir: Path, timeout: float = 20.0) -> list[Any]:
    """Every Record of the offline run's .wandb file, once wandb-core (a separate process that
    may still be flushing after finish()) wrote its exit record."""
    deadline = time.monotonic() + timeout
    while True:
        records = _read_wandb_file(run_dir)
        if any(r.HasField("exit") for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _read_wandb_file(run_dir: Path) -> list[Any]:
    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    return wandb_records(path)


def _assert_no_secret(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
