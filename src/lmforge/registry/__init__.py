"""The model registry: a finished run's model pushed with its model card and lineage.

    push_run(run_dir, "registry/")                        -> registry/<name>/<version>/
    push_run(run_dir, "mlflow:/abs/mlflow")               -> an MLflow run + registered model version
                                                             (SQLite: /abs/mlflow/mlflow.db)
    push_run(run_dir, "hf://owner/name")                   -> a Hub commit (HF_TOKEN from the environment)
    list_models("registry/") / show_version("registry/", "name", "2")

Every push carries README.md (a Hugging Face model card) and lineage.json (`lineage.py`): code,
resolved config with secrets redacted, data and tokenizer fingerprints, base model, training
summary, evals, export verdicts and the sha256 of every model file, checked against the hash
manifest training sealed final/ with (`seal.py`): a final/ edited after training is never pushed.
"""

from __future__ import annotations

from lmforge.errors import UserInputError
from lmforge.registry.lineage import LINEAGE_NAME, build_lineage, model_files, read_lineage
from lmforge.registry.local import list_local, show_local
from lmforge.registry.mlflow_registry import list_mlflow, show_mlflow
from lmforge.registry.model_card import render_model_card
from lmforge.registry.push import push_run
from lmforge.registry.records import ModelRow, PushResult, VersionInfo, summary_rows
from lmforge.registry.targets import HubTarget, LocalTarget, MlflowTarget, parse_target


def list_models(registry: str) -> list[ModelRow]:
    """The models a local registry directory or an MLflow registry (mlflow:URI) holds."""
    target = _readable(registry)
    return list_local(target.root) if isinstance(target, LocalTarget) else list_mlflow(target)


def show_version(
    registry: str, name: str, version: str | None = None, *, verify: bool = False
) -> VersionInfo:
    """One version (the latest when `version` is None) with its lineage record; `verify` re-hashes
    its files (`VersionInfo.intact` is False, and `integrity` says why, when one differs)."""
    target = _readable(registry)
    if isinstance(target, LocalTarget):
        return show_local(target.root, name, version, verify=verify)
    return show_mlflow(target, name, version, verify=verify)


def _readable(registry: str) -> LocalTarget | MlflowTarget:
    target = parse_target(registry, option="--registry")
    if isinstance(target, HubTarget):
        raise UserInputError(
            f"--registry {target.display}: the Hub is browsed at https://huggingface.co/{target.repo_id}; "
            "lmforge lists local registry directories and MLflow registries"
        )
    return target


__all__ = [
    "LINEAGE_NAME",
    "ModelRow",
    "PushResult",
    "VersionInfo",
    "build_lineage",
    "list_models",
    "model_files",
    "parse_target",
    "push_run",
    "read_lineage",
    "render_model_card",
    "show_version",
    "summary_rows",
]
