"""The gateway's app served by uvicorn on loopback, in this process, over a fake scheduler
link: fast tests of the HTTP edge (keys, idempotency, validation, deadlines) without a
scheduler or a worker process."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from service.gateway.errors import GatewayError
from service.gateway.model_files import ModelFiles
from service.gateway.scheduler_link import (
    FinishReason,
    GenerationRequest,
    TokenEvent,
    _submit_request,
)
from service.gateway.server import GatewaySettings, bind, build_gateway, uvicorn_config
from worker_client.demo_model import build_tokenizer, write_tokenizer_files

LOOPBACK = "127.0.0.1"
MODEL = "tiny"


def write_model(path: Path) -> Path:
    write_tokenizer_files(path, build_tokenizer(512))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    return path


class _Stream:
    def __init__(self, seq_id: int, token_ids: tuple[int, ...]) -> None:
        self.seq_id = seq_id
        self._events = [TokenEvent(token_ids), TokenEvent((), FinishReason.MAX_LENGTH)]

    async def next(self) -> TokenEvent:
        await asyncio.sleep(0)
        if not self._events:
            raise GatewayError(502, "read past the end")
        return self._events.pop(0)

    def cancel(self) -> None:
        pass


@dataclass
class FakeScheduler:
    """Answers every sequence with `answer` (token ids, as many as max_new_tokens allows);
    a known request_id re-attaches to its first seq_id, as the scheduler does. Records
    every request submitted."""

    answer: tuple[int, ...] = (40, 41, 42, 43)
    health_problem: str | None = None
    requests: list[GenerationRequest] = field(default_factory=list)
    seq_ids: dict[str, int] = field(default_factory=dict)

    async def generate(self, request: GenerationRequest) -> _Stream:
        _submit_request(request)  # what the real link sends: out of range raises here too
        self.requests.append(request)
        seq_id = len(self.requests)
        if request.request_id:
            seq_id = self.seq_ids.setdefault(request.request_id, seq_id)
        return _Stream(seq_id, self.answer[: request.max_new_tokens])

    async def cancel(self, seq_id: int, request=None) -> None:
        pass

    async def check_health(self) -> str | None:
        return self.health_problem

    async def close(self) -> None:
        pass


@dataclass
class Answer:
    status: int
    body: dict | None
    headers: dict[str, str]
    text: str = ""


class InProcessGateway:
    """uvicorn on a free loopback port, on a thread of its own; `stop()` at the end."""

    def __init__(self, model_dir: Path, scheduler: FakeScheduler | None = None, **settings) -> None:
        self.scheduler = scheduler or FakeScheduler()
        self.settings = GatewaySettings(
            target="fake", model_dir=model_dir, port=0, served_model_name=MODEL, **settings
        )
        self.gateway = build_gateway(self.settings, ModelFiles(model_dir), self.scheduler)
        import uvicorn

        from service.gateway.app import create_app

        self._sock = bind(LOOPBACK, 0)
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn_config(create_app(self.gateway), self.settings))
        self._thread = threading.Thread(target=self._run, daemon=True, name="gateway")
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "did not start"
            time.sleep(0.01)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
        timeout: float = 10.0,
    ) -> Answer:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        request = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"content-type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, text, got = response.status, response.read().decode(), response.headers
        except urllib.error.HTTPError as err:
            status, text, got = err.code, err.read().decode(), err.headers
        try:
            parsed = json.loads(text) if text else None
        except json.JSONDecodeError:
            parsed = None
        return Answer(
            status,
            parsed if isinstance(parsed, dict) else None,
            {k.lower(): v for k, v in got.items()},
            text,
        )

    def complete(
        self, headers: dict[str, str] | None = None, timeout: float = 10.0, **fields
    ) -> Answer:
        return self.request(
            "POST",
            "/v1/completions",
            {"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields},
            headers=headers,
            timeout=timeout,
        )

    def chat(self, messages, headers: dict[str, str] | None = None, **fields) -> Answer:
        return self.request(
            "POST",
            "/v1/chat/completions",
            {"model": MODEL, "messages": messages, "max_tokens": 4, **fields},
            headers=headers,
        )

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()
