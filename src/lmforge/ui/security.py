"""Who may use the UI: the person who started it, on this machine.

- A random token, printed in the URL `lmforge ui` shows (as Jupyter does). Opening that URL sets an
  HttpOnly, SameSite=Strict cookie and redirects to the same page without the token in the address;
  every later request must carry the cookie. Without it: 403 and what to do.
- The Host header must name the address the server listens on (127.0.0.1 / localhost and its
  port): a page elsewhere cannot reach the UI through DNS rebinding.
- Every request that changes something (POST) must also carry the page's CSRF token in the
  `X-CSRF-Token` header, which only the UI's own page can read.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs, urlencode

COOKIE = "lmforge_ui"
CSRF_HEADER = "x-csrf-token"
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Access:
    host: str
    port: int
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(24))

    @property
    def allowed_hosts(self) -> set[str]:
        names = (
            {self.host, "127.0.0.1", "localhost"} if self.host in ("127.0.0.1", "localhost") else {self.host}
        )
        return {f"{name}:{self.port}" for name in names} | names

    def url(self) -> str:
        return f"http://{self.host}:{self.port}/?token={self.token}"


class Guard:
    """ASGI middleware enforcing `Access` in front of the app."""

    def __init__(self, app: App, access: Access) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if headers.get("host", "") not in self.access.allowed_hosts:
            await _plain(send, 400, "unexpected Host header: open the URL `lmforge ui` printed")
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        given = (query.get("token") or [""])[0]
        if given:
            if not secrets.compare_digest(given, self.access.token):
                await _plain(send, 403, "wrong token: open the URL `lmforge ui` printed")
                return
            rest = urlencode({k: v for k, v in query.items() if k != "token"}, doseq=True)
            await _redirect_with_cookie(send, scope["path"] + (f"?{rest}" if rest else ""), self.access.token)
            return
        cookie = SimpleCookie(headers.get("cookie", "")).get(COOKIE)
        if cookie is None or not secrets.compare_digest(cookie.value, self.access.token):
            await _plain(send, 403, "this page needs the token: open the URL `lmforge ui` printed")
            return
        if scope["method"] not in ("GET", "HEAD") and not secrets.compare_digest(
            headers.get(CSRF_HEADER, ""), self.access.csrf
        ):
            await _plain(send, 403, "missing or wrong CSRF token: act from the UI's own page")
            return
        await self.app(scope, receive, send)


async def _plain(send: Send, status: int, text: str) -> None:
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _redirect_with_cookie(send: Send, location: str, token: str) -> None:
    cookie = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
    await send(
        {
            "type": "http.response.start",
            "status": 303,
            "headers": [
                (b"location", location.encode()),
                (b"set-cookie", cookie.encode()),
                (b"content-length", b"0"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": b""})
