"""A limit on request bodies (`--max-body-bytes`): 413 before the body is read.

A body whose Content-Length is over the limit is refused at once: the 413 is sent before
any of the body is read. One sent without a length (chunked) is counted as it arrives and
refused when it passes the limit. Without this a 10 MB body was read, parsed and
tokenized whole (seconds of the event loop, and memory never returned) before its 400.

Most clients (Python's urllib, requests, httpx and so the `openai` SDK) write the whole
body before they read anything. Closing the connection with body bytes unread makes the
kernel reset it, and such a client then sees `Connection reset by peer`, not the 413 (the
SDK retries a network error, uploading the body again). So after the 413 is sent the
rest of the body is read and dropped (`_drain`), chunk by chunk (uvicorn hands out at
most its 64 KiB high-water mark at a time: nothing is held), within `MAX_DRAIN_BYTES`
and `MAX_DRAIN_SECONDS`; only then is the answer ended and the connection closed.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import HTTPException

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# What is read and dropped of a refused body, at most, so that the client reads its 413:
# a body declared larger than this is not waited for (the client may see a reset).
MAX_DRAIN_BYTES = 64 * 1024 * 1024
MAX_DRAIN_SECONDS = 10.0


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
            await _refuse(send, self.max_bytes, receive, int(length))
            return
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    if message.get("more_body", False):
                        await _drain(receive, MAX_DRAIN_BYTES)
                    raise HTTPException(413, _too_large(self.max_bytes))
            return message

        await self.app(scope, counted_receive, send)


async def _drain(receive, max_bytes: int) -> None:
    """Read and drop what is left of a request body, up to `max_bytes` and
    MAX_DRAIN_SECONDS; returns at its end, or when the client leaves."""
    deadline = time.monotonic() + MAX_DRAIN_SECONDS
    drained = 0
    while drained <= max_bytes:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return  # http.disconnect
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _refuse(send, max_bytes: int, receive, declared_bytes: int) -> None:
    """The 413 for a body declared `declared_bytes` long, sent before it is read; the
    body is then drained (when not too large to wait for) before the answer ends."""
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
    await send({"type": "http.response.body", "body": body, "more_body": True})
    if declared_bytes <= MAX_DRAIN_BYTES:
        await _drain(receive, declared_bytes)
    await send({"type": "http.response.body", "body": b""})
