"""The HTTP routes (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics (its path is a setting; it may be off). Each /v1 route authenticates (api_keys.py,
with --api-keys), checks and plans (answers.py), binds an idempotency key to its body
(idempotency.py), follows the sequence (generations.py) and shapes the OpenAI response;
errors leave as OpenAI error JSON (errors.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.gateway.answers import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    Delta,
    Finish,
    Plan,
    plan,
    text_events,
)
from service.gateway.api_keys import ANONYMOUS, ApiKeys, Principal, bearer_key
from service.gateway.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from service.gateway.chat_prompt import chat_prompt_ids
from service.gateway.chat_template import ChatTemplateError
from service.gateway.errors import GatewayError, bad_request
from service.gateway.generations import Generation, Generations
from service.gateway.idempotency import IdempotencyKeys
from service.gateway.logprobs import ChatLogprobs, CompletionLogprobs, merge
from service.gateway.metrics import GatewayMetrics, MetricsMiddleware
from service.gateway.model_files import ModelFiles
from service.gateway.protocol import ChatCompletionRequest, CompletionRequest, TextError
from service.gateway.responses import ChatShape, CompletionShape, WholeChoice, sse_event
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
    api_keys: ApiKeys | None = None  # None: no keys checked, one anonymous principal
    idempotency: IdempotencyKeys = field(default_factory=IdempotencyKeys)
    metrics_path: str | None = "/metrics"  # None: no metrics route
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def principal(self, request: Request) -> Principal:
        """Who sent `request`; 401 unless it carries a known key (with --api-keys)."""
        if self.api_keys is None:
            return ANONYMOUS
        key = bearer_key(request.headers.get("authorization"))
        principal = self.api_keys.lookup(key) if key is not None else None
        if principal is None:
            raise GatewayError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'"
                if key is None
                else "the API key is not known to this gateway",
                code="invalid_api_key",
                retryable=False,
            )
        return principal


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(
        title="Lattice Scheduler OpenAI-compatible gateway",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=gateway.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=gateway.metrics)
    _add_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        problem = await gateway.link.check_health()
        if problem is not None:
            return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    if gateway.metrics_path is not None:

        @app.api_route(gateway.metrics_path, methods=["GET", "HEAD"])
        async def metrics() -> Response:
            return Response(generate_latest(gateway.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {
            "id": gateway.served_model_name,
            "object": "model",
            "created": gateway.started_at,
            "owned_by": "lattice-scheduler",
            "max_model_len": gateway.max_model_len,
        }

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request) -> dict:
        gateway.principal(request)
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str, request: Request) -> dict:
        gateway.principal(request)
        _check_model(gateway, model_id)
        return model_card()

    @app.post(COMPLETIONS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        principal = gateway.principal(request)
        _check_model(gateway, body.model)
        prompt = body.single_prompt()
        if isinstance(prompt, str):  # off the loop: a long prompt delays nobody else
            prompt_ids = await asyncio.to_thread(
                gateway.files.encode, prompt, add_special_tokens=True
            )
        else:
            prompt_ids = _checked_token_ids(prompt, gateway.files.vocab_size)
        request_id = _request_id(request)
        works = [
            plan(
                body,
                prompt_ids,
                max_new_tokens=body.max_tokens,
                default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
                files=gateway.files,
                max_model_len=gateway.max_model_len,
                request_id=request_id,
                principal=principal,
                choice=choice,
            )
            for choice in range(body.num_choices)
        ]
        works = _keyed(gateway, works, principal, request_id)
        shape = CompletionShape(gateway.served_model_name, body.include_usage)
        echo_text = None
        if body.echo:
            echo_text = prompt if isinstance(prompt, str) else gateway.files.decode(prompt_ids)
        return await _answer(
            gateway, request, COMPLETIONS, works, shape, bool(body.stream), request_id, echo_text
        )

    @app.post(CHAT_COMPLETIONS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        principal = gateway.principal(request)
        _check_model(gateway, body.model)
        template = gateway.files.chat_template
        if template is None:
            raise bad_request(
                "this model has no chat template (tokenizer_config.json "
                "chat_template); use /v1/completions",
                "messages",
            )
        try:
            prompt_ids = await asyncio.to_thread(  # off the loop, as for completions
                chat_prompt_ids,
                gateway.files,
                template,
                [m.for_template() for m in body.messages],
                body.chat_template_kwargs,
            )
        except ChatTemplateError as err:
            raise bad_request(str(err), "messages") from None
        request_id = _request_id(request)
        works = [
            plan(
                body,
                prompt_ids,
                max_new_tokens=body.max_new_tokens,
                default_max_tokens=None,
                files=gateway.files,
                max_model_len=gateway.max_model_len,
                request_id=request_id,
                principal=principal,
                choice=choice,
            )
            for choice in range(body.num_choices)
        ]
        works = _keyed(gateway, works, principal, request_id)
        shape = ChatShape(gateway.served_model_name, body.include_usage)
        return await _answer(
            gateway, request, CHAT_COMPLETIONS, works, shape, bool(body.stream), request_id
        )

    return app


def _check_model(gateway: Gateway, model: str) -> None:
    if model != gateway.served_model_name:
        raise GatewayError(
            404,
            f"the model {model!r} does not exist here; this server serves "
            f"{gateway.served_model_name!r}",
            param="model",
            code="model_not_found",
        )


def _checked_token_ids(token_ids: list[int], vocab_size: int) -> list[int]:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt"
        )
    return token_ids


def _keyed(gateway: Gateway, works: list[Plan], principal: Principal, key: str) -> list[Plan]:
    """`works` (one per choice) under the scheduler request_ids of `key` (scoped by
    principal, bound to the body: a 422 for another body under a known key)."""
    attempts = gateway.idempotency.keyed([w.attempt for w in works], principal.name, key)
    return [replace(work, attempt=attempt) for work, attempt in zip(works, attempts)]


def _request_id(request: Request) -> str:
    """The client's idempotency key: Idempotency-Key, else X-Request-Id, else none."""
    return (
        request.headers.get("idempotency-key") or request.headers.get("x-request-id") or ""
    ).strip()


async def _answer(
    gateway: Gateway,
    request: Request,
    endpoint: str,
    works: list[Plan],
    shape: CompletionShape,
    stream: bool,
    request_id: str,
    echo_text: str | None = None,
) -> Response:
    """Follow one sequence per choice (`n`), and answer them as one response. `echo_text`:
    the prompt as each choice starts with it (completions' echo), or None."""
    arrived = time.perf_counter()
    metrics = gateway.metrics
    headers = {"x-request-id": request_id} if request_id else {}
    num_prompt = works[0].num_prompt_tokens
    attached = contextlib.AsyncExitStack()
    try:
        generations = [
            await attached.enter_async_context(gateway.generations.attach(w.attempt)) for w in works
        ]
    except BaseException:
        await attached.aclose()  # the choices opened so far
        raise
    metrics.prompt_tokens.labels(endpoint).inc(num_prompt)
    choices = [
        _Choice.follow(gateway, shape, work, generation, echo_text)
        for generation, work in zip(generations, works)
    ]
    seq_id = generations[0].seq_id
    timed_first = False

    def first_text() -> None:
        nonlocal timed_first
        if not timed_first:
            timed_first = True
            metrics.time_to_first_token.labels(endpoint).observe(time.perf_counter() - arrived)

    if stream:
        body = _sse(
            shape,
            seq_id,
            choices,
            num_prompt,
            first_text,
            lambda num_tokens: metrics.completion_tokens.labels(endpoint).inc(num_tokens),
            lambda: metrics.client_disconnects.labels(endpoint).inc(),
        )
        return _ClosingStream(
            body,
            attached.aclose,
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache"},
        )

    async def collect_one(choice: _Choice) -> WholeChoice:
        pieces, taken, finish = [], [], None
        async for event in choice.events:
            if isinstance(event, Delta):
                first_text()
                pieces.append(event.text)
                taken.append(event)
            else:
                finish = event
        return choice.whole(pieces, taken, finish)

    async def collect() -> dict:
        async with attached:
            answers = await asyncio.gather(*(collect_one(c) for c in choices))
        metrics.completion_tokens.labels(endpoint).inc(
            sum(a.finish.num_completion_tokens for a in answers)
        )
        return shape.whole(seq_id, list(answers), num_prompt)

    try:
        answer = await _unless_disconnected(request, collect())
    except ClientGone:
        metrics.client_disconnects.labels(endpoint).inc()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        await attached.aclose()  # also when `collect` was cancelled before it started
    return JSONResponse(answer, headers=headers)


async def _merged(
    streams: list[AsyncIterator[Delta | Finish]],
) -> AsyncIterator[tuple[int, Delta | Finish]]:
    """(choice index, event) from every stream, as they come; the first GatewayError of any
    of them is raised. The readers stop when the consumer does."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, events: AsyncIterator[Delta | Finish]) -> None:
        try:
            async for event in events:
                await queue.put((index, event))
            await queue.put((index, done))
        except GatewayError as err:
            await queue.put((index, err))

    readers = [asyncio.create_task(pump(i, events)) for i, events in enumerate(streams)]
    try:
        remaining = len(readers)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, GatewayError):
                raise item
            else:
                yield index, item
    finally:
        for reader in readers:
            reader.cancel()


async def _sse(
    shape: CompletionShape,
    seq_id: int,
    choices: list[_Choice],
    num_prompt: int,
    on_first_text: Callable[[], None],
    on_finished: Callable[[int], None],
    on_disconnect: Callable[[], None],
) -> AsyncIterator[str]:
    """Server-sent events: chunks of every choice as they come, each choice's finish chunk,
    usage if asked (all choices), then [DONE]; an error after the first byte is an
    `error` event (OpenAI clients raise it). With echo, a choice's first chunk is the
    prompt (with its logprobs when asked for)."""
    num_completion = 0
    try:
        for index in range(len(choices)):
            first = shape.first_chunk(seq_id, index)
            if first is not None:
                yield sse_event(first)
        async for index, event in _merged([c.events for c in choices]):
            choice = choices[index]
            echo = choice.take_echo()
            if echo is not None:  # its first token arrived: the prompt's logprobs too
                yield sse_event(shape.chunk(seq_id, echo, None, choice.prompt_logprobs(), index))
            if isinstance(event, Delta):
                on_first_text()
                yield sse_event(
                    shape.chunk(seq_id, event.text, None, choice.logprobs(event), index)
                )
            else:
                num_completion += event.num_completion_tokens
                yield sse_event(shape.chunk(seq_id, "", event.reason, index=index))
        on_finished(num_completion)
        if shape.include_usage:
            yield sse_event(shape.usage_chunk(seq_id, num_completion, num_prompt))
        yield "data: [DONE]\n\n"
    except GatewayError as err:
        yield sse_event(err.body())
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:
        on_disconnect()
        raise


class _Choice:
    """One of the `n` sequences of an answer: its events, and its text and logprobs in the
    response's shape (with echo, the prompt leads)."""

    def __init__(
        self,
        work: Plan,
        generation: Generation,
        events: AsyncIterator[Delta | Finish],
        builder: CompletionLogprobs | ChatLogprobs | None,
        echo_text: str | None,
    ) -> None:
        self.work = work
        self.generation = generation
        self.events = events
        self._builder = builder
        self._echo_text = echo_text
        self._echo_pending = echo_text is not None

    @classmethod
    def follow(
        cls,
        gateway: Gateway,
        shape: CompletionShape,
        work: Plan,
        generation: Generation,
        echo_text: str | None,
    ) -> _Choice:
        events = text_events(
            gateway.generations,
            generation,
            gateway.files,
            work.attempt.stop,
            with_logprobs=work.num_top_logprobs is not None,
            discard_generated=work.discard_generated,
        )
        builder = (
            None
            if work.num_top_logprobs is None
            else shape.logprobs_builder(gateway.files.decode, work.num_top_logprobs)
        )
        return cls(work, generation, events, builder, echo_text)

    def take_echo(self) -> str | None:
        """The echoed prompt the first time it is asked for (streaming), else None."""
        if not self._echo_pending:
            return None
        self._echo_pending = False
        return self._echo_text

    def prompt_logprobs(self) -> dict | None:
        """The echoed prompt's logprobs (call once the first token has arrived)."""
        if self._builder is None:
            return None
        prompt_ids = self.work.attempt.generation.prompt_token_ids
        entries = list(self.generation.prompt_logprobs)
        if len(entries) != len(prompt_ids) - 1:  # lost in a scheduler restart
            entries = [None] * (len(prompt_ids) - 1)
        return self._builder.block(prompt_ids, [None, *entries])

    def logprobs(self, delta: Delta) -> dict | None:
        return (
            None
            if self._builder is None
            else self._builder.block(delta.token_ids, delta.logprobs, delta.last_token_chars)
        )

    def whole(self, pieces: list[str], taken: list[Delta], finish: Finish) -> WholeChoice:
        """The answer of a non-streamed request, from all its Deltas."""
        text = "".join(pieces)
        if self._echo_text is not None:
            text = self._echo_text + text
        if self._builder is None:
            return WholeChoice(text, finish)
        blocks = [self.prompt_logprobs()] if self._echo_text is not None else []
        blocks += [
            self._builder.block(d.token_ids, d.logprobs, d.last_token_chars)
            for d in taken
            if d.token_ids
        ]
        return WholeChoice(text, finish, merge(blocks) or self._builder.block((), ()))


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


def _param(loc: tuple) -> str:
    """A pydantic error location as the body's path (`messages[0].role`), without the
    union members pydantic names on the way (`str`, `list[int]`, `function-after[...]`)."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "none"):
            continue
        else:
            path += f".{part}" if path else part
    return path


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, err: GatewayError) -> Response:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers())

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> Response:
        first = err.errors()[0] if err.errors() else {}
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, TextError):
            return await gateway_error(request, bad_request(str(cause), cause.param))
        if first.get("type") == "json_invalid":
            position = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
            where = f" at character {position}" if position is not None else ""
            return await gateway_error(
                request,
                bad_request(
                    "the request body is not valid JSON"
                    f" ({first.get('ctx', {}).get('error', 'JSON decode error')}{where})"
                ),
            )
        where = _param(first.get("loc", ()))
        message = (
            f"{where}: {first.get('msg', 'invalid')}"
            if where
            else first.get("msg", "invalid request body")
        )
        return await gateway_error(request, bad_request(message, where or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        return await gateway_error(request, GatewayError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> Response:
        incident = uuid.uuid4().hex[:12]
        log.exception("internal error %s on %s", incident, request.url.path)
        return await gateway_error(
            request, GatewayError(500, f"internal error {incident}; see the gateway log")
        )
