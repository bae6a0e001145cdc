"""events/events.jsonl: what happened to a run (guardrail actions, alerts, the end), one JSON line each.

Every event has `time`, `step`, `kind` and `message`; listeners (the alert sender, the
Prometheus counters) see each event after it is on disk.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmforge.config.redact import redact_text

log = logging.getLogger(__name__)
EVENTS_FILE = "events.jsonl"
Listener = Callable[[dict[str, Any]], object]
# Events that report the normal course of a run: logged at INFO, the others (guardrail actions,
# alerts, stops) at WARNING.
ROUTINE_KINDS = frozenset({"finished"})


class EventLog:
    def __init__(self, events_dir: Path, listeners: list[Listener] | None = None) -> None:
        events_dir.mkdir(parents=True, exist_ok=True)
        self.path = events_dir / EVENTS_FILE
        self.listeners = list(listeners or [])

    def emit(self, kind: str, step: int, message: str, **fields: Any) -> dict[str, Any]:
        """Append one event (secrets redacted from its message), log it, and tell the listeners."""
        event = {
            "time": time.time(),
            "step": int(step),
            "kind": kind,
            "message": redact_text(message),
            **fields,
        }
        try:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(event, default=str) + "\n")
        except OSError as err:  # a full disk must not hide the error being reported
            log.error("could not record the %s event in %s: %s", kind, self.path, err)
        level = logging.INFO if kind in ROUTINE_KINDS else logging.WARNING
        log.log(level, "[%s] step %d: %s", kind, step, event["message"])
        for listener in self.listeners:
            try:
                listener(event)
            except Exception as err:  # a broken listener never stops training
                log.error("event listener %r failed: %s", listener, redact_text(str(err)))
        return event


def read_events(events_dir: Path) -> list[dict[str, Any]]:
    """Every event of a run directory's events/ (torn lines skipped)."""
    path = events_dir / EVENTS_FILE
    events = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events
