"""Connection deadlines for the gateway's HTTP listener (uvicorn's h11 protocol).

uvicorn closes a connection idle between requests (`timeout_keep_alive`), but not one
that sends its request slowly: a client trickling a header byte every few seconds, or
a body, held its connection (and a slot of the process) for as long as it liked. Here a
request's headers must be complete within `header_timeout_seconds` of the connection
opening or the previous answer ending, and its body within `body_timeout_seconds` of
its headers; else the connection is closed. An answer being sent (a long stream) has no
deadline. Each connection checks its deadline on a timer of its own; nothing is per
byte.
"""

from __future__ import annotations

import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def guarded_h11(header_timeout_seconds: float, body_timeout_seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with these deadlines (pass it as uvicorn.Config's `http`)."""
    check_every = max(0.05, min(header_timeout_seconds, body_timeout_seconds) / 4)

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._phase = None
            self._phase_started = self.loop.time()
            self._deadline_check = self.loop.call_later(check_every, self._check_deadline)

        def connection_lost(self, exc) -> None:
            self._deadline_check.cancel()
            super().connection_lost(exc)

        def _check_deadline(self) -> None:
            if self.transport.is_closing():
                return
            state, now = self.conn.their_state, self.loop.time()
            if state is not self._phase:
                self._phase, self._phase_started = state, now
            waited = now - self._phase_started
            answering = self.cycle is not None and not self.cycle.response_complete
            if state is h11.IDLE and not answering and waited > header_timeout_seconds:
                self._close_slow("request headers", header_timeout_seconds)
                return
            if state is h11.SEND_BODY and waited > body_timeout_seconds:
                self._close_slow("request body", body_timeout_seconds)
                return
            self._deadline_check = self.loop.call_later(check_every, self._check_deadline)

        def _close_slow(self, what: str, limit_seconds: float) -> None:
            log.debug(
                "closing a connection whose %s took over %g s",
                what,
                limit_seconds,
                extra={"client": self.client},
            )
            self.transport.close()

    return GuardedH11Protocol
