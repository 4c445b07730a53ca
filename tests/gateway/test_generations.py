"""Sequences in flight: who shares a stream, and when a sequence is cancelled (a fake
scheduler link, no processes)."""

from __future__ import annotations

import asyncio

import pytest

from service.gateway.errors import GatewayError
from service.gateway.generations import Attempt, Generations
from service.gateway.scheduler_link import FinishReason, GenerationRequest, TokenEvent


class FakeStream:
    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    async def next(self) -> TokenEvent:
        event = await self.events.get()
        if event is None:
            raise GatewayError(499, "cancelled")
        if isinstance(event, GatewayError):
            raise event
        return event

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.events.put_nowait(None)


class FakeLink:
    """Hands out streams; a known request_id gets its first seq_id again, as the scheduler
    does (unless `forget` is set: a scheduler that lost its state)."""

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        self.cancelled_seq_ids: list[int] = []
        self.seq_ids: dict[str, int] = {}
        self.forget = False

    async def generate(self, request: GenerationRequest) -> FakeStream:
        await asyncio.sleep(0.01)  # a round trip, so that concurrent attaches overlap
        seq_id = len(self.streams) + 1
        if request.request_id and not self.forget:
            seq_id = self.seq_ids.setdefault(request.request_id, seq_id)
        self.streams.append(FakeStream(seq_id))
        return self.streams[-1]

    async def cancel(self, seq_id: int, request=None) -> None:
        self.cancelled_seq_ids.append(seq_id)


def attempt(request_id: str = "", prompt=(5, 6, 7)) -> Attempt:
    return Attempt(
        GenerationRequest(
            prompt_token_ids=prompt,
            max_new_tokens=8,
            temperature=0,
            top_p=0,
            top_k=0,
            seed=0,
            stop_token_ids=(),
            request_id=request_id,
        )
    )


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_sequence_without_a_key_is_cancelled_as_soon_as_its_client_leaves():
    async def scenario():
        link = FakeLink()
        generations = Generations(link, reattach_grace_seconds=30)
        async with generations.attach(attempt()):
            pass
        return link.streams[0].cancelled

    assert run(scenario())


def test_a_keyed_sequence_outlives_its_client_by_the_grace_period_only():
    async def scenario():
        link = FakeLink()
        generations = Generations(link, reattach_grace_seconds=0.2)
        async with generations.attach(attempt("key")):
            pass
        during = link.streams[0].cancelled
        await asyncio.sleep(0.5)
        return during, link.streams[0].cancelled

    assert run(scenario()) == (False, True)


def test_concurrent_requests_with_one_key_share_one_stream_and_see_every_token():
    async def scenario():
        link = FakeLink()
        generations = Generations(link, reattach_grace_seconds=30)

        async def follow():
            async with generations.attach(attempt("key")) as generation:
                return [t async for batch in generation.follow() for t in batch]

        tasks = [asyncio.create_task(follow()) for _ in range(3)]
        await asyncio.sleep(0.05)
        stream = link.streams[0]
        stream.events.put_nowait(TokenEvent((1, 2)))
        stream.events.put_nowait(TokenEvent((3,), FinishReason.MAX_LENGTH))
        return len(link.streams), await asyncio.gather(*tasks)

    num_streams, outputs = run(scenario())
    assert num_streams == 1
    assert outputs == [[1, 2, 3]] * 3


def test_a_retry_that_joins_late_still_reads_from_the_first_token():
    async def scenario():
        link = FakeLink()
        generations = Generations(link, reattach_grace_seconds=30)
        async with generations.attach(attempt("key")):
            link.streams[0].events.put_nowait(TokenEvent((1, 2)))
            await asyncio.sleep(0.05)
        async with generations.attach(attempt("key")) as generation:
            link.streams[0].events.put_nowait(TokenEvent((3,), FinishReason.EOS))
            return [t async for batch in generation.follow() for t in batch], len(link.streams)

    assert run(scenario()) == ([1, 2, 3], 1)


def test_one_key_with_a_different_body_is_a_409():
    async def scenario():
        generations = Generations(FakeLink(), reattach_grace_seconds=30)
        async with generations.attach(attempt("key")):
            with pytest.raises(GatewayError) as raised:
                async with generations.attach(attempt("key", prompt=(9,))):
                    pass
            return raised.value.status

    assert run(scenario()) == 409


def test_stop_cancels_the_stream_and_the_sequence_on_the_scheduler():
    async def scenario():
        link = FakeLink()
        generations = Generations(link, reattach_grace_seconds=30)
        async with generations.attach(attempt("key")) as generation:
            generations.stop(generation)
        await asyncio.sleep(0.05)  # the Cancel call runs in the background
        return link.streams[0].cancelled, link.cancelled_seq_ids

    assert run(scenario()) == (True, [1])


WENT_AWAY = GatewayError(503, "cannot reach the scheduler", scheduler_went_away=True)


def test_a_keyed_stream_broken_by_a_scheduler_restart_is_reopened_and_the_replay_skipped():
    async def scenario():
        link = FakeLink()
        generations = Generations(link, reattach_grace_seconds=30, reconnect_seconds=5)
        async with generations.attach(attempt("key")) as generation:
            first = link.streams[0]
            first.events.put_nowait(TokenEvent((1, 2)))
            first.events.put_nowait(WENT_AWAY)
            while len(link.streams) < 2:
                await asyncio.sleep(0.01)
            again = link.streams[1]
            again.events.put_nowait(TokenEvent((1, 2, 3)))  # replayed from the first token
            again.events.put_nowait(TokenEvent((4,), FinishReason.MAX_LENGTH))
            tokens = [t async for batch in generation.follow() for t in batch]
            return tokens, again.seq_id == first.seq_id

    assert run(scenario()) == ([1, 2, 3, 4], True)


def test_a_scheduler_back_without_the_sequence_is_a_502_and_the_new_one_is_cancelled():
    async def scenario():
        link = FakeLink()
        generations = Generations(link, reattach_grace_seconds=30, reconnect_seconds=5)
        async with generations.attach(attempt("key")) as generation:
            link.forget = True
            link.streams[0].events.put_nowait(WENT_AWAY)
            with pytest.raises(GatewayError) as raised:
                [t async for batch in generation.follow() for t in batch]
            return (
                raised.value.status,
                "--state-dir" in raised.value.message,
                link.streams[1].cancelled,
            )

    assert run(scenario()) == (502, True, True)


def test_a_stream_without_a_key_is_not_reopened():
    async def scenario():
        link = FakeLink()
        generations = Generations(link, reattach_grace_seconds=30, reconnect_seconds=5)
        async with generations.attach(attempt()) as generation:
            link.streams[0].events.put_nowait(WENT_AWAY)
            with pytest.raises(GatewayError):
                [t async for batch in generation.follow() for t in batch]
        return len(link.streams)

    assert run(scenario()) == 1
