"""`lmforge push RUN_DIR --to TARGET` and `lmforge registry list|show`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from lmforge.cli.console import console

REGISTRY_HELP = (
    "A local registry directory, mlflow:DIR (a local MLflow registry: DIR/mlflow.db, SQLite) or mlflow:URI "
    "(mlflow:http://host:5000, mlflow:sqlite:////abs/mlflow.db; mlflow: alone reads MLFLOW_TRACKING_URI)."
)


def push(
    run_dir: Path = typer.Argument(..., help="A finished run directory (runs/\\<name>).", show_default=False),
    to: str = typer.Option(
        ...,
        "--to",
        help="Where to register the model: a directory (versioned DIR/\\<name>/\\<version>/), mlflow:DIR (a "
        "local MLflow registry, SQLite in DIR/mlflow.db), mlflow:URI, or hf://owner/name (needs a network "
        "and HF_TOKEN in the environment).",
        show_default=False,
    ),
    name: str | None = typer.Option(
        None,
        "--name",
        help="Registered model name (default: the run's run.name; on the Hub, the repository).",
        show_default=False,
    ),
    public: bool = typer.Option(
        False, "--public", help="hf:// only: create a new Hub repository public (default: private)."
    ),
    allow_unsealed: bool = typer.Option(
        False,
        "--allow-unsealed",
        help="Push a final/ that has no hash manifest (written by an older lmforge): its files are not "
        "checked against what training wrote, and lineage.json records model.sealed: false.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """Register a finished run's model with a model card (README.md) and its lineage (lineage.json):
    lmforge version and git commit, the resolved config (secrets redacted), data and tokenizer
    fingerprints, base model, training summary, evals, export verdicts and every file's sha256.

    final/ must be exactly what training sealed (its hash manifest): a file changed, added or removed
    since stops the push with exit code 1, naming the file.

    Example: `lmforge push runs/sft --to registry/ --name tiny-chat`
    """
    from lmforge.registry import push_run

    result = push_run(run_dir, to, name=name, private=not public, allow_unsealed=allow_unsealed)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    console.print(
        f"pushed {result.name} version {result.version} to {result.registry}: {result.location} "
        f"({result.files} model files, {result.bytes / 2**20:.1f} MiB, with README.md and lineage.json)",
        markup=False,
    )


registry_app = typer.Typer(
    help="What a model registry holds: a local registry directory or MLflow.", no_args_is_help=True
)


@registry_app.command("list")
def registry_list(
    registry: str = typer.Option("registry", "--registry", help=REGISTRY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
) -> None:
    """List the registered models: name, versions, the latest version's date and best eval metric.

    Example: `lmforge registry list --registry mlflow:/srv/mlflow --json`
    """
    from lmforge.registry import list_models

    rows = list_models(registry)
    if as_json:
        print(json.dumps([row.to_json() for row in rows], indent=2))
        return
    if not rows:
        console.print(f"no models in {registry}", markup=False)
        return
    console.print(_models_table(rows))


@registry_app.command("show")
def registry_show(
    model: str = typer.Argument(
        ..., help="NAME or NAME:VERSION (default: the latest version).", show_default=False
    ),
    registry: str = typer.Option("registry", "--registry", help=REGISTRY_HELP),
    verify: bool = typer.Option(
        False,
        "--verify",
        help="Re-hash every file of the version (MLflow: downloads it first); exit code 1 on any mismatch.",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON document on stdout (the whole lineage)."
    ),
) -> None:
    """Show one model version and its lineage: run, code, base model, data and tokenizer
    fingerprints, training summary, evals, export verdicts and files.

    Exit code 1 when the version's files are not what was pushed (a hash mismatch, a missing file).

    Example: `lmforge registry show tiny-chat:2 --registry registry/ --verify`
    """
    from lmforge.errors import WorkFailed
    from lmforge.registry import show_version, summary_rows

    name, version = split_version(model)
    info = show_version(registry, name, version, verify=verify)
    if as_json:
        print(json.dumps(info.to_json(), indent=2, default=str))
    else:
        rows = summary_rows(info)
        width = max(len(label) for label, _ in rows)
        for label, text in rows:
            console.print(f"{label:{width}}  {text}", markup=False)
    if not info.intact:
        raise WorkFailed(
            f"{info.name}:{info.version} in {info.registry}: {info.integrity}: the stored files are not "
            "the ones pushed; do not use this version (push the run again for a new, intact version)"
        )


def split_version(text: str) -> tuple[str, str | None]:
    """NAME:VERSION -> (NAME, VERSION); NAME or NAME:latest -> (NAME, None)."""
    name, colon, version = text.rpartition(":")
    if colon and (version.isdigit() or version == "latest"):
        return name, None if version == "latest" else version
    return text, None


def _models_table(rows: list[Any]) -> Table:
    table = Table(title_justify="left")
    for column in ("name", "versions", "latest", "created", "metric"):
        table.add_column(column, overflow="fold")
    for row in rows:
        metric = f"{row.metric} {row.value:.4g}" if row.metric and row.value is not None else "-"
        table.add_row(row.name, ", ".join(row.versions), row.latest, row.created or "-", metric)
    return table
