"""The race harness of the PPO benchmarks (``benchmarks/race.py``): it ends when a contestant dies or stops
answering, and goes on with the others. Its contestants here are plain processes that do no work."""

import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.race import WRAP_UP_S, Contestant, Result, Turn, race


def steady(updates: int, conn: Connection) -> None:
    """Runs every update it is given, reports an index as its metrics, and its update count at the end."""
    turn = Turn(conn)
    turn.begin()
    done = 0
    while True:
        done += 1
        turn.end({"update": float(done)})
        if turn.stopped:
            break
    turn.finish({"updates": done})


def dies_in_update(update: int, conn: Connection) -> None:
    """Runs updates until ``update``, where its process exits with code 3 (a crash of a contestant)."""
    turn = Turn(conn)
    turn.begin()
    for _ in range(1, update):
        turn.end()
    os._exit(3)


def silent_after_loading(conn: Connection) -> None:
    """Says it is ready, then never answers again (a contestant stuck in a compile, say)."""
    Turn(conn).conn.send(("ready", None))
    time.sleep(600)


def race_in_thread(contestants: dict[str, Contestant], **kwargs: Any) -> dict[str, Result]:
    """``race(contestants, **kwargs)``, failing the test instead of hanging it if the race does not end within a
    minute."""
    results: dict[str, Result] = {}
    thread = threading.Thread(target=lambda: results.update(race(contestants, **kwargs)), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the race did not end"
    return results


def test_a_contestant_that_dies_leaves_the_race_and_the_others_finish() -> None:
    # warm-up update 1, then counted updates 1 and 2: it dies in counted update 2, its third update
    contestants: dict[str, Contestant] = {"steady": (steady, (4,)), "dies": (dies_in_update, (3,))}
    results = race_in_thread(contestants, updates=4, warmup=1)

    assert results["dies"].failure == "died (exit code 3) in counted update 2"
    assert len(results["dies"].warmup_seconds) == 1
    assert len(results["dies"].seconds) == 1
    assert results["steady"].failure is None
    assert len(results["steady"].warmup_seconds) == 1
    assert [m["update"] for m in results["steady"].metrics] == [2.0, 3.0, 4.0, 5.0]
    assert results["steady"].final == {"updates": 5}


def test_a_contestant_that_stops_answering_leaves_at_the_deadline() -> None:
    contestants: dict[str, Contestant] = {"steady": (steady, (2,)), "silent": (silent_after_loading, ())}
    results = race_in_thread(contestants, updates=2, warmup=1, deadline=time.monotonic() + WRAP_UP_S + 3)

    assert results["silent"].failure == "no answer by the deadline in warm-up update 1"
    assert results["silent"].seconds == []
    assert results["steady"].failure is None
    assert len(results["steady"].warmup_seconds) == 1
    assert results["steady"].final["updates"] >= 1
