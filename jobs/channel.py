"""The channel between a job's processes and the worker that claimed it (:mod:`jobs.distributed`): JSON frames over
a socket, opened by a mutual challenge-response on the job's key.

    peer (a rank, or a joining host's worker)              worker (listening)
    ─────────────────────────────────────────              ─────────────────────────────────────────────
                                                           32 random bytes: its challenge
    32 random bytes, then HMAC-SHA256(key, "peer" ‖ both)  checks the HMAC: a peer without the key is dropped
    checks the HMAC: a worker without the key is refused   HMAC-SHA256(key, "worker" ‖ both)
    then frames both ways: 4 bytes of big-endian length, then that many bytes of UTF-8 JSON

The key never crosses the wire, and nothing read off it is unpickled: a frame is JSON, at most
:data:`MAX_FRAME_BYTES`. The worker's :class:`ChannelServer` authenticates each peer in a thread of its own, within
:data:`HANDSHAKE_TIMEOUT_S`, so a peer that connects and stays silent, closes at once or sends garbage is dropped
without holding up the others (:data:`MAX_HANDSHAKES` at once; more are closed at once).
"""

import contextlib
import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import socket
import threading
from collections.abc import Sequence
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
"""How long a peer has to prove it holds the key."""
MAX_HANDSHAKES = 16
"""Peers proving themselves at once; a connection beyond them is closed at once."""
MAX_FRAME_BYTES = 64 * 2**20
"""The largest frame either end accepts (a step's samples are the largest)."""
NONCE_BYTES = 32
SECRET_FILE = "node-secret"
"""The file under the artifacts folder that holds the secret the hosts of a job share (mode 0600)."""


class ChannelError(ConnectionError):
    """A peer that broke the protocol: a wrong key, a malformed or oversized frame, a handshake too slow."""


class Channel:
    """One authenticated connection: :meth:`send` and :meth:`recv` JSON values. ``fileno`` lets
    :func:`multiprocessing.connection.wait` watch it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Any) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        if len(data) > MAX_FRAME_BYTES:
            raise ChannelError(f"a message of {len(data)} bytes; the channel takes at most {MAX_FRAME_BYTES}")
        self.sock.sendall(len(data).to_bytes(4, "big") + data)

    def recv(self) -> Any:
        """The next message; EOFError once the other end closed."""
        size = int.from_bytes(_read(self.sock, 4), "big")
        if size > MAX_FRAME_BYTES:
            raise ChannelError(f"a frame of {size} bytes; the channel takes at most {MAX_FRAME_BYTES}")
        try:
            return json.loads(_read(self.sock, size))
        except ValueError as e:  # not UTF-8, not JSON
            raise ChannelError(f"a frame that is not JSON: {e}") from e

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def readable(channels: Sequence[Channel], timeout_s: float) -> list[Channel]:
    """The ``channels`` with something to read (a message, or their end), after waiting up to ``timeout_s``."""
    by_fd = {channel.fileno(): channel for channel in channels}
    return [by_fd[fd] for fd in wait(list(by_fd), timeout_s) if isinstance(fd, int)]


def _read(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 2**20))
        if not chunk:
            raise EOFError("the other end closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _proof(key: bytes, who: bytes, challenge: bytes, answer_nonce: bytes) -> bytes:
    return hmac.new(key, who + challenge + answer_nonce, hashlib.sha256).digest()


def connect(address: str, key: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Channel:
    """Open the channel at ``address`` (a Unix socket's path, or ``host:port``), proving that this end holds ``key``
    and checking that the worker does too (:class:`ChannelError` otherwise)."""
    if address.startswith("/"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: Any = address
    else:
        host, _, port = address.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        target = (host, int(port))
    try:
        sock.settimeout(timeout_s)
        sock.connect(target)
        challenge, nonce = _read(sock, NONCE_BYTES), secrets.token_bytes(NONCE_BYTES)
        sock.sendall(nonce + _proof(key, b"peer", challenge, nonce))
        if not hmac.compare_digest(_read(sock, 32), _proof(key, b"worker", challenge, nonce)):
            raise ChannelError(f"the worker at {address} does not hold the job's key")
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return Channel(sock)


class ChannelServer:
    """Listens on ``sock`` (bound and listening) and puts each peer that proves it holds ``key`` in
    :attr:`accepted`; the others are dropped (and counted in :attr:`dropped`)."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock = sock
        self.key = key
        self.accepted: queue.Queue[Channel] = queue.Queue()
        self.dropped = 0
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._closed = threading.Event()
        sock.settimeout(0.2)  # the accept loop looks at _closed between waits
        self._thread = threading.Thread(target=self._accept, name="channel-accept", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """Where peers connect: the Unix socket's path, or ``host:port``."""
        name = self.sock.getsockname()
        return name if isinstance(name, str) else f"{name[0]}:{name[1]}"

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
        self.sock.close()
        while not self.accepted.empty():  # accepted but never taken
            self.accepted.get().close()

    def __enter__(self) -> "ChannelServer":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):
                self._drop(conn, "too many peers proving themselves at once")
                continue
            threading.Thread(target=self._handshake, args=(conn,), name="channel-handshake", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            challenge = secrets.token_bytes(NONCE_BYTES)
            conn.sendall(challenge)
            answer = _read(conn, NONCE_BYTES + 32)
            nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
            if not hmac.compare_digest(proof, _proof(self.key, b"peer", challenge, nonce)):
                raise ChannelError("a wrong proof of the key")
            conn.sendall(_proof(self.key, b"worker", challenge, nonce))
            conn.settimeout(None)
        except (OSError, EOFError) as e:  # timeouts are OSErrors; ChannelError is one
            self._drop(conn, str(e) or type(e).__name__)
        else:
            if self._closed.is_set():
                conn.close()
            else:
                self.accepted.put(Channel(conn))
        finally:
            self._handshakes.release()

    def _drop(self, conn: socket.socket, why: str) -> None:
        self.dropped += 1
        with contextlib.suppress(OSError):
            log.warning("dropped a peer of the job's channel (%s): %s", conn.getpeername(), why)
        conn.close()


def node_secret(artifacts_dir: Path) -> bytes:
    """The secret every host of a job across hosts shares, from which each attempt's channel key is derived: made
    once (random, mode 0600) in the artifacts folder, which all hosts mount."""
    path = artifacts_dir / SECRET_FILE
    if not path.exists():
        artifacts_dir.mkdir(parents=True, exist_ok=True)
        draft = artifacts_dir / f".{SECRET_FILE}-{secrets.token_hex(8)}"
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(32))
        try:
            os.link(draft, path)  # whole or not at all; the first worker's stays
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    return bytes.fromhex(path.read_text())


def job_key(secret: bytes, job_id: str, attempt: int, nonce: str) -> bytes:
    """The channel key of one run of a job's attempt: known to the workers that hold ``secret``, to no one else."""
    return hmac.new(secret, f"rlhf-job-channel:{job_id}:{attempt}:{nonce}".encode(), hashlib.sha256).digest()
