"""GET /v1/jobs/{id}/stream: Server-Sent Events until the job ends, resumable without loss or repeats."""

import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.main import create_app
from api.routes.stream import Cursor, job_events, sse
from jobs.store.models import utcnow
from jobs.store.settings import Settings
from tests.api.helpers import Db, error_of
from tests.factories import Project


@dataclass
class Message:
    id: str
    event: str
    data: Any


def messages(lines: Iterator[str], comments: list[str] | None = None) -> Iterator[Message]:
    """Parse an SSE stream (the fields this server sends)."""
    fields: dict[str, str] = {}
    for line in lines:
        if line.startswith(":"):
            if comments is not None:
                comments.append(line)
        elif line == "":
            if fields:
                yield Message(fields["id"], fields["event"], json.loads(fields["data"]))
            fields = {}
        else:
            name, _, value = line.partition(": ")
            fields[name] = value


def read_all(client: TestClient, job_id: str, **kwargs: Any) -> list[Message]:
    with client.stream("GET", f"/v1/jobs/{job_id}/stream", **kwargs) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(messages(response.iter_lines()))


def write_history(db: Db, job_id: str) -> None:
    db.status(job_id, "running")
    for step in range(1, 6):
        db.metrics(job_id, step, {"loss/sft": 1.0 / step, "lr": 0.01})
        if step % 2 == 0:
            db.event(job_id, f"note at {step}", data={"step": step})
    db.checkpoint(job_id, 5)
    db.status(job_id, "succeeded", finished_at=utcnow())


def payload(stream: list[Message]) -> tuple[list[Any], list[Any]]:
    return [m.data for m in stream if m.event == "metrics"], [m.data for m in stream if m.event == "event"]


def test_a_finished_job_streams_everything_then_ends(client: TestClient, project: Project, db: Db) -> None:
    job_id = db.job(project.id)
    write_history(db, job_id)
    stream = read_all(client, job_id)

    assert stream[0].event == "status"
    assert stream[0].data == {"status": "succeeded", "step": 5, "error": None}
    assert stream[-1].event == "end"
    assert stream[-1].data == {"status": "succeeded"}
    metrics, events = payload(stream)
    assert metrics == [{"step": s, "metrics": {"loss/sft": 1.0 / s, "lr": 0.01}} for s in range(1, 6)]
    recorded = client.get(f"/v1/jobs/{job_id}/events").json()["data"]
    assert events == recorded
    assert [e["kind"] for e in events] == ["status", "info", "info", "checkpoint", "status"]
    # Cursors only move forward.
    cursors = [tuple(map(int, m.id.split("-"))) for m in stream]
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in itertools.pairwise(cursors))


def test_reconnecting_resumes_without_loss_or_repeats(client: TestClient, project: Project, db: Db) -> None:
    job_id = db.job(project.id)
    write_history(db, job_id)
    full = read_all(client, job_id)
    all_metrics, all_events = payload(full)
    for cut in range(1, len(full) - 1):  # reconnect after every message in turn
        before = full[: cut + 1]
        after = read_all(client, job_id, headers={"Last-Event-ID": full[cut].id})
        assert after[0].event == "status" and after[-1].event == "end"
        metrics_before, events_before = payload(before)
        metrics_after, events_after = payload(after)
        assert metrics_before + metrics_after == all_metrics, cut
        assert events_before + events_after == all_events, cut
    # The query parameter works too; the header wins over it.
    middle = full[len(full) // 2].id
    by_query = read_all(client, job_id, params={"last_event_id": middle})
    assert payload(by_query) == payload(read_all(client, job_id, headers={"Last-Event-ID": middle}))
    both = read_all(client, job_id, params={"last_event_id": "0-0"}, headers={"Last-Event-ID": full[-1].id})
    assert payload(both) == ([], [])


def test_live_stream_follows_the_job(client: TestClient, project: Project, db: Db) -> None:
    def until(stream: Iterator[Message], event: str) -> list[Message]:
        seen = [next(stream)]
        while seen[-1].event != event:
            seen.append(next(stream))
        return seen

    job_id = db.job(project.id)
    with client.stream("GET", f"/v1/jobs/{job_id}/stream") as response:
        stream = messages(response.iter_lines())
        assert next(stream).data["status"] == "queued"
        db.status(job_id, "running")
        started = until(stream, "status")
        assert [(m.event, m.data.get("message")) for m in started] == [("event", "running"), ("status", None)]
        assert started[-1].data["status"] == "running"
        db.metrics(job_id, 1, {"loss/sft": 2.0})
        assert next(stream).data == {"step": 1, "metrics": {"loss/sft": 2.0}}
        db.metrics(job_id, 2, {"loss/sft": 1.0})
        db.status(job_id, "failed", error_code="boom", error_message="it broke", finished_at=utcnow())
        rest = list(stream)
    assert [m.event for m in rest] == ["metrics", "event", "status", "end"]
    assert rest[-2].data == {"status": "failed", "step": 2, "error": {"code": "boom", "message": "it broke"}}


def test_heartbeat_comments(settings: Settings, project: Project, db: Db) -> None:
    app: FastAPI = create_app(settings, enqueue=lambda *_: None, recovery_interval=None, poll_interval=0.01,
                              heartbeat_interval=0.05)  # fmt: skip
    job_id = db.job(project.id, status="running")
    with TestClient(app, headers=project.headers) as client, client.stream("GET", f"/v1/jobs/{job_id}/stream") as r:
        lines = r.iter_lines()
        assert next(lines) == "id: 0-0"
        comment = next(line for line in lines if line.startswith(":"))
    assert comment == ": keep-alive"


def test_bad_cursor_and_unknown_job(client: TestClient, project: Project, db: Db) -> None:
    job_id = db.job(project.id)
    response = client.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": "yesterday"})
    assert response.status_code == 422
    assert error_of(response)["param"] == "Last-Event-ID"
    response = client.get(f"/v1/jobs/{job_id}/stream", params={"last_event_id": "1-"})
    assert error_of(response)["param"] == "last_event_id"
    response = client.get(f"/v1/jobs/{job_id}/stream", params={"last_event_id": "99999999999999999999-1"})
    assert response.status_code == 422  # beyond BIGINT: refused up front, not a broken stream
    assert client.get("/v1/jobs/job_000000000000/stream").status_code == 404


def test_messages_are_strict_json() -> None:
    text = sse(
        "metrics", {"step": 1, "metrics": {"loss/sft": float("nan"), "lr": float("inf"), "n": 2.0}}, Cursor(7, 3)
    )
    assert text == 'id: 7-3\nevent: metrics\ndata: {"step":1,"metrics":{"loss/sft":null,"lr":null,"n":2.0}}\n\n'


def test_a_backlog_of_events_settles_at_once(settings: Settings, project: Project, db: Db) -> None:
    """Events a poll finds together settle together: a fast job's many checkpoint events and the status change
    after them (a pause) arrive one settling period later, not one period per event (the stream used to fall
    ever further behind a job writing more than one event per period, and never showed it paused)."""
    job_id = db.job(project.id, status="running")
    chunks: list[str] = []

    async def follow() -> None:
        stream = job_events(settings.resolved_database_url, job_id, Cursor(), 0.01, 60.0, event_settle_s=0.2)
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 1:  # the first message (status running); then a backlog and a pause at once
                for step in range(30):
                    db.event(job_id, f"checkpoint at step {step}", kind="checkpoint")
                db.status(job_id, "pausing")
                db.status(job_id, "paused")
            if "event: status" in chunk and '"paused"' in chunk:
                return

    anyio.run(follow)
    # the backlog (30 checkpoints, pausing, paused) and the status change went out together, in one message
    assert chunks[-1].count("event: event") >= 32, [chunk[:200] for chunk in chunks]
    assert chunks[-1].rstrip().endswith('{"status":"paused","step":0,"error":null}')


def test_a_status_change_is_not_held_back_by_events_that_keep_coming(
    settings: Settings, project: Project, db: Db
) -> None:
    """A job writing events more often than they take to settle (checkpoints of a fast job) still has its status
    change streamed right after the change's own event, not only once the job stops writing."""
    job_id = db.job(project.id, status="running")
    writing = threading.Event()
    writing.set()

    def write_events() -> None:
        for step in range(200):  # at most 10 s
            if not writing.is_set():
                return
            db.event(job_id, f"checkpoint at step {step}", kind="checkpoint")
            time.sleep(0.05)
        writing.clear()

    async def follow() -> bool:
        writer = threading.Thread(target=write_events, daemon=True)
        async for chunk in job_events(settings.resolved_database_url, job_id, Cursor(), 0.01, 60.0, 0.2):
            if writer.ident is None:  # after the first message: events keep coming, then the status changes
                writer.start()
                await anyio.sleep(0.3)
                db.status(job_id, "pausing")
            if '"status":"pausing","step"' in chunk:
                return writing.is_set()  # the writer was still going
        raise AssertionError("the stream ended")

    try:
        assert anyio.run(follow), "the status change waited until no more events came"
    finally:
        writing.clear()
