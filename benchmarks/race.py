"""Contestants in processes of their own, taking turns one update at a time: the harness of the PPO races.

Each contestant is a process (its own heap, its own peak memory). It loads its models, says "ready", and then
runs one update each time the parent says "go", reporting the update's seconds; "stop" ends it, and it reports
what it knows at the end (peak memory, the engine's decode statistics). The parent runs the warm-up updates of
all contestants at once (nothing of them is counted: compiles and first-call costs overlap) and then the counted
updates in turn, round robin, so no two contestants ever compute at once and a slow phase of the machine hits
them alike.

A contestant that dies, or does not answer by the race's deadline, leaves the race: the parent notices it
(it waits on the pipes and on the processes' sentinels together, never on a pipe alone), records why and in
which update, ends it, and races the others on. Torch-free, so its tests start their processes quickly.
"""

import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

WRAP_UP_S = 10.0
"""Seconds of a race's time limit kept for the contestants to end and report after the last update."""


class RaceOver(Exception):
    """Raised in a contestant told to stop before its first update."""


class Turn:
    """A contestant's side of the turn-taking: wait for "go", run one update, report its seconds.

    ``sync`` is called before an update's clock stops (``torch.cuda.synchronize`` on CUDA: kernels still
    queued belong to the update). After :meth:`end`, ``stopped`` says whether the parent ended the race.
    """

    def __init__(self, conn: Connection, sync: Callable[[], None] = lambda: None) -> None:
        self.conn = conn
        self.sync = sync
        self.stopped = False
        self._started = 0.0

    def begin(self) -> None:
        """Models are loaded: say so, wait for the first turn, start the clock."""
        self.conn.send(("ready", None))
        self._wait()
        if self.stopped:
            raise RaceOver

    def end(self, metrics: dict[str, float] | None = None) -> None:
        """One update is done: report its seconds (and ``metrics``, the engine's of that update) and wait for
        the next turn."""
        self.sync()
        self.conn.send(("update", {"seconds": time.perf_counter() - self._started, "metrics": metrics or {}}))
        self._wait()

    def finish(self, final: dict[str, Any]) -> None:
        """The contestant is done: send what it knows at the end (peak memory, decode statistics)."""
        self.conn.send(("done", final))

    def _wait(self) -> None:
        self.stopped = self.conn.recv() == "stop"
        self._started = time.perf_counter()


@dataclass
class Result:
    """One contestant's race."""

    seconds: list[float] = field(default_factory=list)
    """Per counted update."""
    warmup_seconds: list[float] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    """What the contestant reported with each counted update (ours: the engine's metrics of the step)."""
    final: dict[str, Any] = field(default_factory=dict)
    """What it reported at its end: peak memory, the engine's decode statistics."""
    failure: str | None = None
    """Why it left the race early: ``"died (exit code 1) in counted update 2"``; None: it ran to the end."""


@dataclass
class _Entrant:
    name: str
    process: BaseProcess
    conn: Connection
    result: Result = field(default_factory=Result)

    @property
    def in_race(self) -> bool:
        return self.result.failure is None


Contestant = tuple[Callable[..., None], tuple[Any, ...]]
"""A contestant's process: ``target(*args, conn)``, ``conn`` its end of the pipe (build a :class:`Turn` on it)."""


def race(
    contestants: dict[str, Contestant],
    updates: int,
    warmup: int = 2,
    deadline: float | None = None,
    on_round: Callable[[dict[str, Result]], None] | None = None,
) -> dict[str, Result]:
    """Race ``contestants``: ``warmup`` updates of all at once, then up to ``updates`` counted ones in turn.

    ``deadline`` (a ``time.monotonic()`` value): a counted round starts only when the longest so far would end
    :data:`WRAP_UP_S` before it, a contestant that has not answered by then leaves the race, and every one left
    is ended at the deadline. ``on_round`` is called with the results so far after the models are loaded and
    after each round (to save them: a race killed from outside still leaves those).
    """
    context = multiprocessing.get_context("spawn")
    entrants = []
    for name, (target, args) in contestants.items():
        conn, child = context.Pipe()
        process = context.Process(target=target, args=(*args, child), name=name)
        process.start()
        child.close()  # the child's end lives in the child: once it exits, recv() here sees EOF
        entrants.append(_Entrant(name, process, conn))
    results = {e.name: e.result for e in entrants}
    stop_rounds = None if deadline is None else deadline - WRAP_UP_S
    try:
        _gather(entrants, "ready", "while loading", stop_rounds)
        _report(on_round, results)
        for i in range(warmup):
            if _past(stop_rounds):
                break
            racing = [e for e in entrants if e.in_race]
            for e in racing:
                e.conn.send("go")
            for e, update in _gather(racing, "update", f"in warm-up update {i + 1}", stop_rounds):
                e.result.warmup_seconds.append(update["seconds"])
            _report(on_round, results)
        longest = 0.0
        for i in range(updates):
            racing = [e for e in entrants if e.in_race]
            if not racing or _past(stop_rounds, longest):
                break
            started = time.monotonic()
            for e in racing:
                e.conn.send("go")
                for _, update in _gather([e], "update", f"in counted update {i + 1}", stop_rounds):
                    e.result.seconds.append(update["seconds"])
                    e.result.metrics.append(update["metrics"])
            longest = max(longest, time.monotonic() - started)
            _report(on_round, results)
        racing = [e for e in entrants if e.in_race]
        for e in racing:
            e.conn.send("stop")
        for e, final in _gather(racing, "done", "while ending", deadline):
            e.result.final = final
        _report(on_round, results)
    finally:
        for e in entrants:
            if e.process.is_alive():
                e.process.terminate()
            e.process.join()
    return results


def _past(limit: float | None, ahead: float = 0.0) -> bool:
    return limit is not None and time.monotonic() + ahead > limit


def _report(on_round: Callable[[dict[str, Result]], None] | None, results: dict[str, Result]) -> None:
    if on_round is not None:
        on_round(results)


def _gather(
    entrants: Sequence[_Entrant], expected: str, during: str, limit: float | None
) -> list[tuple[_Entrant, Any]]:
    """One ``expected`` message from each of ``entrants``, in the order they arrive. One that dies first, or has
    not answered by ``limit``, leaves the race (its result says why, ``during`` what) and is ended."""
    answers = []
    waiting = list(entrants)
    while waiting:
        timeout = None if limit is None else max(0.0, limit - time.monotonic())
        ready = wait([e.conn for e in waiting] + [e.process.sentinel for e in waiting], timeout)
        if not ready:
            for e in waiting:
                e.result.failure = f"no answer by the deadline {during}"
                e.process.terminate()
            break
        for e in list(waiting):
            if e.conn.poll():  # a message first: a contestant may send its last one and exit at once
                try:
                    kind, payload = e.conn.recv()
                except EOFError:  # the pipe closed: the process is gone or going
                    e.process.join(timeout=5)
                    e.result.failure = f"died (exit code {e.process.exitcode}) {during}"
                else:
                    if kind != expected:
                        e.result.failure = f"sent {kind!r} instead of {expected!r} {during}"
                        e.process.terminate()
                    else:
                        answers.append((e, payload))
                waiting.remove(e)
            elif e.process.sentinel in ready:
                e.process.join()
                e.result.failure = f"died (exit code {e.process.exitcode}) {during}"
                waiting.remove(e)
    return answers
