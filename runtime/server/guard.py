"""What every request passes before it reaches a handler: a cap on the body's size, the Host
header (against DNS rebinding, when bound to loopback), and the API key.

Pure ASGI, so that an oversized body is refused while it arrives (a chunked upload has no
Content-Length to check), not after it was read into memory.
"""
from __future__ import annotations

import hmac

from . import errors

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
OPEN_PATHS = {"/health"}        # a load balancer's probe needs no key


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_NAMES or host.startswith("127.")


def _host_name(value: str) -> str:
    """The name part of a Host header: 'localhost:8080' -> 'localhost', '[::1]:80' -> '[::1]'."""
    if value.startswith("["):
        return value[:value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    def __init__(self, app, *, api_key: str | None = None, allowed_hosts: set[str] | None = None,
                 max_body: int = 8 << 20):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.allowed_hosts = allowed_hosts          # None: any Host header
        self.max_body = max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.allowed_hosts is not None:
            host = _host_name(headers.get("host", "").strip().lower())
            if host not in self.allowed_hosts:
                return await _refuse(send, 403, f"Host '{host}' is not served here: this server is bound to "
                                                "loopback and answers only requests addressed to it",
                                     "host_not_allowed")
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and scope.get("method") != "OPTIONS":
            auth = headers.get("authorization", "")
            given = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
            if not hmac.compare_digest(given, self.api_key):
                return await _refuse(send, 401, "Incorrect or missing API key: send it as "
                                                "'Authorization: Bearer KEY'", "invalid_api_key",
                                     [(b"www-authenticate", b"Bearer")])
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await _refuse(send, 400, "invalid Content-Length", "invalid_content_length")
            if int(length) > self.max_body:
                return await _refuse(send, 413, f"request body of {int(length)} bytes exceeds the limit of "
                                                f"{self.max_body} bytes", "body_too_large")
        seen = 0
        limit = self.max_body

        async def counted_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge()
            return msg

        started = False

        async def tracked_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await _refuse(send, 413, f"request body exceeds the limit of {limit} bytes", "body_too_large")


class BodyTooLarge(Exception):
    pass


async def _refuse(send, status, message, code, headers=None):
    start, data = errors.raw(status, message, code, headers)
    await send(start)
    await send({"type": "http.response.body", "body": data})
