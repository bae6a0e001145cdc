"""The layout ARCHITECTURE.md draws holds in the code: imports point one way, down the stack, and
no module imports itself back through others. Function-level imports count: a lazy import is
still a dependency."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lmforge"

# Top to bottom, as ARCHITECTURE.md draws them. A package imports only packages of a lower rank;
# packages of one rank do not import each other.
RANKS = {
    "cli": 11,
    "ui": 10,
    "pipeline": 9,
    "sweep": 9,
    "train": 8,
    "registry": 8,
    "serve": 8,
    "report": 7,
    "export": 6,
    "evaluate": 5,
    "monitor": 4,
    "distributed": 3,
    "ckpt": 2,
    "data": 1,
    "models": 1,
    "config": 0,
}
LEAVES = {
    "errors",
    "upstream",
    "run_layout",
    "verbosity",
}  # shared, below every package; they import no lmforge package


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """(imported lmforge module, line) for every import in the file, relative ones resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            # `from lmforge.x import y` may name a module y: count it as one.
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == "lmforge" or name.startswith("lmforge."):
                yield name, node.lineno


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        graph[module] = {name for name, _ in _imports(path) if name in files and name != module}
    return graph


def _top(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_every_package_has_a_rank() -> None:
    tops = {_top(_module_name(p)) for p in PACKAGE.rglob("*.py")} - {"lmforge"}
    assert tops <= set(RANKS) | LEAVES, f"add {tops - set(RANKS) - LEAVES} to RANKS and ARCHITECTURE.md"


def test_imports_point_down_the_stack() -> None:
    upward = []
    for path in PACKAGE.rglob("*.py"):
        source = _top(_module_name(path))
        for name, line in _imports(path):
            target = _top(name)
            if target == source or target == "lmforge" or target in LEAVES:
                if source in LEAVES and target not in (source, "lmforge"):
                    upward.append(
                        f"{path.relative_to(PACKAGE)}:{line} imports {name} (a leaf imports nothing)"
                    )
                continue
            if source in LEAVES or RANKS.get(source, 99) <= RANKS.get(target, -1):
                upward.append(f"{path.relative_to(PACKAGE)}:{line} ({source}) imports {name} ({target})")
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(set(upward)))


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize(
    "module", ["lmforge.run_layout", "lmforge.config.recorded", "lmforge.report.load", "lmforge.cli.main"]
)
def test_run_readers_start_without_torch(module: str) -> None:
    """`lmforge runs`, `lmforge report` and `--help` answer in a fraction of a second: the
    run-directory layout, the recorded config and the report loader do not pull in torch."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("module", ["lmforge.train.preflight", "lmforge.sweep.run"])
def test_checks_before_training_start_without_the_training_stack(module: str) -> None:
    """`lmforge train` runs the machine checks, and `lmforge sweep` drives its trials, without
    transformers, peft or TRL (about 4 s of imports): a run this machine cannot do is refused in
    about a second, and the sweep's own process stays small."""
    heavy = ("transformers", "peft", "trl")
    code = f"import sys, {module}; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
