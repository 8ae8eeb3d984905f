"""Small helpers of tests that start real servers and processes: a free TCP port on loopback, and polling
until a condition holds. Standard library only, so that any test may import them.

    port = free_port()
    job = wait_until(lambda: finished(job_id), 120, "the job to finish", processes.logs)
"""

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(condition: Callable[[], T | None], timeout: float, what: str, context: Callable[[], str] = str) -> T:
    """Poll ``condition`` every 50 ms until it returns something truthy, and return that; fail after ``timeout``
    seconds with ``what`` was awaited and ``context()`` (a log tail, say)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{context()}")
        time.sleep(0.05)


def children_running(parent: int, marker: str) -> list[int]:
    """Pids of ``parent``'s child processes whose command line contains ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and marker in cmdline:
            found.append(int(proc.name))
    return found
