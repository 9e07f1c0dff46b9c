"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the right status."""
from __future__ import annotations

import json

from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          500: "server_error", 503: "server_unavailable"}


class APIError(Exception):
    """Raised by a handler; answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def response(status: int, message: str, param: str | None = None, code: str | None = None,
             headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body(status, message, param, code), status_code=status, headers=headers)


def raw(status: int, message: str, code: str | None = None, headers: list | None = None) -> tuple[dict, bytes]:
    """An error as ASGI start and body messages' parts, for middleware below the app."""
    data = json.dumps(body(status, message, None, code)).encode()
    return ({"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
             + (headers or [])}, data)
