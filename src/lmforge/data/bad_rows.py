"""The bad-row policy: stop at the first bad row, or quarantine bad rows and fail when too many.

Every reader (`lmforge.data.rows`, `lmforge.data.formats`) reports a row it cannot use as a
`BadRow` with one of the reasons below; this module decides what happens to it. Nothing is
dropped silently: with `on_bad_row: skip` each bad row is written to `bad_rows.jsonl` and
counted, and `finish()` fails when their share exceeds `max_bad_fraction`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Literal

from lmforge.data.examples import BadRow, Example
from lmforge.errors import UserInputError

# The reasons a row is bad; each is one class in the data report and in bad_rows.jsonl.
MALFORMED_JSON = "malformed JSON"
MISSING_FIELD = "missing field"
MISTYPED_FIELD = "mistyped field"
EMPTY_TURN = "empty turn"
WRONG_ROLE_ORDER = "wrong role order"
UNKNOWN_ROLE = "unknown role"
INVALID_UTF8 = "invalid UTF-8"
NUL_BYTE = "NUL byte"
LINE_TOO_LONG = "line too long"

RAW_EXCERPT_CHARS = 2000  # enough to recognise the row in the quarantine file, never a 10 MB line
_TOP_REASONS = 3


def excerpt(text: str, limit: int = RAW_EXCERPT_CHARS) -> str:
    """`text` cut to `limit` characters, marking the cut, for messages and the quarantine file."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"... ({len(text) - limit} more characters)"


class BadRowPolicy:
    """Applies `data.on_bad_row` to a stream of examples and bad rows.

    Use: `kept = policy.filter(stream)`; iterate `kept`; then call `finish()`, which raises
    when too many rows were bad. `counts()` gives the numbers for the data report.
    """

    def __init__(
        self,
        on_bad_row: Literal["error", "skip"],
        max_bad_fraction: float,
        quarantine_path: Path | None = None,
    ) -> None:
        self.on_bad_row = on_bad_row
        self.max_bad_fraction = max_bad_fraction
        self.quarantine_path = quarantine_path
        self.rows_read = 0
        self.rows_kept = 0
        self.bad_by_reason: Counter[str] = Counter()
        self._quarantine: IO[str] | None = None
        self._quarantine_started = False  # first write truncates: a rerun must not append to old rows

    def filter(self, stream: Iterable[Example | BadRow]) -> Iterator[Example]:
        """Yield the examples of `stream`; raise on a bad row (error) or quarantine it (skip)."""
        try:
            for item in stream:
                self.rows_read += 1
                if isinstance(item, BadRow):
                    self._handle_bad(item)
                else:
                    self.rows_kept += 1
                    yield item
        finally:
            self._close_quarantine()

    def _handle_bad(self, row: BadRow) -> None:
        self.bad_by_reason[row.reason] += 1
        if self.on_bad_row == "error":
            raise UserInputError(
                f"{row.message()}. Fix: correct the row, or set data.on_bad_row: skip to quarantine "
                "bad rows to bad_rows.jsonl (the run then fails only when more than "
                f"data.max_bad_fraction={self.max_bad_fraction} of rows are bad)."
            )
        self._write_quarantine(row)

    def _write_quarantine(self, row: BadRow) -> None:
        if self.quarantine_path is None:
            return
        if self._quarantine is None:
            self.quarantine_path.parent.mkdir(parents=True, exist_ok=True)
            mode = "a" if self._quarantine_started else "w"
            self._quarantine = self.quarantine_path.open(mode, encoding="utf-8")
            self._quarantine_started = True
        record = {
            "file": row.origin.file,
            "line": row.origin.line,
            "reason": row.reason,
            "detail": row.detail,
            "raw": excerpt(row.raw),
        }
        self._quarantine.write(json.dumps(record, ensure_ascii=False) + "\n")

    def _close_quarantine(self) -> None:
        if self._quarantine is not None:
            self._quarantine.close()
            self._quarantine = None

    @property
    def rows_bad(self) -> int:
        return sum(self.bad_by_reason.values())

    def top_reasons(self) -> str:
        """The most common reasons with their counts, like 'malformed JSON (3), empty turn (1)'."""
        return ", ".join(f"{reason} ({n})" for reason, n in self.bad_by_reason.most_common(_TOP_REASONS))

    def finish(self) -> None:
        """Raise UserInputError when no row is valid or the bad share exceeds max_bad_fraction."""
        self._close_quarantine()
        where = f"; see {self.quarantine_path}" if self.quarantine_path and self.rows_bad else ""
        if self.rows_kept == 0:
            if self.rows_read == 0:
                raise UserInputError(
                    "0 valid rows of 0: the data sources hold no rows. Fix: point data.train at "
                    "non-empty files."
                )
            raise UserInputError(
                f"0 valid rows of {self.rows_read}; top reasons: {self.top_reasons()}{where}. "
                "Fix: check the source's format and columns settings against the file."
            )
        share = self.rows_bad / self.rows_read
        if share > self.max_bad_fraction:
            raise UserInputError(
                f"{self.rows_bad} of {self.rows_read} rows are bad ({share:.1%}) > "
                f"data.max_bad_fraction={self.max_bad_fraction}; top reasons: {self.top_reasons()}{where}. "
                "Fix: repair the rows, or raise data.max_bad_fraction if losing them is acceptable."
            )

    def counts(self) -> dict[str, Any]:
        """Rows read, kept and bad (total and by reason) for data_report.json."""
        return {
            "rows_read": self.rows_read,
            "rows_kept": self.rows_kept,
            "rows_bad": self.rows_bad,
            "bad_by_reason": dict(self.bad_by_reason.most_common()),
        }
