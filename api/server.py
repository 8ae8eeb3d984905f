"""How ``rlhf api`` serves the app: uvicorn, with every connection's wait for a request bounded.

uvicorn closes a connection that stays idle ``timeout_keep_alive`` seconds after a response, but it bounds
neither a new connection that never sends a request nor one that sends part of its headers and stops (and any
byte received disarms the keep-alive timer): a client can hold connections, and the file descriptors behind
them, for as long as it likes. :class:`BoundedH11Protocol` gives each request's headers
:data:`HEADER_TIMEOUT_S` seconds from the moment the server waits for them (the connection is made, or the
previous response is complete); a connection that has not sent a whole request head by then is closed. A body
being uploaded and a response being streamed (SSE) are not bounded by it.
"""

import asyncio

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 20.0
"""Seconds a connection may take to send a request's line and headers."""
KEEP_ALIVE_S = 5
"""Seconds an idle keep-alive connection is kept after a response (uvicorn's default)."""


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request head does not arrive in time."""

    header_timeout_s = HEADER_TIMEOUT_S
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_request():
            self._stop_waiting()  # the head arrived: from here on the application answers
        elif self._header_deadline is None:
            self._await_head()  # bytes of the next request on a kept-alive connection

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer, which the next byte disarms
        self._stop_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _await_head(self) -> None:
        self._stop_waiting()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _stop_waiting(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _head_timed_out(self) -> None:
        self._header_deadline = None
        if not self._in_request() and not self.transport.is_closing():
            self.transport.close()


def run(host: str, port: int) -> None:
    """Serve ``api.main:app`` on ``host:port`` until interrupted."""
    uvicorn.run(
        "api.main:app",
        host=host,
        port=port,
        log_level="warning",
        http=BoundedH11Protocol,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
