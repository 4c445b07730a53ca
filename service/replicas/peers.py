"""Streams of another replica's sequence, relayed from the replica that owns it.

A Generate stream on replica A of a sequence replica B owns would otherwise read
PostgreSQL's token log after each of B's commits (a whole log row a read, for every such
stream of the fleet). Instead A opens FollowSequence on B, which streams from its core
what it has committed, and relays it. Whatever goes wrong (B does not own the sequence
any more, B is unreachable or silent, a call fails) ends the relay; A then reads the
database as before, which also tells it the new owner. Nothing is lost or sent twice: B
sends only committed tokens, from the index A asks for, and A counts what it relayed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from common.credentials import aio_channel
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# A followed replica sends an event at least every second while its sequence makes no
# progress (`_REMOTE_POLL_SECONDS`, service/replicas/servicer.py); silence this long ends
# the relay.
SILENT_SECONDS = 5.0
# How long a replica's address is reused before it is read again.
ADDRESS_SECONDS = 10.0
# After a relay from a replica failed (unreachable, silent, any error), streams of its
# sequences read the database this long before trying it again.
UNREACHABLE_SECONDS = 5.0
# After an owner refused a stream at once (it does not own the sequence: it moved, or the
# database lags its core; its stream limit; a credential it does not take), that stream
# reads the database this long before following again.
REFUSED_SECONDS = 1.0
# A failing replica is logged at most this often.
WARN_SECONDS = 60.0
# A channel no relay used for this long is closed (a replica that left, or moved to
# another address, is not dialled again), and what is known of replicas not followed
# since is dropped; looked for at most once this often, when a relay starts.
IDLE_SECONDS = 600.0

# Refusals of one call, not of the replica: the stream reads the database a while.
_REFUSALS = {
    grpc.StatusCode.FAILED_PRECONDITION: "moved",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "refused",
    grpc.StatusCode.UNAUTHENTICATED: "refused",
    grpc.StatusCode.PERMISSION_DENIED: "refused",
    grpc.StatusCode.NOT_FOUND: "refused",
}
# The replica is away or stopping: every stream of its sequences reads the database a while.
_UNREACHABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


class Peers:
    """Channels to the other replicas, one per address, opened on first use."""

    def __init__(
        self,
        address_of: Callable[[int], str | None],
        *,
        max_message_bytes: int,
        on_follow: Callable[[str], None] | None = None,
        silent_seconds: float = SILENT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """`credentials`: TLS toward the other replicas (None: plaintext)."""
        # address_of(replica_id) reads the database (blocking): run on a thread.
        self._address_of = address_of
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # A replica restarted at the same address is tried again within seconds, not
            # after gRPC's default back-off of up to two minutes.
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 5000),
        ]
        self._on_follow = on_follow
        self._silent_seconds = silent_seconds
        self._clock = clock
        self._credentials = credentials
        self._addresses: dict[int, tuple[str | None, float]] = {}
        self._reading: dict[int, asyncio.Future] = {}  # one address read at a time a replica
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._used_at: dict[str, float] = {}  # when a relay last started or ended, by address
        self._relaying: dict[str, int] = {}  # relays in flight, by address
        self._unreachable_until: dict[int, float] = {}
        self._warned_at: dict[int, float] = {}
        self._pruned_at = clock()

    def may_follow(self, owner: int) -> bool:
        """Whether streams of `owner`'s sequences try it now (not while it is unreachable)."""
        return self._clock() >= self._unreachable_until.get(owner, 0.0)

    def open_addresses(self) -> frozenset[str]:
        """The addresses this replica holds a channel to."""
        return frozenset(self._channels)

    async def follow(
        self, owner: int, seq_id: int, start: int, metadata: Sequence[tuple[str, str]]
    ) -> AsyncIterator[pb.GenerateEvent]:
        """`seq_id`'s events from token `start` on, from `owner`, until it finishes or the
        relay ends (how it ended is counted; nothing is raised)."""
        await self._prune()
        outcome = "failed"
        call = None
        in_use = None  # the address this relay counts in use (`_take`), until `finally`
        try:
            address = await self._address(owner)
            if not address:
                outcome = "unreachable"
                return
            channel, in_use = self._take(address), address
            call = pb_grpc.SchedulerStub(channel).FollowSequence(
                pb.FollowSequenceRequest(seq_id=seq_id, start=start), metadata=tuple(metadata)
            )
            while True:
                # Not asyncio.wait_for, which can lose a cancel before Python 3.12
                # (service/server/wakeups.py).
                try:
                    async with asyncio.timeout(self._silent_seconds):
                        event = await call.read()
                except TimeoutError:
                    outcome = "silent"
                    return
                if event is grpc.aio.EOF:
                    return  # ended without finishing: read the database
                if event.finished:
                    outcome = "finished"  # whatever the caller does after this event
                    yield event
                    return
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            if outcome != "finished":
                outcome = "left"  # the client left, or the server stops
            raise
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code in _REFUSALS:
                outcome = _REFUSALS[code]
            elif code in _UNREACHABLE:
                outcome = "unreachable"
                self._addresses.pop(owner, None)  # it may have moved: read it again
                self._warn(owner, f"cannot be reached: {err.code().name} {err.details()}")
            else:  # UNIMPLEMENTED (a replica older than FollowSequence), INTERNAL, ...
                self._warn(
                    owner, f"following seq_id {seq_id} failed: {err.code().name} {err.details()}"
                )
        except Exception as err:  # noqa: BLE001 - the database is away, a bad address: read on
            self._warn(owner, f"cannot follow seq_id {seq_id}: {err}")
        finally:
            if outcome in ("unreachable", "silent", "failed"):
                # Streams of its sequences read the database a while before trying again.
                self._unreachable_until[owner] = self._clock() + UNREACHABLE_SECONDS
            if call is not None:
                call.cancel()  # a no-op once it ended; stops it when the relay stops early
            if in_use in self._relaying:  # not after close(), at shutdown
                self._relaying[in_use] -= 1
                self._used_at[in_use] = self._clock()
            if self._on_follow is not None:
                self._on_follow(outcome)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        self._relaying, self._used_at = {}, {}
        for channel in channels:
            await channel.close()

    async def _prune(self) -> None:
        """Close the channels no relay used for IDLE_SECONDS, and drop what is known of
        the replicas not followed since (their addresses, back-offs and warnings). Never
        fails a relay: a channel that fails to close is left to the collector."""
        now = self._clock()
        if now - self._pruned_at < IDLE_SECONDS:
            return
        self._pruned_at = now
        idle = [
            address
            for address, used_at in self._used_at.items()
            if not self._relaying.get(address) and now - used_at >= IDLE_SECONDS
        ]
        closing = []
        for address in idle:  # all taken out before the first await: none is handed out
            del self._used_at[address]
            self._relaying.pop(address, None)
            closing.append(self._channels.pop(address))
        stale = now - IDLE_SECONDS  # read, backed off or warned of before: not followed since
        self._addresses = {o: a for o, a in self._addresses.items() if a[1] > stale}
        self._unreachable_until = {o: t for o, t in self._unreachable_until.items() if t > stale}
        self._warned_at = {o: t for o, t in self._warned_at.items() if t > stale}
        for channel in closing:
            try:
                await channel.close()
            except Exception as err:  # noqa: BLE001 - nothing uses it any more
                log.debug("closing an idle channel to a replica failed: %s", err)

    async def _address(self, owner: int) -> str | None:
        address, read_at = self._addresses.get(owner, (None, -ADDRESS_SECONDS))
        if self._clock() - read_at < ADDRESS_SECONDS:
            return address
        reading = self._reading.get(owner)
        if reading is None:  # the streams that start a relay meanwhile wait for this read
            reading = asyncio.ensure_future(asyncio.to_thread(self._address_of, owner))
            self._reading[owner] = reading
            reading.add_done_callback(lambda _done: self._reading.pop(owner, None))
        address = await asyncio.shield(reading)
        self._addresses[owner] = (address, self._clock())
        return address

    def _warn(self, owner: int, message: str) -> None:
        now = self._clock()
        if now - self._warned_at.get(owner, -WARN_SECONDS) >= WARN_SECONDS:
            self._warned_at[owner] = now
            log.warning(
                "replica %d: %s; its sequences' streams read the database meanwhile",
                owner,
                message,
            )

    def _take(self, address: str) -> grpc.aio.Channel:
        """The channel to `address`, counted in use: the caller gives it back (`follow`'s
        `finally`), and `_prune` closes none in use."""
        channel = self._channels.get(address)
        if channel is None:
            channel = aio_channel(address, self._credentials, self._options)
            self._channels[address] = channel
        self._relaying[address] = self._relaying.get(address, 0) + 1
        self._used_at[address] = self._clock()
        return channel
