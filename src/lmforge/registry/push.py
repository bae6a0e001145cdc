"""`lmforge push RUN_DIR --to TARGET`: one finished run into a registry, with its model card and lineage."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from lmforge.registry.hub import push_hub
from lmforge.registry.lineage import build_lineage, model_files
from lmforge.registry.local import push_local
from lmforge.registry.mlflow_registry import push_mlflow
from lmforge.registry.records import PushResult
from lmforge.registry.seal import check_final_seal, check_staged
from lmforge.registry.targets import HubTarget, LocalTarget, MlflowTarget, Target, parse_target
from lmforge.report.load import load_run
from lmforge.run_layout import RunPaths


def push_run(
    run_dir: Path,
    to: str | Target,
    *,
    name: str | None = None,
    private: bool = True,
    allow_unsealed: bool = False,
) -> PushResult:
    """Push the model of the finished run in `run_dir` to `to` (a directory, mlflow:URI or
    hf://owner/name) as `name` (default: the run's name; on the Hub, the repository's).

    UserInputError (before anything is written) for an unknown target, a run without a complete
    final/, a final/ without a hash manifest (unless `allow_unsealed`), a missing Hub token or
    MLflow; WorkFailed (nothing pushed) when final/ differs from what training sealed, the registry
    cannot be reached or a staged file would carry a secret."""
    target = parse_target(to) if isinstance(to, str) else to
    model = model_files(run_dir)  # refuses an unfinished run before the registry is touched
    seal = check_final_seal(RunPaths(run_dir).final, model, allow_unsealed=allow_unsealed)
    run = load_run(run_dir, verify_hashes=False)
    registry_name = name or (target.repo_id if isinstance(target, HubTarget) else run.name)
    secrets = _uri_secrets(target)

    def lineage_for(hashes: dict[str, dict[str, Any]], push: dict[str, Any]) -> dict[str, Any]:
        check_staged(seal, model, hashes)  # every target calls this before its version exists
        return build_lineage(run, model, hashes, name=registry_name, push=push, sealed=seal.sealed)

    if isinstance(target, LocalTarget):
        _refuse_inside_run(target.root / registry_name, run_dir)
        return push_local(model, lineage_for, target, registry_name, extra_secrets=secrets)
    if isinstance(target, MlflowTarget):
        return push_mlflow(model, lineage_for, target, registry_name, extra_secrets=secrets)
    return push_hub(model, lineage_for, target, private=private, extra_secrets=secrets)


def _uri_secrets(target: Target) -> tuple[str, ...]:
    """The password and query values of a tracking URI: no pushed file may carry them."""
    if not isinstance(target, MlflowTarget):
        return ()
    parts = urlsplit(target.uri)
    return tuple(v for v in (parts.password, *(value for _, value in parse_qsl(parts.query))) if v)


def _refuse_inside_run(model_dir: Path, run_dir: Path) -> None:
    from lmforge.errors import UserInputError

    target, run = model_dir.resolve(), run_dir.resolve()
    if target == run or run in target.parents or target in run.parents:
        raise UserInputError(
            f"--to {model_dir.parent}: the registry entry {model_dir} would be inside or around the run "
            f"directory {run_dir}; pick a registry directory outside it (for example --to registry/)"
        )
