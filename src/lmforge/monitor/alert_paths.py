"""Keeping local absolute paths out of what goes to an alert webhook.

Paths name users and machines. `LocalPaths` rewrites every absolute path in an event before
`lmforge.monitor.alerts` sends it: a path under the run directory becomes relative to it,
any other path its base name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

# An absolute path inside text: POSIX (/a/b) or Windows (C:\a, C:/a). Not a URL's path nor a
# ratio ("tok/s", "1/2"): the path starts where no word character, slash, colon or dot precedes.
_ABSOLUTE_PATH = re.compile(r"(?<![\w/:.~-])(?:/|[A-Za-z]:[\\/])[^\s'\"`<>|,;()\[\]{}]+")
# A string that is one absolute path and nothing else (spaces allowed, no sentence punctuation).
_WHOLE_PATH = re.compile(r"(?:/|[A-Za-z]:[\\/])[^\n:;,'\"<>|*?]+")
_PATH_SEPARATORS = re.compile(r"[\\/]+")


class LocalPaths:
    """Rewrites absolute local paths in what goes to a webhook: under the run directory,
    relative to it; any other, its base name.

    Without `run_dir`, a path component equal to the run's name marks the run directory
    (run.dir is output_dir/name), so paths in the run still come out relative to it.
    """

    def __init__(self, run_dir: Path | None, run_name: str) -> None:
        self.run_name = run_name
        roots = {str(run_dir), os.path.abspath(run_dir), str(run_dir.resolve())} if run_dir else set()
        absolute = sorted((r.rstrip("/\\") for r in roots if _WHOLE_PATH.fullmatch(r)), key=len, reverse=True)
        self.roots = absolute
        # A root in running text, then a separator (dropped: what follows is relative) or the
        # root's end (the run directory itself). Matched textually: run dirs may hold spaces.
        self._root_in_text = [
            re.compile(r"(?<![\w/.~-])" + re.escape(root) + r"(?:[\\/]|(?![\w.~-]))") for root in absolute
        ]

    def hide_in(self, event: dict[str, Any]) -> dict[str, Any]:
        """A copy of `event` whose strings hold no absolute local path."""
        # Fields that are a whole path (the stall event's `stacks`) also appear in the message,
        # spaces and all; replacing them verbatim first keeps such paths whole.
        whole = {v for v in _strings(event) if _WHOLE_PATH.fullmatch(v)}
        known = sorted(whole, key=len, reverse=True)
        result: dict[str, Any] = self._rewrite(event, known)
        return result

    def _rewrite(self, value: Any, known: list[str]) -> Any:
        if isinstance(value, dict):
            return {k: self._rewrite(v, known) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._rewrite(v, known) for v in value]
        if not isinstance(value, str):
            return value
        for path in known:
            value = value.replace(path, self.shorten(path))
        for pattern in self._root_in_text:
            value = pattern.sub(lambda m: "" if m.group(0)[-1] in "/\\" else self.run_name, value)
        return _ABSOLUTE_PATH.sub(lambda m: self._shorten_match(m.group(0)), value)

    def shorten(self, path: str) -> str:
        """`path` relative to the run directory when it is in it, else its base name."""
        for root in self.roots:
            if path == root:
                return self.run_name
            if path.startswith(root) and path[len(root)] in "/\\":
                return path[len(root) + 1 :]
        parts = [p for p in _PATH_SEPARATORS.split(path) if p and not p.endswith(":")]
        if not self.roots and self.run_name in parts[:-1]:
            inside = len(parts) - parts[::-1].index(self.run_name)
            return "/".join(parts[inside:])
        return parts[-1] if parts else path

    def _shorten_match(self, found: str) -> str:
        # Sentence punctuation right after a path is not part of it ("written to /a/b.").
        path = found.rstrip(".:!?")
        return self.shorten(path) + found[len(path) :] if path else found


def _strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []
