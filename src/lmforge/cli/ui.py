"""`lmforge ui`: the local web app over the runs in one directory."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from lmforge.cli.console import console

log = logging.getLogger(__name__)


def ui(
    runs: Path = typer.Option(
        Path("runs"), "--runs", help="The directory of run directories the UI shows and writes."
    ),
    registry: str = typer.Option(
        "registry",
        "--registry",
        help="The model registry the UI shows (read-only): a directory `lmforge push --to` wrote, or mlflow:URI.",
    ),
    port: int = typer.Option(8765, "--port", min=1, max=65535, help="TCP port."),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Interface to listen on; anything but 127.0.0.1 is reachable by others."
    ),
) -> None:
    """The web UI: write a run's config with the CLI's validation as you type, launch it (one process
    or several), watch its curves, events and doctor's findings live, stop it (checkpoint, then
    exit), resume or extend it, compare runs, browse sweeps and the registry, chat with the models.
    Runs are ordinary `lmforge train` / `lmforge launch` processes: closing the UI does not stop
    them, and reopening it finds them again.
    Open the printed URL (it carries the access token). Ctrl-C stops the UI.

    Example: `lmforge ui --runs runs`, then open http://127.0.0.1:8765/?token=...
    """
    from lmforge.serve.server import check_port_free, run_app
    from lmforge.ui.app import create_app
    from lmforge.ui.registry import RegistryView
    from lmforge.ui.runs import RunsRoot
    from lmforge.ui.security import Access

    if host != "127.0.0.1":
        log.warning(
            "the UI on %s: anyone who reaches it with the token can start and stop runs; the default is 127.0.0.1",
            host,
        )
    from lmforge.upstream import quiet_progress_bars

    quiet_progress_bars()  # a chat's model load draws no bar in the UI's terminal
    check_port_free(host, port)
    runs.mkdir(parents=True, exist_ok=True)
    access = Access(host, port)
    app = create_app(RunsRoot(runs), access, RegistryView(registry))
    console.print(
        f"lmforge UI for {runs.resolve()}: open {access.url()}  (Ctrl-C stops the UI, not the runs)",
        markup=False,
    )
    run_app(app, host, port)
