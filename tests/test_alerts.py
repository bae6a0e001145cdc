"""Webhook alerts: one per kind per window, the chat services' payload shapes, failures that never
raise, and a webhook URL (a secret) that never reaches a log line or an error."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmforge.config.schema import ALERT_KINDS, AlertsConfig
from lmforge.errors import UserInputError
from lmforge.monitor.alerts import AlertSender, build_payload
from lmforge.monitor.events import EventLog

TOKEN = "tok_9f8e7d6c5b4a"
PATH_SECRET = "T0SECRETPATH42"


class Receiver:
    """A webhook on 127.0.0.1 that records every POST and answers with a configurable reply."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.status = 200
        self.reply = b"ok"
        self.delay = 0.0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length))
                owner.requests.append({"path": self.path, "body": body, "type": self.headers["Content-Type"]})
                time.sleep(owner.delay)
                try:
                    self.send_response(owner.status)
                    self.end_headers()
                    self.wfile.write(owner.reply)
                except OSError:  # the sender gave up (its timeout) before we answered
                    pass

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/hook/{PATH_SECRET}?access_token={TOKEN}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _event(kind: str, step: int = 7, message: str = "loss is nan") -> dict[str, Any]:
    return {"time": time.time(), "step": step, "kind": kind, "message": message}


def test_one_alert_per_kind_per_window(receiver: Receiver) -> None:
    clock = FakeClock()
    cfg = AlertsConfig(webhook_url=receiver.url, window_seconds=60)
    sender = AlertSender(cfg, "demo", clock=clock)
    results = [sender(_event("nonfinite", step=s)) for s in range(3)]
    results += [sender(_event("spike", step=s)) for s in range(2)]
    assert results == [True, False, False, True, False]
    assert [r["body"]["event"]["kind"] for r in receiver.requests] == ["nonfinite", "spike"]
    assert sender.stats.sent == {"nonfinite": 1, "spike": 1}
    assert sender.stats.suppressed == {"nonfinite": 2, "spike": 1}

    clock.now += 61  # the window has passed: the next one goes, and says what was held back
    assert sender(_event("nonfinite", step=9))
    assert len(receiver.requests) == 3
    last = receiver.requests[-1]["body"]
    assert last["suppressed"] == 2 and "2 more 'nonfinite'" in last["text"]
    assert last["run"] == "demo" and last["event"]["step"] == 9
    assert receiver.requests[-1]["type"].startswith("application/json")


def test_kinds_filter_and_event_log_listener(receiver: Receiver, tmp_path: Path) -> None:
    sent: list[tuple[str, int]] = []
    cfg = AlertsConfig(webhook_url=receiver.url, kinds=["failed"])
    sender = AlertSender(cfg, "demo", on_sent=lambda event, status: sent.append((event["kind"], status)))
    events = EventLog(tmp_path / "events", listeners=[sender])
    events.emit("spike", 3, "loss 9.1 vs mean 2.0")
    events.emit("failed", 4, "RuntimeError: boom")
    assert [r["body"]["event"]["kind"] for r in receiver.requests] == ["failed"]
    assert sent == [("failed", 200)]
    assert "failed" in ALERT_KINDS


@pytest.mark.parametrize(
    ("fmt", "text_of"),
    [
        ("slack", lambda body: body["text"]),
        ("feishu", lambda body: body["content"]["text"] if body["msg_type"] == "text" else None),
        ("dingtalk", lambda body: body["text"]["content"] if body["msgtype"] == "text" else None),
    ],
)
def test_chat_payload_shapes(receiver: Receiver, fmt: str, text_of: Any) -> None:
    sender = AlertSender(AlertsConfig(webhook_url=receiver.url, format=fmt), "demo")  # type: ignore[arg-type]
    assert sender(_event("stall", step=12, message="no step for 900 s"))
    (request,) = receiver.requests
    text = text_of(request["body"])
    assert text == "[lmforge] demo: stall at step 12: no step for 900 s"
    assert set(request["body"]) == set(build_payload(fmt, "demo", _event("stall")))


def _assert_no_secret(text: str) -> None:
    assert TOKEN not in text and PATH_SECRET not in text and "access_token=" not in text


def test_dead_or_refusing_webhook_never_raises_and_never_leaks(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    # Nobody listens on this port any more.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    dead_url = receiver.url.replace(str(receiver.server.server_port), str(dead_port))
    dead = AlertSender(AlertsConfig(webhook_url=dead_url, timeout_seconds=1), "demo")
    assert dead(_event("failed")) is False
    assert dead.stats.failed == {"failed": 1}

    receiver.status = 500
    refused = AlertSender(AlertsConfig(webhook_url=receiver.url), "demo")
    assert refused(_event("failed")) is False

    # Feishu and DingTalk say "no" with HTTP 200 and an error code in the body.
    receiver.status, receiver.reply = 200, b'{"errcode": 310000, "errmsg": "keywords not in content"}'
    ding = AlertSender(AlertsConfig(webhook_url=receiver.url, format="dingtalk"), "demo")
    assert ding(_event("failed")) is False

    receiver.reply, receiver.delay = b"ok", 1.5
    slow = AlertSender(AlertsConfig(webhook_url=receiver.url, timeout_seconds=0.3), "demo")
    started = time.monotonic()
    assert slow(_event("failed")) is False
    assert time.monotonic() - started < 1.4

    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 4
    assert any("310000" in r.getMessage() for r in warnings)
    for record in caplog.records:
        _assert_no_secret(record.getMessage())
    _assert_no_secret(caplog.text)


def test_url_from_env_and_errors_name_the_key_not_the_url(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LMFORGE_TEST_WEBHOOK", receiver.url)
    sender = AlertSender(AlertsConfig(webhook_url_env="LMFORGE_TEST_WEBHOOK"), "demo")
    assert sender(_event("finished", message="done"))
    assert receiver.requests[0]["path"] == f"/hook/{PATH_SECRET}?access_token={TOKEN}"
    _assert_no_secret(sender.redact(f"could not reach {receiver.url}"))

    monkeypatch.delenv("LMFORGE_TEST_WEBHOOK")
    with pytest.raises(UserInputError, match=r"webhook_url_env.*LMFORGE_TEST_WEBHOOK"):
        AlertSender(AlertsConfig(webhook_url_env="LMFORGE_TEST_WEBHOOK"), "demo")

    with pytest.raises(UserInputError) as err:
        AlertSender(AlertsConfig(webhook_url=f"file:///etc/{PATH_SECRET}?access_token={TOKEN}"), "demo")
    assert "monitor.alerts.webhook_url" in str(err.value)
    _assert_no_secret(str(err.value))
