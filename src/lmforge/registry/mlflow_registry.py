"""The MLflow model registry: a push is an MLflow run that holds the model as artifacts (with its
model card and lineage.json), params (the redacted config) and metrics (the evals), and a new
version of the registered model whose source is that run's `model/` artifact folder.

Works with a tracking server (mlflow:http://host:5000), a SQLite database (mlflow:DIR is
DIR/mlflow.db with the artifacts in DIR/artifacts/; MLflow's client and UI read it back with no
setting) and MLflow's file store (mlflow:file:///abs/mlruns; MLflow 3 keeps it behind
MLFLOW_ALLOW_FILE_STORE, set here for file: URIs only, and anyone reading it with MLflow's own
tools must set it too). MLflow's telemetry stays off unless the
environment says otherwise. A tracking URI may hold credentials: it is never written into a pushed
file, and every error message shows it without them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmforge.ckpt.atomic import sha256_file
from lmforge.config.dotted import flatten
from lmforge.config.redact import secret_env_values
from lmforge.errors import UserInputError, WorkFailed
from lmforge.registry.bundle import finish_bundle, refuse_secrets, stage_model
from lmforge.registry.lineage import LINEAGE_NAME, LineageFor, ModelFiles, hash_files, read_lineage
from lmforge.registry.records import ModelRow, PushResult, VersionInfo, row_for
from lmforge.registry.targets import MlflowTarget, safe_uri

EXPERIMENT = "lmforge-registry"
ARTIFACT_DIR = "model"
_PARAM_CHARS = 6000  # MLflow's limit on a param value
_BATCH = 100  # MLflow takes at most 100 params per log_batch
_TAG_KEYS = {
    "lmforge.run": ("run", "name"),
    "lmforge.data_fingerprint": ("data", "fingerprint"),
    "lmforge.tokenizer_fingerprint": ("tokenizer", "fingerprint"),
    "lmforge.base_model": ("base_model", "name_or_path"),
    "lmforge.stage": ("training", "stage"),
    "lmforge.method": ("training", "method"),
}


def push_mlflow(
    model: ModelFiles,
    lineage_for: LineageFor,
    target: MlflowTarget,
    name: str,
    *,
    extra_secrets: tuple[str, ...] = (),
) -> PushResult:
    """Log `model` in a new MLflow run and register it as the next version of `name`. A push that
    fails before its version is registered deletes its run: no half-logged model is left behind."""
    if target.database is not None:  # SQLite creates the file, not the directory it lies in
        try:
            target.database.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserInputError(
                f"--to {target.display}: cannot create {target.database.parent}: {err.strerror or err}"
            ) from None
    with tempfile.TemporaryDirectory(prefix="lmforge-push-") as tmp, mlflow_client(target) as client:
        folder = Path(tmp) / ARTIFACT_DIR
        folder.mkdir()
        stage_model(model, folder, link=True)
        refuse_secrets(folder, secret_env_values() | set(extra_secrets))  # before any run exists
        hashes = hash_files({n: folder / n for n in model.files})
        lineage = lineage_for(hashes, {"registry": "mlflow"})  # checks final/'s seal: before any run exists
        run = client.create_run(
            _experiment_id(client, target), run_name=f"push {name}", tags={"lmforge.registry_name": name}
        )
        run_id = run.info.run_id
        try:
            load_from = f"runs:/{run_id}/{ARTIFACT_DIR}"
            finish_bundle(folder, lineage, load_from=load_from, extra_secrets=extra_secrets)
            client.log_artifacts(run_id, str(folder), ARTIFACT_DIR)
            _log_params_and_metrics(client, run_id, lineage)
            client.set_terminated(run_id, "FINISHED")
            _ensure_registered_model(client, name)
            version = client.create_model_version(
                name,
                source=f"{run.info.artifact_uri}/{ARTIFACT_DIR}",
                run_id=run_id,
                tags=version_tags(lineage),
                description=_description(lineage),
            )
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to report
                client.delete_run(run_id)
            raise
    return PushResult(
        registry=target.display,
        name=name,
        version=str(version.version),
        location=f"models:/{name}/{version.version}",
        files=len(hashes),
        bytes=sum(int(entry["bytes"]) for entry in hashes.values()),
    )


def list_mlflow(target: MlflowTarget) -> list[ModelRow]:
    """Every registered model, with its versions and the latest one's metric (from its tags)."""
    rows = []
    _check_database(target)
    with mlflow_client(target) as client:
        for registered in _registered_models(client):
            versions = client.search_model_versions(f"name='{_quoted(registered.name)}'")
            if not versions:
                continue
            ordered = sorted(versions, key=lambda v: int(v.version))
            latest = ordered[-1]
            row = row_for(
                registered.name, [str(v.version) for v in ordered], None, _iso(latest.creation_timestamp)
            )
            metric, _, value = (latest.tags or {}).get("lmforge.best_metric", "").partition("=")
            if value:
                row.metric, row.value = metric, float(value)
            rows.append(row)
    return sorted(rows, key=lambda r: r.name)


def show_mlflow(target: MlflowTarget, name: str, version: str | None, *, verify: bool = False) -> VersionInfo:
    """One version (the latest when `version` is None) and the lineage.json logged with it; `verify`
    downloads the model and re-hashes every file against the sha256 its lineage.json records."""
    _check_database(target)
    with mlflow_client(target) as client:
        versions = sorted(
            client.search_model_versions(f"name='{_quoted(name)}'"), key=lambda v: int(v.version)
        )
        if not versions:
            raise UserInputError(f"{target.display}: no registered model named {name!r}")
        chosen = [v for v in versions if str(v.version) == version] if version else versions[-1:]
        if not chosen:
            listed = ", ".join(str(v.version) for v in versions)
            raise UserInputError(f"{name}:{version}: no such version in {target.display}; versions: {listed}")
        found = chosen[0]
        if not found.run_id:
            raise UserInputError(f"{name}:{found.version} was not pushed by lmforge (no run behind it)")
        integrity, problem = str(found.status), ""
        with tempfile.TemporaryDirectory(prefix="lmforge-show-") as tmp:
            if verify:
                folder = Path(client.download_artifacts(found.run_id, ARTIFACT_DIR, tmp))
                lineage = read_lineage(folder / LINEAGE_NAME)
                problem = _mismatch(folder, lineage)
                integrity = problem or "ok (every file re-hashed against lineage.json)"
            else:
                path = client.download_artifacts(found.run_id, f"{ARTIFACT_DIR}/{LINEAGE_NAME}", tmp)
                lineage = read_lineage(Path(path))
    return VersionInfo(
        registry=target.display,
        name=name,
        version=str(found.version),
        location=f"models:/{name}/{found.version}",
        created=_iso(found.creation_timestamp),
        integrity=integrity,
        lineage=lineage,
        intact=not problem,
    )


def _mismatch(folder: Path, lineage: dict[str, Any]) -> str:
    """What differs between the downloaded model files and the sha256 lineage.json records ("": nothing)."""
    for name, entry in sorted(((lineage.get("model") or {}).get("files") or {}).items()):
        path = folder / name
        if not path.is_file():
            return f"missing file {name}"
        if sha256_file(path) != entry.get("sha256"):
            return f"hash mismatch in {name}"
    return ""


def version_tags(lineage: dict[str, Any]) -> dict[str, str]:
    """The lineage fields a registry browser filters by, as model-version tags."""
    tags = {}
    for tag, (section, key) in _TAG_KEYS.items():
        value = (lineage.get(section) or {}).get(key)
        if value is not None:
            tags[tag] = str(value)[:_PARAM_CHARS]
    git = ((lineage.get("lmforge") or {}).get("git") or {}).get("commit")
    if git:
        tags["lmforge.git_commit"] = str(git)
    best = (lineage.get("evaluation") or {}).get("best")
    if best:
        tags["lmforge.best_metric"] = f"{best['metric']}={best['value']}"
    return tags


@contextmanager
def mlflow_client(target: MlflowTarget) -> Iterator[Any]:
    """An MlflowClient on `target`. MLflow's own errors become WorkFailed without credentials.

    The global tracking URI is pointed at `target` for the duration: MLflow's file-store registry
    opens a default client internally (mlflow/store/model_registry/file_store.py), which would
    otherwise create ./mlflow.db in the working directory."""
    settings = {
        "MLFLOW_DISABLE_TELEMETRY": os.environ.get("MLFLOW_DISABLE_TELEMETRY", "true"),
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": os.environ.get(
            "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false"
        ),
    }
    if target.is_file_store:
        settings["MLFLOW_ALLOW_FILE_STORE"] = "true"
    with _environment(settings):  # before the import: MLflow starts its telemetry client on import
        try:
            import mlflow
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise UserInputError("MLflow registries need MLflow: pip install 'lmforge[mlflow]'") from None
        # MLflow mirrors its tracking URI into MLFLOW_TRACKING_URI, so the environment is what this
        # process was configured with; MLflow's module-level copy can be stale (it outlives the
        # variable), and restoring that copy would leave the variable set for every later process.
        previous_uri = os.environ.get("MLFLOW_TRACKING_URI") or None
        mlflow.set_tracking_uri(target.uri)
        try:
            yield MlflowClient(tracking_uri=target.uri, registry_uri=target.uri)
        except MlflowException as err:  # connection failures too: "API request to ... failed ..."
            raise WorkFailed(
                f"MLflow at {target.display}: {_without_credentials(str(err), target)}"
            ) from None
        finally:
            mlflow.set_tracking_uri(previous_uri)  # type: ignore[arg-type]  # None unsets it again


def _registered_models(client: Any) -> Iterator[Any]:
    """Every registered model, page by page (MLflow returns at most 100 per call)."""
    token = None
    while True:
        page = client.search_registered_models(max_results=100, page_token=token)
        yield from page
        token = page.token
        if not token:
            return


def _check_database(target: MlflowTarget) -> None:
    """Reading a SQLite registry that is not there would create an empty database: refuse instead."""
    if target.database is not None and not target.database.is_file():
        raise UserInputError(
            f"--registry {target.display}: no MLflow database at {target.database}; pass the target "
            "`lmforge push --to` wrote (mlflow:DIR reads DIR/mlflow.db)"
        )


def _experiment_id(client: Any, target: MlflowTarget) -> str:
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment:
        return str(experiment.experiment_id)
    return str(client.create_experiment(EXPERIMENT, artifact_location=target.artifact_location))


def _ensure_registered_model(client: Any, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(
            name, description="Registered by `lmforge push`; each version has its lineage."
        )


def _log_params_and_metrics(client: Any, run_id: str, lineage: dict[str, Any]) -> None:
    from mlflow.entities import Metric, Param

    flat = flatten(lineage.get("config") or {})
    params = [Param(key[:250], _param_text(value)) for key, value in sorted(flat.items())]
    for start in range(0, len(params), _BATCH):
        client.log_batch(run_id, params=params[start : start + _BATCH])
    metrics = []
    now = int(time.time() * 1000)
    evaluation = lineage.get("evaluation") or {}
    for key, entry in (evaluation.get("last") or {}).items():
        metrics.append(Metric(key, float(entry["value"]), now, int(entry["step"])))
    best = evaluation.get("best")
    if best:
        metrics.append(Metric(f"best_{best['metric']}", float(best["value"]), now, int(best["step"])))
    loss = (lineage.get("training") or {}).get("final_loss")
    if isinstance(loss, int | float):
        metrics.append(
            Metric("final_loss", float(loss), now, int((lineage.get("training") or {}).get("steps") or 0))
        )
    if metrics:
        client.log_batch(run_id, metrics=metrics)


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:_PARAM_CHARS]


def _description(lineage: dict[str, Any]) -> str:
    training = lineage.get("training") or {}
    best = (lineage.get("evaluation") or {}).get("best")
    evaluation = f"; best {best['metric']} {best['value']:.4g}" if best else ""
    return (
        f"lmforge run {(lineage.get('run') or {}).get('name')}: {training.get('stage')} / {training.get('method')}, "
        f"{training.get('steps')} steps; data {str((lineage.get('data') or {}).get('fingerprint'))[:12]}{evaluation}. "
        f"Full lineage: {ARTIFACT_DIR}/{LINEAGE_NAME}"
    )


def _quoted(name: str) -> str:
    return name.replace("'", "\\'")


def _iso(epoch_ms: Any) -> str | None:
    if not isinstance(epoch_ms, int | float):
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(epoch_ms / 1000))


def _without_credentials(text: str, target: MlflowTarget) -> str:
    text = text.replace(target.uri, safe_uri(target.uri))
    return re.sub(r"//[^/@\s]+@", "//", text)


@contextmanager
def _environment(settings: dict[str, str]) -> Iterator[None]:
    before = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
