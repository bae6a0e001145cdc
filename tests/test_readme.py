"""README.md cannot drift from the command line: every `lmforge` line in its code blocks that does
not train is run (a launch line as its `--dry-run`, which prints the exact command it would start),
the output shown after a `$` line is compared, and every command and flag of the command table
exists in that command's `--help`."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmforge.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Commands that train or load models for minutes, or read what a run pushed: covered by the
# end-to-end tests, not run here.
TRAINING = {"train", "quickstart", "prepare", "eval", "generate", "sweep", "push", "registry"}


@dataclass
class Example:
    line: int
    args: list[str]
    expected: list[str]  # the output shown after a `$` line; empty when none is shown

    @property
    def trains(self) -> bool:
        return self.args[0] in TRAINING and not self.expected


def _blocks() -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every fenced code block, continuation lines joined."""
    blocks, current, start = [], None, 0
    for number, text in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        if text.startswith("```"):
            if current is None:
                current, start = [], number + 1
            else:
                blocks.append((start, current))
                current = None
        elif current is not None:
            if current and current[-1].endswith("\\"):
                current[-1] = current[-1][:-1].rstrip() + " " + text.strip()
            else:
                current.append(text)
    return blocks


def readme_examples() -> list[Example]:
    examples: list[Example] = []
    for start, lines in _blocks():
        for offset, text in enumerate(lines):
            shown = text.startswith("$ lmforge ")
            if not (shown or text.startswith("lmforge ")):
                continue
            args = shlex.split(text.removeprefix("$ "), comments=True)[1:]
            expected = []
            if shown:
                for after in lines[offset + 1 :]:
                    if after.startswith("$ ") or not after.strip():
                        break
                    expected.append(after)
            examples.append(Example(start + offset, args, expected))
    return examples


EXAMPLES = readme_examples()


def _normalised(lines: list[str]) -> list[str]:
    python = str(Path(sys.executable))
    return [" ".join(line.replace(python, ".venv/bin/python").split()) for line in lines if line.strip()]


def test_the_readme_shows_commands_to_run() -> None:
    run = [e for e in EXAMPLES if not e.trains]
    assert len(run) >= 10 and sum(bool(e.expected) for e in EXAMPLES) >= 2


@pytest.mark.parametrize("example", [e for e in EXAMPLES if not e.trains], ids=lambda e: f"line{e.line}")
def test_readme_command_runs_as_shown(example: Example, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "hosts").write_text("10.0.0.1 slots=8\n10.0.0.2 slots=8\n")
    args = list(example.args)
    if args[0] == "launch" and "--dry-run" not in args and "--slurm" not in args:
        args.append("--dry-run")  # the launch it would start, printed: the line parses and plans
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": ""}
    env.pop("OMP_NUM_THREADS")
    result = subprocess.run(
        [sys.executable, "-m", "lmforge.cli.main", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    output = result.stdout + result.stderr
    if example.expected:
        assert _normalised(output.splitlines()) == _normalised(example.expected), output
        assert result.returncode == (2 if output.startswith("error:") else 0)
    else:
        assert result.returncode == 0, f"README.md:{example.line}: lmforge {' '.join(args)}\n{output}"


def _table_commands() -> list[tuple[int, list[str], list[str]]]:
    """(line, command words, flags) of each `lmforge ...` in the README's command table."""
    rows = []
    for number, text in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        if not text.startswith("| `lmforge "):
            continue
        first_cell = text.split(" | ")[0]
        for usage in re.findall(r"`lmforge ([^`]+)`", first_cell):
            words = []
            for token in usage.split():
                if not re.fullmatch(r"[a-z][a-z-]*", token):
                    break
                words.append(token)
            rows.append((number, words, re.findall(r"--[a-z][a-z0-9-]*", usage)))
    return rows


@pytest.mark.parametrize("line,words,flags", _table_commands(), ids=lambda v: str(v))
def test_table_commands_and_flags_exist(line: int, words: list[str], flags: list[str]) -> None:
    result = CliRunner().invoke(app, [*words, "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert result.exit_code == 0, f"README.md:{line}: `lmforge {' '.join(words)}` is not a command"
    missing = [flag for flag in flags if flag not in result.output]
    assert not missing, f"README.md:{line}: `lmforge {' '.join(words)}` has no {missing}"
