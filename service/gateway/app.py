"""The HTTP routes (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics. Each route checks and plans (answers.py), follows the sequence (generations.py)
and shapes the OpenAI response; errors leave as OpenAI error JSON (errors.py)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.gateway.answers import (
    COMPLETIONS_DEFAULT_MAX_TOKENS, Delta, Finish, Plan, plan, text_events,
)
from service.gateway.chat_template import ChatTemplateError
from service.gateway.errors import GatewayError, bad_request
from service.gateway.generations import Generations
from service.gateway.logprobs import merge
from service.gateway.metrics import GatewayMetrics, MetricsMiddleware
from service.gateway.model_files import ModelFiles
from service.gateway.protocol import ChatCompletionRequest, CompletionRequest
from service.gateway.responses import ChatShape, CompletionShape, sse_event
from service.gateway.scheduler_link import SchedulerLink

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
# nginx's code for "the client closed the connection before the answer".
CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True)
class Gateway:
    """Everything the routes use, built once per process."""

    files: ModelFiles
    served_model_name: str
    max_model_len: int
    link: SchedulerLink
    generations: Generations
    metrics: GatewayMetrics
    registry: CollectorRegistry
    started_at: int


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="Lattice Scheduler OpenAI-compatible gateway", docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.add_middleware(MetricsMiddleware, metrics=gateway.metrics)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        problem = await gateway.link.check_health()
        if problem is not None:
            return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": gateway.served_model_name, "object": "model", "created": gateway.started_at,
            "owned_by": "lattice-scheduler", "max_model_len": gateway.max_model_len}]}

    @app.post(COMPLETIONS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(gateway, body.model)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = gateway.files.encode(prompt, add_special_tokens=True)
        else:
            prompt_ids = _checked_token_ids(prompt, gateway.files.vocab_size)
        request_id = _request_id(request)
        work = plan(body, prompt_ids, max_new_tokens=body.max_tokens,
                    default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, files=gateway.files,
                    max_model_len=gateway.max_model_len, request_id=request_id)
        shape = CompletionShape(gateway.served_model_name, body.include_usage)
        echo_text = None
        if work.echo or body.echo:
            echo_text = prompt if isinstance(prompt, str) else gateway.files.decode(prompt_ids)
        return await _answer(gateway, request, COMPLETIONS, work, shape, bool(body.stream),
                             request_id, echo_text)

    @app.post(CHAT_COMPLETIONS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(gateway, body.model)
        template = gateway.files.chat_template
        if template is None:
            raise bad_request("this model has no chat template (tokenizer_config.json "
                              "chat_template); use /v1/completions", "messages")
        try:
            text = template.render([m.for_template() for m in body.messages],
                                   extra=body.chat_template_kwargs)
        except ChatTemplateError as err:
            raise bad_request(str(err), "messages") from None
        prompt_ids = gateway.files.encode(text, add_special_tokens=False)
        request_id = _request_id(request)
        work = plan(body, prompt_ids, max_new_tokens=body.max_new_tokens,
                    default_max_tokens=None, files=gateway.files,
                    max_model_len=gateway.max_model_len, request_id=request_id)
        shape = ChatShape(gateway.served_model_name, body.include_usage)
        return await _answer(gateway, request, CHAT_COMPLETIONS, work, shape,
                             bool(body.stream), request_id)

    return app


def _check_model(gateway: Gateway, model: str) -> None:
    if model != gateway.served_model_name:
        raise GatewayError(404, f"the model {model!r} does not exist here; this server serves "
                                f"{gateway.served_model_name!r}", param="model",
                           code="model_not_found")


def _checked_token_ids(token_ids: list[int], vocab_size: int) -> list[int]:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary "
                          f"(0..{vocab_size - 1})", "prompt")
    return token_ids


def _request_id(request: Request) -> str:
    """The client's idempotency key: Idempotency-Key, else X-Request-Id, else none."""
    return (request.headers.get("idempotency-key") or request.headers.get("x-request-id")
            or "").strip()


async def _answer(gateway: Gateway, request: Request, endpoint: str, work: Plan,
                  shape: CompletionShape, stream: bool, request_id: str,
                  echo_text: str | None = None) -> Response:
    """`echo_text`: the prompt as the answer starts with it (completions' echo), or None."""
    arrived = time.perf_counter()
    metrics = gateway.metrics
    headers = {"x-request-id": request_id} if request_id else {}
    attached = contextlib.AsyncExitStack()
    generation = await attached.enter_async_context(gateway.generations.attach(work.attempt))
    metrics.prompt_tokens.labels(endpoint).inc(work.num_prompt_tokens)
    events = text_events(gateway.generations, generation, gateway.files, work.attempt.stop,
                         with_logprobs=work.num_top_logprobs is not None,
                         discard_generated=work.discard_generated)
    builder = (None if work.num_top_logprobs is None
               else shape.logprobs_builder(gateway.files.decode, work.num_top_logprobs))

    def prompt_logprobs() -> dict | None:
        """The echoed prompt's logprobs (call once the first token has arrived)."""
        if builder is None:
            return None
        prompt_ids = work.attempt.generation.prompt_token_ids
        entries = list(generation.prompt_logprobs)
        if len(entries) != len(prompt_ids) - 1:  # lost in a scheduler restart
            entries = [None] * (len(prompt_ids) - 1)
        return builder.block(prompt_ids, [None, *entries])

    def first_text() -> None:
        metrics.time_to_first_token.labels(endpoint).observe(time.perf_counter() - arrived)

    if stream:
        body = _sse(shape, generation.seq_id, events, work.num_prompt_tokens, first_text,
                    lambda finish: metrics.completion_tokens.labels(endpoint).inc(
                        finish.num_completion_tokens),
                    lambda: metrics.client_disconnects.labels(endpoint).inc(),
                    builder, echo_text, prompt_logprobs)
        return _ClosingStream(body, attached.aclose, media_type="text/event-stream",
                              headers={**headers, "cache-control": "no-cache"})

    async def collect() -> dict:
        async with attached:
            pieces, taken, finish = [], [], None
            async for event in events:
                if isinstance(event, Delta):
                    if not pieces:
                        first_text()
                    pieces.append(event.text)
                    taken.append(event)
                else:
                    finish = event
        metrics.completion_tokens.labels(endpoint).inc(finish.num_completion_tokens)
        blocks = [] if echo_text is None or builder is None else [prompt_logprobs()]
        if builder is not None:
            blocks += [builder.block(d.token_ids, d.logprobs) for d in taken if d.token_ids]
        text = "".join(pieces) if echo_text is None else echo_text + "".join(pieces)
        logprobs = None if builder is None else merge(blocks) or builder.block((), ())
        return shape.whole(generation.seq_id, text, finish, work.num_prompt_tokens, logprobs)

    try:
        answer = await _unless_disconnected(request, collect())
    except ClientGone:
        metrics.client_disconnects.labels(endpoint).inc()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        await attached.aclose()  # also when `collect` was cancelled before it started
    return JSONResponse(answer, headers=headers)


async def _sse(shape: CompletionShape, seq_id: int, events: AsyncIterator[Delta | Finish],
               num_prompt: int, on_first_text: Callable[[], None],
               on_finish: Callable[[Finish], None],
               on_disconnect: Callable[[], None], builder=None, echo_text: str | None = None,
               prompt_logprobs: Callable[[], dict | None] = lambda: None) -> AsyncIterator[str]:
    """Server-sent events: chunks, the finish chunk, usage if asked, then [DONE]; an error
    after the first byte is an `error` event (OpenAI clients raise it). With `echo_text`,
    the first chunk is the prompt (with its logprobs when asked for)."""
    sent_text = False
    try:
        first = shape.first_chunk(seq_id)
        if first is not None:
            yield sse_event(first)
        async for event in events:
            if echo_text is not None:  # the first token arrived: the prompt's logprobs too
                yield sse_event(shape.chunk(seq_id, echo_text, None, prompt_logprobs()))
                echo_text = None
            if isinstance(event, Delta):
                if not sent_text:
                    on_first_text()
                    sent_text = True
                logprobs = None if builder is None else builder.block(event.token_ids,
                                                                      event.logprobs)
                yield sse_event(shape.chunk(seq_id, event.text, None, logprobs))
            else:
                on_finish(event)
                yield sse_event(shape.chunk(seq_id, "", event.reason))
                if shape.include_usage:
                    yield sse_event(shape.usage_chunk(seq_id, event, num_prompt))
        yield "data: [DONE]\n\n"
    except GatewayError as err:
        yield sse_event(err.body())
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:
        on_disconnect()
        raise


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends (also when the client left
    before the first byte, when the body iterator never starts)."""

    def __init__(self, content, on_close: Callable[[], Awaitable[None]], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _unless_disconnected(request: Request, work: Awaitable):
    """The result of `work`; ClientGone (and `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, err: GatewayError) -> Response:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers())

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> Response:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid')}" if where else \
            first.get("msg", "invalid request body")
        return await gateway_error(request, bad_request(message, where or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        return await gateway_error(request, GatewayError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> Response:
        incident = uuid.uuid4().hex[:12]
        log.exception("internal error %s on %s", incident, request.url.path)
        return await gateway_error(request, GatewayError(
            500, f"internal error {incident}; see the gateway log"))
