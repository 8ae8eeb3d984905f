"""The API served as ``rlhf api`` serves it (uvicorn with :class:`api.server.BoundedH11Protocol`), over real
sockets: a connection that sends no request, or stops in the middle of its headers, is closed once the header
time runs out, on a new connection as on a kept-alive one; a slow but whole request is answered."""

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from api import server
from api.main import create_app
from tests.factories import make_settings

HEADER_TIMEOUT_S = 0.5
REQUEST = b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n"


@pytest.fixture
def address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, int]]:
    app = create_app(make_settings(tmp_path, None), recovery_interval=None)  # /healthz needs no database
    monkeypatch.setattr(server.BoundedH11Protocol, "header_timeout_s", HEADER_TIMEOUT_S)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", http=server.BoundedH11Protocol, timeout_keep_alive=30
    )  # fmt: skip  (longer than the test: only the header bound acts)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        userver = uvicorn.Server(config)
        thread = threading.Thread(target=userver.run, kwargs={"sockets": [listener]}, daemon=True)
        thread.start()
        while not userver.started:
            time.sleep(0.01)
        try:
            yield listener.getsockname()
        finally:
            userver.should_exit = True
            thread.join(timeout=10)


def answered(connection: socket.socket) -> bool:
    """Whether the server answers the request just sent with /healthz's 200 (read to the end of its body)."""
    connection.settimeout(5)
    received = b""
    while not received.endswith(b'{"status":"ok"}'):
        chunk = connection.recv(65536)
        if not chunk:
            return False
        received += chunk
    return received.startswith(b"HTTP/1.1 200")


def closed_after(connection: socket.socket, limit: float) -> float:
    """Seconds until the server closes ``connection`` (reads return nothing), failing after ``limit``."""
    start = time.monotonic()
    connection.settimeout(limit)
    while connection.recv(65536):
        pass  # a response, before the close
    return time.monotonic() - start


def test_a_connection_that_sends_nothing_is_closed(address: tuple[str, int]) -> None:
    with socket.create_connection(address) as connection:
        assert closed_after(connection, limit=5) < HEADER_TIMEOUT_S + 2


def test_a_connection_that_stops_inside_its_headers_is_closed(address: tuple[str, int]) -> None:
    with socket.create_connection(address) as connection:
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: te")
        assert closed_after(connection, limit=5) < HEADER_TIMEOUT_S + 2


def test_a_kept_alive_connection_gets_the_same_bound_for_its_next_request(address: tuple[str, int]) -> None:
    with socket.create_connection(address) as connection:
        connection.sendall(REQUEST)
        assert answered(connection)
        connection.sendall(b"GET /healthz HTTP/1.1\r\n")  # the next request's head, cut short
        assert closed_after(connection, limit=5) < HEADER_TIMEOUT_S + 2


def test_a_request_sent_in_pieces_within_the_bound_is_answered(address: tuple[str, int]) -> None:
    with socket.create_connection(address) as connection:
        for piece in (REQUEST[:10], REQUEST[10:20], REQUEST[20:]):
            connection.sendall(piece)
            time.sleep(HEADER_TIMEOUT_S / 5)
        assert answered(connection)
        time.sleep(HEADER_TIMEOUT_S * 2)  # idle after a response: uvicorn's keep-alive time (30 s here) applies
        connection.sendall(REQUEST)
        assert answered(connection)
