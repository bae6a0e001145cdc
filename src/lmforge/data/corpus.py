"""Built-in corpora: text that exists on every machine with Python and needs no network.

`builtin:python-stdlib` is the Python standard library's own `.py` source files, one
document per file, in sorted path order so every run sees the same stream. Test
directories (`test/`, `tests/`, `idle_test/`) are left out: Debian-style distributions
ship them in a separate package, so including them would make the corpus differ between
machines with the same Python version. Machine-generated files (`_sysconfigdata_*`) and
installed packages (`site-packages`, `dist-packages`) are left out for the same reason.
Generated data tables are left out too: `encodings/` is mostly code-page tables of hex
literals and `pydoc_data/` one huge string dump; a model trained on them babbles hex.
"""

from __future__ import annotations

import functools
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

from lmforge.errors import UserInputError

BUILTIN_PREFIX = "builtin:"

# Directory names whose contents are not part of the corpus (see the module docstring).
_EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "lib-dynload",
        "encodings",
        "pydoc_data",
    }
)


@functools.cache  # the stdlib does not change while we run; walking it takes ~0.5 s
def _python_stdlib_files() -> tuple[Path, ...]:
    """The standard library's `.py` files, sorted by their path relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for path in root.rglob("*.py")
        if not _EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1])
        and not path.name.startswith("_sysconfigdata")
        and path.is_file()
    ]
    return tuple(sorted(files, key=lambda path: path.relative_to(root).as_posix()))


# Name (without the `builtin:` prefix) -> function listing the corpus files in order.
_CORPORA: dict[str, Callable[[], tuple[Path, ...]]] = {"python-stdlib": _python_stdlib_files}


def builtin_names() -> list[str]:
    """Every valid built-in corpus name, with its `builtin:` prefix."""
    return [BUILTIN_PREFIX + name for name in sorted(_CORPORA)]


def is_builtin(path: str) -> bool:
    """True when a source path names a built-in corpus rather than a file."""
    return path.startswith(BUILTIN_PREFIX)


def _corpus_key(name: str) -> str:
    key = name.removeprefix(BUILTIN_PREFIX)
    if key not in _CORPORA:
        raise UserInputError(
            f"unknown built-in corpus {name!r}; valid names: {', '.join(builtin_names())}. "
            "Fix: use one of these as the source path, or point the path at your own files."
        )
    return key


def builtin_files(name: str) -> list[Path]:
    """The files of built-in corpus `name` (with or without the `builtin:` prefix), in corpus order."""
    files = list(_CORPORA[_corpus_key(name)]())
    if not files:
        raise UserInputError(
            f"built-in corpus {name!r} is empty on this machine (no .py files under "
            f"{sysconfig.get_paths()['stdlib']}). Fix: use your own text files as the data source."
        )
    return files


def builtin_version(name: str) -> str:
    """A string that changes whenever the corpus content may change (for cache fingerprints)."""
    key = _corpus_key(name)
    # The stdlib is fixed per Python build; the file count guards against partial installs.
    return f"{BUILTIN_PREFIX}{key}|python {sys.version}|files {len(builtin_files(name))}"


def iter_builtin_documents(name: str) -> Iterator[str]:
    """Yield the documents of built-in corpus `name` (for example `builtin:python-stdlib`).

    One document per source file. Undecodable bytes (rare; the stdlib is UTF-8) are
    replaced rather than failing, since the user cannot fix the Python installation.
    """
    for path in builtin_files(name):
        yield path.read_text(encoding="utf-8", errors="replace")
