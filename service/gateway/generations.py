"""Sequences in flight, each read from one Generate stream and followed by HTTP requests.

A request without an idempotency key gets a sequence of its own, cancelled as soon as its
client leaves. A request with a key (`request_id`) shares the sequence with every retry of
the same key: a retry that arrives while the first attempt is still in flight follows the
same stream from the first token, and a sequence whose followers have all left is
cancelled only after `reattach_grace_seconds`, so that a client retrying after a timeout
or a dropped connection finds it still running. After the sequence ends, a retry goes to
the scheduler, which re-attaches `request_id` to the same sequence and streams it again.
The gateway does the same itself when the scheduler goes away mid-stream (a restart on its
--state-dir): a keyed sequence's stream is re-opened for up to `reconnect_seconds`, the
replayed tokens it already has are skipped, and its followers notice nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from service.gateway.errors import GatewayError
from service.gateway.scheduler_link import (
    FinishReason,
    GenerateStream,
    GenerationRequest,
    SchedulerLink,
    TokenLogprob,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Attempt:
    """What one HTTP request asks of a sequence; retries of a key must ask the same."""

    generation: GenerationRequest
    stop: tuple[str, ...] = ()


class Generation:
    """One sequence's stream, read to the end by a task of its own; followers read its
    tokens from the first one, as often as they like."""

    def __init__(
        self,
        stream: GenerateStream,
        attempt: Attempt,
        reopen: Callable[[Generation], Awaitable[GenerateStream]] | None = None,
    ) -> None:
        """`reopen`: a new stream of the same sequence after this one broke (GatewayError
        if it cannot); None: a broken stream ends the generation."""
        self.seq_id = stream.seq_id
        self.attempt = attempt
        self.token_ids: list[int] = []
        # One per token of token_ids (None where the scheduler sent none) when asked for.
        self.logprobs: list[TokenLogprob | None] = []
        self.prompt_logprobs: tuple[TokenLogprob, ...] = ()
        self.finish_reason: FinishReason | None = None
        self.error_message = ""
        self.error: GatewayError | None = None
        self.num_followers = 0
        self._stream = stream
        self._reopen = reopen
        self._num_replayed = 0  # tokens a re-opened stream sends again, to skip
        self._changed = asyncio.Event()
        self._cancelled = False
        self.reader = asyncio.create_task(self._read(), name=f"generate-{self.seq_id}")

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    async def _read(self) -> None:
        try:
            while self.finish_reason is None:
                try:
                    event = await self._stream.next()
                except GatewayError as err:
                    if self._reopen is None or self._cancelled or not err.scheduler_went_away:
                        raise
                    self._stream = await self._reopen(self)
                    self._num_replayed = len(self.token_ids)
                    if self._cancelled:  # cancelled while it waited for the scheduler
                        raise err from None
                    continue
                skip = min(self._num_replayed, len(event.token_ids))
                self._num_replayed -= skip
                self.token_ids.extend(event.token_ids[skip:])
                if self.attempt.generation.logprobs:
                    self.logprobs.extend(
                        event.logprobs[skip:]
                        if event.logprobs
                        else [None] * (len(event.token_ids) - skip)
                    )
                if event.prompt_logprobs and not self.prompt_logprobs:
                    self.prompt_logprobs = event.prompt_logprobs
                self.finish_reason = event.finish_reason
                self.error_message = event.error_message
                self._wake()
        except GatewayError as err:
            self.error = (
                err
                if not self._cancelled
                else GatewayError(499, f"seq_id {self.seq_id} was cancelled by the gateway")
            )
        except Exception:  # followers must hear of it, not wait forever
            log.exception("reading the stream of seq_id %d failed", self.seq_id)
            self.error = GatewayError(
                500, f"the gateway failed reading seq_id {self.seq_id}; see its log"
            )
        finally:
            self._stream.cancel()  # a no-op after the last event
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self) -> AsyncIterator[list[int]]:
        """Token ids from the first one, in batches, until the sequence ends; raises the
        stream's GatewayError if it broke."""
        sent = 0
        while True:
            changed = self._changed
            if len(self.token_ids) > sent:
                batch = self.token_ids[sent:]
                sent += len(batch)
                yield batch
                continue
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await changed.wait()

    def cancel(self) -> None:
        """Cancel the sequence: the scheduler cancels it when its stream goes away."""
        if not self.done:
            self._cancelled = True
            self._stream.cancel()


class Generations:
    """Opens sequences, lets retries of a key share one, and cancels the unfollowed."""

    def __init__(
        self, link: SchedulerLink, reattach_grace_seconds: float, reconnect_seconds: float = 30.0
    ) -> None:
        self._link = link
        self._grace_seconds = reattach_grace_seconds
        self._reconnect_seconds = reconnect_seconds
        # request_id -> the task opening its sequence, then the open sequence.
        self._by_request_id: dict[str, asyncio.Task[Generation]] = {}
        self._cancelling: set[asyncio.Task] = set()  # Cancel calls in flight (kept alive)

    @contextlib.asynccontextmanager
    async def attach(self, attempt: Attempt) -> AsyncIterator[Generation]:
        """The sequence for `attempt`, followed until the block ends (a client that left,
        or an answer sent); then cancelled if nobody else follows it and it runs on."""
        generation = await self._open_or_join(attempt)
        generation.num_followers += 1
        try:
            yield generation
        finally:
            generation.num_followers -= 1
            if generation.num_followers == 0 and not generation.done:
                if attempt.generation.request_id and self._grace_seconds > 0:
                    asyncio.get_running_loop().call_later(
                        self._grace_seconds, self._cancel_if_unfollowed, generation
                    )
                else:
                    generation.cancel()

    def stop(self, generation: Generation) -> None:
        """A stop string ended the text: cancel the sequence on the scheduler now (the
        stream's end cancels it too; the Cancel call makes it explicit), without making
        the answer wait for the call."""
        generation.cancel()
        task = asyncio.create_task(self._cancel_on_scheduler(generation))
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)

    async def _cancel_on_scheduler(self, generation: Generation) -> None:
        seq_id = generation.seq_id
        try:
            await self._link.cancel(seq_id, generation.attempt.generation)
        except GatewayError as err:
            log.warning("could not cancel seq_id %d after its stop string: %s", seq_id, err)

    async def _open_or_join(self, attempt: Attempt) -> Generation:
        request_id = attempt.generation.request_id
        if not request_id:
            return Generation(await self._link.generate(attempt.generation), attempt)
        opening = self._by_request_id.get(request_id)
        if opening is None:
            opening = asyncio.create_task(self._open(attempt))
            self._by_request_id[request_id] = opening
        generation = await asyncio.shield(opening)
        if generation.attempt != attempt:
            raise GatewayError(
                409,
                f"Idempotency-Key {request_id!r} is in use by a different "
                f"request; a retry must send the same body",
                param="Idempotency-Key",
                retryable=False,
            )
        return generation

    async def _open(self, attempt: Attempt) -> Generation:
        request_id = attempt.generation.request_id
        try:
            generation = Generation(
                await self._link.generate(attempt.generation),
                attempt,
                self._reopen if self._reconnect_seconds > 0 else None,
            )
        except BaseException:
            self._by_request_id.pop(request_id, None)
            raise
        generation.reader.add_done_callback(lambda _: self._forget(request_id, generation))
        return generation

    async def _reopen(self, generation: Generation) -> GenerateStream:
        """The sequence's stream again, once the scheduler answers (re-attached by its
        request_id); GatewayError if it does not within reconnect_seconds, or if it knows
        the key as another sequence (it lost its state)."""
        request = generation.attempt.generation
        deadline = time.monotonic() + self._reconnect_seconds
        pause = 0.1
        log.warning("the scheduler went away mid-stream; re-attaching seq_id %d", generation.seq_id)
        while True:
            try:
                stream = await self._link.generate(request)
                break
            except GatewayError as err:
                if not err.scheduler_went_away or time.monotonic() + pause > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, 2.0)
        if stream.seq_id != generation.seq_id:
            stream.cancel()
            raise GatewayError(
                502,
                f"the scheduler came back without seq_id "
                f"{generation.seq_id} (it knows request_id "
                f"{request.request_id!r} as seq_id {stream.seq_id}: was "
                f"it restarted without --state-dir?)",
            )
        log.info("re-attached seq_id %d", generation.seq_id)
        return stream

    def _forget(self, request_id: str, generation: Generation) -> None:
        opening = self._by_request_id.get(request_id)
        if (
            opening is not None
            and opening.done()
            and not opening.cancelled()
            and opening.exception() is None
            and opening.result() is generation
        ):
            del self._by_request_id[request_id]

    def _cancel_if_unfollowed(self, generation: Generation) -> None:
        if generation.num_followers == 0:
            generation.cancel()
