"""Every command's --help, rendered the way a user sees it."""

from __future__ import annotations

import re
from typing import Any

import typer
from typer.testing import CliRunner

from lmforge.cli.main import app

PLACEHOLDER = re.compile(r"\\?<([A-Za-z_][A-Za-z_ ]*)>")


def _commands(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    found = [(path, command)]
    if hasattr(command, "commands"):  # a group (typer's own click types)
        for name, sub in command.commands.items():
            found += _commands(sub, (*path, name))
    return found


def test_help_keeps_angle_bracket_placeholders_for_every_command() -> None:
    # Help is rendered as markdown, where a bare <name> is an HTML tag and vanished: `push --help`
    # showed "versioned DIR///" and `quickstart --help` "/train.log".
    root = typer.main.get_command(app)
    runner = CliRunner()
    checked = 0
    for path, command in _commands(root):
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        wanted = {f"<{m}>" for text in texts for m in PLACEHOLDER.findall(text)}
        if not wanted:
            continue
        shown = runner.invoke(app, [*path, "--help"], terminal_width=200).output
        missing = sorted(p for p in wanted if p not in shown)
        assert not missing, f"lmforge {' '.join(path)} --help lost {missing}"
        checked += 1
    assert checked >= 4  # push, report, doctor, eval, train (through --verbose) at least
