"""`lmforge sweep CONFIG --space SPACE.yaml`: a hyperparameter search over one config."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from lmforge.cli.console import OVERRIDES_HELP, console


def sweep(
    config: Path = typer.Argument(..., help="YAML config file (the base every trial starts from)."),
    overrides: list[str] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    space: Path = typer.Option(
        ..., "--space", help="YAML mapping config keys to {low, high, log} ranges or lists of choices."
    ),
    trials: int = typer.Option(
        10,
        "--trials",
        help="Trials in the study in all, over every sweep sharing it (a re-run only adds the missing ones).",
    ),
    parallel: int = typer.Option(
        1, "--parallel", help="Trials at once on this machine (they share its cores)."
    ),
    timeout: float | None = typer.Option(
        None,
        "--timeout",
        help="Wall-clock budget in seconds: no new trial starts after it.",
        show_default=False,
    ),
    sampler: str = typer.Option(
        "tpe",
        "--sampler",
        help="tpe (its first 10 trials spread over the space, then modelled), random (every trial "
        "spread: quasi-random) or grid (every key a list of values).",
    ),
    pruner: str = typer.Option("median", "--pruner", help="median, hyperband or none."),
    prune_after: int = typer.Option(
        2, "--prune-after", help="Finished trials before the median pruner may stop one."
    ),
    storage: str | None = typer.Option(
        None,
        "--storage",
        help="Study database: a SQLAlchemy URL (postgresql://..., mysql://...) several machines share; "
        "default sqlite in the sweep directory.",
        show_default=False,
    ),
    study_name: str | None = typer.Option(
        None, "--study-name", help="Default: run.name.", show_default=False
    ),
    metric: str | None = typer.Option(
        None,
        "--metric",
        help="Eval metric to optimise (default: train.best_metric, else eval_loss).",
        show_default=False,
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Sweep directory (default: <run.output_dir>/<run.name>-sweep).",
        show_default=False,
    ),
) -> None:
    """Search hyperparameters with Optuna: each trial is a `lmforge train` run with its own run
    directory; trials that fall behind at an evaluation are pruned; the study lives in a real
    database, so a killed sweep run again continues (finished trials are not repeated) and several
    processes can share one study. Writes best.yaml, summary.csv and sweep.html.

    Example: `lmforge sweep examples/pretrain_tiny.yaml --space examples/sweep/space.yaml --trials 8`
    """
    from lmforge.errors import UserInputError
    from lmforge.sweep.run import SweepOptions, best_trial, run_sweep

    if sampler not in ("tpe", "random", "grid"):
        raise UserInputError(f"--sampler {sampler!r}: choose tpe, random or grid")
    if pruner not in ("median", "hyperband", "none"):
        raise UserInputError(f"--pruner {pruner!r}: choose median, hyperband or none")
    options = SweepOptions(
        trials=trials,
        parallel=parallel,
        timeout_s=timeout,
        sampler=sampler,  # type: ignore[arg-type]
        pruner=pruner,  # type: ignore[arg-type]
        prune_after=prune_after,
        storage=storage,
        study_name=study_name,
        metric=metric,
        out=out,
    )
    result = run_sweep(
        config, overrides or [], space, options, say=lambda line: console.print(line, markup=False)
    )
    from lmforge.report.sweep_page import sweep_summary_rows

    table = Table(title=f"sweep {result.study.study_name}: {result.metric}")
    for column in ("trial", "state", result.metric, *result.study.user_attrs.get("space", []), "run"):
        table.add_column(column)
    for row in sweep_summary_rows(result.study, result.trial_dirs):
        params = row.get("params") or {}
        value = row.get("value")
        table.add_row(
            str(row["number"]),
            str(row["state"]),
            f"{value:.4f}" if isinstance(value, float) else "",
            *(_cell(params.get(k)) for k in result.study.user_attrs.get("space", [])),
            Path(str(row.get("run_dir") or "")).name,
        )
    console.print(table)
    best = best_trial(result.study)
    if best is None:
        console.print("[bold yellow]no trial completed[/]; see the logs in " + str(result.directory / "logs"))
        raise typer.Exit(1)
    console.print(
        f"[bold green]best[/] trial {best.number}: {result.metric} = {best.value:.6g}", highlight=False
    )
    console.print(f"best config: {result.best_config}   (lmforge train {result.best_config})", markup=False)
    console.print(f"study page: {result.page}", markup=False)


def _cell(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, float) else ("" if value is None else str(value))
