"""<run>/train.log: every log record of the run at full detail, with the upstream deprecation
warnings that the console leaves out.

A DeepSpeed ZeRO-3 run on CPU printed about 1,900 `FutureWarning` lines (torch.distributed's
renamed collectives, transformers' renamed arguments) that a user cannot act on. Python warnings
are routed through logging; FutureWarning and DeprecationWarning go to train.log only (each
distinct message once, with a count at the end), everything else still reaches the console.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from lmforge.run_layout import RunPaths

log = logging.getLogger(__name__)

# How logging.captureWarnings formats a warning: "<file>:<line>: <Category>: <message>".
_CATEGORY = re.compile(r":\d+: (\w+): ")
_QUIET_CATEGORIES = ("FutureWarning", "DeprecationWarning", "PendingDeprecationWarning")


def _category_of(message: str) -> str | None:
    found = _CATEGORY.search(message)
    return found.group(1) if found else None


def _category(record: logging.LogRecord) -> str | None:
    """The warning category of a record logging.captureWarnings made (None for any other record)."""
    return _category_of(record.getMessage()) if record.name == "py.warnings" else None


class _NoDeprecations(logging.Filter):
    """Console: upstream deprecation notices stay out (they are in train.log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _category(record) not in _QUIET_CATEGORIES


class _OncePerMessage(logging.Filter):
    """train.log: a warning repeated from a hot loop is written once and counted."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        if _category(record) is None:
            return True
        key = record.getMessage()
        self.seen[key] += 1
        return self.seen[key] == 1


@contextmanager
def run_log(paths: RunPaths, *, is_main: bool) -> Iterator[None]:
    """While training: Python warnings go through logging; rank 0 writes train.log (appended to
    on a resume), and no rank's console shows deprecation warnings."""
    root = logging.getLogger()
    console_filter = _NoDeprecations()
    consoles = list(root.handlers)
    for handler in consoles:
        handler.addFilter(console_filter)
    file_handler: logging.FileHandler | None = None
    once = _OncePerMessage()
    if is_main:
        file_handler = logging.FileHandler(paths.log_file, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        file_handler.addFilter(once)
        root.addHandler(file_handler)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        quiet = {m: n for m, n in once.seen.items() if _category_of(m) in _QUIET_CATEGORIES}
        if quiet:
            log.info(
                "%d upstream deprecation warning(s), %d distinct, are in %s (not on the console)",
                sum(quiet.values()),
                len(quiet),
                paths.log_file,
            )
        for handler in consoles:
            handler.removeFilter(console_filter)
        if file_handler is not None:
            root.removeHandler(file_handler)
            file_handler.close()
