"""Send run events to a chat webhook (generic JSON, Slack, Feishu/Lark, DingTalk), rate-limited.

`AlertSender` is an EventLog listener: events whose kind is in `monitor.alerts.kinds` are
POSTed, at most one per kind per `window_seconds` (the rest are counted and mentioned in the
next alert of that kind). The webhook URL holds a token, so it is a secret: it never appears
in a log line, an exception, an event or a file. Local absolute paths (they name users and
machines) never leave either: a path under the run directory goes out relative to it, any
other as its base name. A failed send logs a redacted warning and never raises: alerting
must not stop training.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.config.redact import REDACTED, redact_text
from lmforge.config.schema import AlertsConfig
from lmforge.errors import UserInputError
from lmforge.monitor.alert_paths import LocalPaths

log = logging.getLogger(__name__)
_MIN_SECRET_PART = 4  # shorter URL parts ("v1", "api") are not worth hiding and would garble text


@dataclass
class AlertStats:
    """What the sender did, per event kind."""

    sent: dict[str, int] = field(default_factory=dict)
    suppressed: dict[str, int] = field(default_factory=dict)  # rate-limited, never sent
    failed: dict[str, int] = field(default_factory=dict)


class AlertSender:
    """POST events to a webhook; call it with an event dict (it is an EventLog listener).

    `on_sent(event, status)` runs after each successful send, for example to emit an
    `alert_sent` event; the sender itself emits nothing. Sends are synchronous and bounded
    by `timeout_seconds` so that `finished` / `failed` alerts leave before the process exits.
    """

    def __init__(
        self,
        cfg: AlertsConfig,
        run_name: str,
        on_sent: Callable[[dict[str, Any], int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        run_dir: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_name = run_name
        self.paths = LocalPaths(run_dir, run_name)
        self.on_sent = on_sent
        self._clock = clock
        self._url = resolve_webhook_url(cfg)
        self._secrets = _url_secrets(self._url)
        self._host = urllib.parse.urlsplit(self._url).hostname or "?"
        self._last_attempt: dict[str, float] = {}
        self._pending_suppressed: dict[str, int] = {}
        self._lock = threading.Lock()
        self.stats = AlertStats()

    def __call__(self, event: dict[str, Any]) -> bool:
        """Send `event` if its kind is alerted and its window is free; True when the webhook accepted it."""
        kind = str(event.get("kind", ""))
        if kind not in self.cfg.kinds:
            return False
        with self._lock:
            now = self._clock()
            last = self._last_attempt.get(kind)
            if last is not None and now - last < self.cfg.window_seconds:
                self._pending_suppressed[kind] = self._pending_suppressed.get(kind, 0) + 1
                _bump(self.stats.suppressed, kind)
                return False
            # The window starts at the attempt, sent or not: a dead webhook costs at most one
            # timeout per kind per window, never one per event.
            self._last_attempt[kind] = now
            suppressed = self._pending_suppressed.pop(kind, 0)
        payload = build_payload(self.cfg.format, self.run_name, self.paths.hide_in(event), suppressed)
        status = self._post(payload)
        with self._lock:
            _bump(self.stats.sent if status else self.stats.failed, kind)
        if status and self.on_sent is not None:
            try:
                self.on_sent(event, status)
            except Exception as err:  # the hook is the caller's; its failure is not the alert's
                log.warning("alert on_sent hook failed: %s", self.redact(str(err)))
        return bool(status)

    def redact(self, text: str) -> str:
        """`text` with the webhook URL, its path and query values, and env secrets removed."""
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return redact_text(text)

    def _post(self, payload: dict[str, Any]) -> int:
        """POST the payload; the HTTP status on success, 0 on any failure (logged, redacted)."""
        body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        request = urllib.request.Request(
            self._url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json; charset=utf-8", "User-Agent": "lmforge-alerts"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_seconds) as response:
                status = int(response.status)
                reply = response.read(65536).decode("utf-8", "replace")
        except urllib.error.HTTPError as err:
            reason = f"HTTP {err.code} {err.reason}"
        except Exception as err:  # URLError, timeouts, connection resets, bad URLs: never raise
            reason = f"{type(err).__name__}: {err}"
        else:
            problem = _reply_problem(reply)
            if problem is None:
                return status
            reason = f"HTTP {status} but the webhook refused it: {problem}"
        log.warning(
            "alert to webhook on host %s not sent (%s)",
            self.redact(self._host),
            self.redact(reason),
        )
        return 0


def resolve_webhook_url(cfg: AlertsConfig) -> str:
    """The webhook URL from `webhook_url` or the variable named by `webhook_url_env`."""
    if cfg.webhook_url_env:
        url = os.environ.get(cfg.webhook_url_env, "").strip()
        if not url:
            raise UserInputError(
                f"monitor.alerts.webhook_url_env: the environment variable {cfg.webhook_url_env} is not set "
                f"or empty; export {cfg.webhook_url_env}=<webhook URL> or remove monitor.alerts.webhook_url_env"
            )
        key = "monitor.alerts.webhook_url_env"
    elif cfg.webhook_url:
        url, key = cfg.webhook_url.strip(), "monitor.alerts.webhook_url"
    else:
        raise UserInputError(
            "monitor.alerts: no webhook; set monitor.alerts.webhook_url_env to the name of an environment "
            "variable holding the URL (or monitor.alerts.webhook_url)"
        )
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme not in ("http", "https") or not urllib.parse.urlsplit(url).hostname:
        # The message names the key, never the value: the value is a secret.
        raise UserInputError(f"{key}: the webhook URL must be an http:// or https:// URL with a host")
    return url


def alerts_configured(cfg: AlertsConfig) -> bool:
    """Whether the user asked for alerts at all (a webhook URL or its variable is set)."""
    return bool(cfg.webhook_url or cfg.webhook_url_env)


def build_payload(fmt: str, run_name: str, event: dict[str, Any], suppressed: int = 0) -> dict[str, Any]:
    """The JSON body for one event in the webhook's own shape."""
    text = alert_text(run_name, event, suppressed)
    if fmt == "slack":
        return {"text": text}
    if fmt == "feishu":
        return {"msg_type": "text", "content": {"text": text}}
    if fmt == "dingtalk":
        return {"msgtype": "text", "text": {"content": text}}
    return {"run": run_name, "text": text, "suppressed": suppressed, "event": _json_safe(event)}


def alert_text(run_name: str, event: dict[str, Any], suppressed: int = 0) -> str:
    """One human line: "[lmforge] run: kind at step N: message" (+ how many similar were held back)."""
    text = (
        f"[lmforge] {run_name}: {event.get('kind', '?')} at step {event.get('step', '?')}: "
        f"{event.get('message', '')}"
    )
    if suppressed:
        text += f" ({suppressed} more '{event.get('kind')}' alert(s) suppressed since the last one)"
    return redact_text(text)


def _reply_problem(reply: str) -> str | None:
    """Feishu and DingTalk answer HTTP 200 with an error code in the body; Slack answers "ok"."""
    try:
        body = json.loads(reply)
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    for code_key, msg_key in (("code", "msg"), ("errcode", "errmsg"), ("StatusCode", "StatusMessage")):
        code = body.get(code_key)
        if isinstance(code, int) and code != 0:
            return f"{code_key}={code} {body.get(msg_key, '')}".strip()
    return None


def _url_secrets(url: str) -> list[str]:
    """The URL and every part of it that may carry a token, longest first (so replacements nest)."""
    parts = urllib.parse.urlsplit(url)
    secrets = {url, url.rstrip("/"), parts.path + ("?" + parts.query if parts.query else ""), parts.query}
    secrets.update(segment for segment in parts.path.split("/"))
    for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        secrets.update({value, urllib.parse.quote(value, safe=""), f"{name}={value}"})
    if parts.password:
        secrets.add(parts.password)
    return sorted((s for s in secrets if len(s) >= _MIN_SECRET_PART), key=len, reverse=True)


def _json_safe(value: Any) -> Any:
    """Strict JSON: NaN/inf become strings, unknown objects their str()."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    return redact_text(str(value))


def _bump(counter: dict[str, int], kind: str) -> None:
    counter[kind] = counter.get(kind, 0) + 1
