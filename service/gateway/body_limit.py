"""A limit on request bodies (`--max-body-bytes`): 413 before the body is read.

A body whose Content-Length is over the limit is refused at once, its bytes unread; one
sent without a length (chunked) is counted as it arrives and refused when it passes the
limit. Without this a 10 MB body was read, parsed and tokenized whole (seconds of the
event loop, and memory never returned) before its 400.
"""

from __future__ import annotations

import json

from fastapi import HTTPException

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def _too_large(max_bytes: int) -> str:
    return f"the request body is larger than {max_bytes} bytes (--max-body-bytes)"


class BodyLimitMiddleware:
    """ASGI middleware: see the module docstring."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _refuse(send, self.max_bytes)
            return
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, _too_large(self.max_bytes))
            return message

        await self.app(scope, counted_receive, send)


async def _refuse(send, max_bytes: int) -> None:
    body = json.dumps(
        {
            "error": {
                "message": _too_large(max_bytes),
                "type": "invalid_request_error",
                "param": None,
                "code": "request_too_large",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
