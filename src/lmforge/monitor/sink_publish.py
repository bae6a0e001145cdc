"""A finished run published to W&B and MLflow: the data report as the run's input, final/ as its
output model, a table of sample generations, and the run's summary (see run_artifacts.py).

W&B: a "dataset" artifact (data_report.json, data and tokenizer fingerprints in its metadata) used
by the run, and a "model" artifact (the files of final/) logged by it, so W&B's lineage graph reads
dataset -> run -> model; the generations as a `wandb.Table`; `run.summary`.
MLflow: the data report as the run's dataset input and under data/; final/ as the artifacts of an
MLflow 3 LoggedModel that the run outputs; the generations as a table under samples/; summary.json.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

from lmforge.config.stages import stage_spec
from lmforge.monitor.run_artifacts import FinishedRun

TABLE_KEY = "samples/generations"
TABLE_FILE = "samples/generations.json"


def artifact_names(run: FinishedRun) -> tuple[str, str]:
    """(dataset, model) artifact names. The dataset is named by its fingerprint, so runs trained on
    the same data use the same dataset artifact; the model by the run, so each launch of one run
    adds a version of it."""
    fingerprint = str(run.data_metadata.get("data_fingerprint", ""))[:16]
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", run.name)
    return (f"data-{fingerprint}" if fingerprint else f"{safe}-data"), f"{safe}-model"


def publish_wandb(wandb_run: Any, run: FinishedRun, step: int) -> None:
    """Log the dataset (as the run's input), the model (as its output), the generations at `step`
    and the summary to an open W&B run."""
    import wandb

    data_name, model_name = artifact_names(run)
    report = run.data_report()
    if report is not None:
        dataset = wandb.Artifact(data_name, type="dataset", metadata=run.data_metadata)
        with dataset.new_file("data_report.json", encoding="utf-8") as handle:  # a small, redacted copy
            handle.write(report)
        _use_artifact(wandb_run, dataset)
    model = wandb.Artifact(model_name, type="model", metadata={**run.model_metadata, "summary": run.summary})
    # final/ never changes once the run finished: "immutable" references its files in place instead
    # of copying a model of many GB into W&B's staging folder before the upload (or, offline,
    # until `wandb sync`; an extended run replaces final/, so sync an offline run before extending it).
    model.add_dir(str(run.paths.final), policy="immutable")
    wandb_run.log_artifact(model)
    if run.samples:
        columns: list[str | int] = ["prompt", "completion"]
        if _has_reference(run):
            columns.append("reference")
        rows = [[s.prompt, s.completion, s.reference][: len(columns)] for s in run.samples]
        wandb_run.log({TABLE_KEY: wandb.Table(columns=columns, data=rows)}, step=step)
    wandb_run.summary.update(run.summary)


def _use_artifact(wandb_run: Any, artifact: Any) -> None:
    """The artifact as the run's input. Offline, `use_artifact` refuses ("Cannot use artifact when in
    offline mode"), although for a new artifact all it does is log it with `use_after_commit=True`:
    the record that marks the artifact as used once it is committed, which an offline run keeps in its
    .wandb file for `wandb sync`. This private call is what use_artifact makes (wandb 0.31);
    tests/test_sink_artifacts.py fails if an upgrade stops writing that record."""
    if not wandb_run.offline:
        wandb_run.use_artifact(artifact)
        return
    wandb_run._log_artifact(artifact, is_user_created=True, use_after_commit=True)


def publish_mlflow(client: Any, run_id: str, run: FinishedRun) -> str:
    """Log the dataset input, the data report, the generations, the summary and the logged model
    to an MLflow run; returns the logged model's id."""
    from mlflow.entities import LoggedModelOutput

    report = run.data_report()
    if report is not None:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "data_report.json").write_text(report, encoding="utf-8")
            client.log_artifact(run_id, str(Path(tmp) / "data_report.json"), "data")
        _log_dataset_input(client, run_id, run)
    if run.samples:
        table: dict[str, list[str | None]] = {
            "prompt": [s.prompt for s in run.samples],
            "completion": [s.completion for s in run.samples],
        }
        if _has_reference(run):
            table["reference"] = [s.reference for s in run.samples]
        client.log_table(run_id, table, TABLE_FILE)
    client.log_dict(run_id, run.summary, "summary.json")
    model_id = _log_model(client, run_id, run)
    client.log_outputs(run_id, [LoggedModelOutput(model_id, run.step)])
    return model_id


def _log_dataset_input(client: Any, run_id: str, run: FinishedRun) -> None:
    """The data as the run's training input, named and digested by its fingerprint."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    dataset = Dataset(
        name=artifact_names(run)[0],
        digest=str(run.data_metadata.get("data_fingerprint", "unknown"))[:36],  # MLflow's digest limit
        source_type="local",
        source=json.dumps({"uri": run.paths.data_report.resolve().as_uri()}),
        profile=None,
    )
    client.log_inputs(run_id, datasets=[DatasetInput(dataset, [InputTag("mlflow.data.context", "train")])])


def _log_model(client: Any, run_id: str, run: FinishedRun) -> str:
    """final/ as an MLflow 3 LoggedModel of the run, with the summary as its metrics.

    No MLflow flavor: mlflow.transformers would load the model again and infer pip requirements (a
    subprocess, and the network where there is one). A LoggedModel holding final/'s files is MLflow 3's
    model entity without them; `mlflow.artifacts.download_artifacts("models:/<id>")` gives back the HF
    directory. final/ is stored there only, not a second time among the run's own artifacts."""
    experiment_id = client.get_run(run_id).info.experiment_id
    params = {k: str(v) for k, v in run.model_metadata.items() if k in ("stage", "adapter", "base_model")}
    tags = {f"lmforge.{k}": str(v) for k, v in run.model_metadata.items() if k not in params}
    stage = run.model_metadata.get("stage")
    kind = "reward-model" if stage is not None and stage_spec(stage).head == "score" else "causal-lm"
    model = client.create_logged_model(
        experiment_id,
        name=artifact_names(run)[1],
        source_run_id=run_id,
        params=params,
        tags=tags,
        model_type=kind,
    )
    try:
        client.log_model_artifacts(model.model_id, str(run.paths.final))
        for key, value in run.summary.items():
            client.log_metric(run_id, key, float(value), step=run.step, model_id=model.model_id)
    except Exception:
        client.finalize_logged_model(model.model_id, "FAILED")  # not left PENDING: its files are partial
        raise
    client.finalize_logged_model(model.model_id, "READY")
    return str(model.model_id)


def _has_reference(run: FinishedRun) -> bool:
    return any(s.reference is not None for s in run.samples)
