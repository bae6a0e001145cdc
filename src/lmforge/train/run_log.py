"""<run>/train.log: every log record of the run at full detail, with the upstream notices
that the console leaves out (lmforge/verbosity.py says which).

A DeepSpeed ZeRO-3 run on CPU printed about 1,900 `FutureWarning` lines (torch.distributed's
renamed collectives, transformers' renamed arguments) that a user cannot act on. Python warnings
are routed through logging; train.log gets each distinct warning once (with a count at the end).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from lmforge.run_layout import RunPaths
from lmforge.verbosity import (
    DEPRECATIONS,
    ENGINE_INTERNALS,
    QUIET_CONSOLE,
    message_category,
    warning_category,
)

log = logging.getLogger(__name__)


class _OncePerMessage(logging.Filter):
    """train.log: a warning repeated from a hot loop is written once and counted."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        if warning_category(record) is None:
            return True
        key = record.getMessage()
        self.seen[key] += 1
        return self.seen[key] == 1


class _RankZeroWarns(logging.Filter):
    """The console of a rank other than 0: Python warnings are rank 0's to show, once (every rank
    raises the same ones, so N processes printed each N times), and go to train.log there."""

    def filter(self, record: logging.LogRecord) -> bool:
        return warning_category(record) is None


_RANK_ZERO_WARNS = _RankZeroWarns()


@contextmanager
def run_log(paths: RunPaths, *, is_main: bool) -> Iterator[None]:
    """While training: Python warnings go through logging; rank 0 writes train.log (appended to
    on a resume), and no rank's console shows upstream notices without an action."""
    root = logging.getLogger()
    # The command line already filters its console; a run started from Python gets the filter here.
    consoles = [handler for handler in root.handlers if QUIET_CONSOLE not in handler.filters]
    for handler in consoles:
        handler.addFilter(QUIET_CONSOLE)
    others = [] if is_main else [h for h in root.handlers if not isinstance(h, logging.FileHandler)]
    for handler in others:
        handler.addFilter(_RANK_ZERO_WARNS)
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
        internal = {m: n for m, n in once.seen.items() if ENGINE_INTERNALS.search(m.split(": ", 1)[0])}
        if internal:
            log.info(
                "%d torch.distributed warning(s), %d distinct, are in %s (not on the console)",
                sum(internal.values()),
                len(internal),
                paths.log_file,
            )
        quiet = {
            m: n for m, n in once.seen.items() if message_category(m) in DEPRECATIONS and m not in internal
        }
        if quiet:
            log.info(
                "%d upstream deprecation warning(s), %d distinct, are in %s (not on the console)",
                sum(quiet.values()),
                len(quiet),
                paths.log_file,
            )
        for handler in consoles:
            handler.removeFilter(QUIET_CONSOLE)
        for handler in others:
            handler.removeFilter(_RANK_ZERO_WARNS)
        if file_handler is not None:
            root.removeHandler(file_handler)
            file_handler.close()
