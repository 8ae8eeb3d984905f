"""``GET /v1/jobs/{id}/stream``: live metrics, events and status as Server-Sent Events.

Each poll opens a short session of its own (the stream holds no connection in between). Every message
carries the cursor ``<last metric row id>-<last event row id>`` as its ``id:``; a client reconnecting with
``Last-Event-ID`` resumes right after it, with nothing lost or repeated. Messages:

- ``status``: ``{status, step, error}``, first on every connection, then whenever the status changes;
- ``metrics``: ``{step, metrics: {name: value}}``, one per step, in the order the rows were written;
- ``event``: an events row ``{id, kind, message, data, created_at}``;
- ``end``: ``{status}``, once the job is final and everything before it was sent; then the stream closes.

A comment line (``: keep-alive``) goes out when nothing else was sent for ``heartbeat_interval`` seconds.

Why the cursor is safe. Row ids come from a sequence and are taken at insert time, but rows become
visible at commit: on PostgreSQL two transactions can commit out of id order, and a cursor that moved
past id 101 would never see id 100 committed a moment later. Metric rows have one writer at a time (the
worker holding the job's lease, one transaction per step), so their ids commit in order. Event rows have
two writers, the API (cancel, pause, resume, lease recovery) and the worker, so the stream lets a newly
seen event *settle*: it is sent only once it has been visible for ``event_settle_s`` (any event with a
smaller id, taken before it, has committed by then), and each poll reads again from the cursor, so a
late row is sent in its place, in id order. Events (and the ``status`` message of a change, which
follows its event, held no longer than that event even while newer events keep settling) are therefore up
to about ``event_settle_s`` late; metrics are not held. Once the
job is final nothing writes events any more, so what a poll finds then is sent at once.
"""

import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import anyio
from anyio.lowlevel import RunVar
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from api.deps import CurrentProject, SessionDep, SettingsDep
from api.errors import ApiError
from api.schemas import EventPublic
from api.services.jobs import job_or_404
from jobs.store import crud
from jobs.store.db import session_scope
from jobs.store.models import FINAL_STATUSES

router = APIRouter(prefix="/jobs", tags=["jobs"])

METRIC_BATCH = 2000
"""Metric rows read per poll at most."""
EVENT_BATCH = 500
"""Event rows read per poll at most."""
EVENT_SETTLE_S = 1.0
"""How long an event row must have been visible before it is sent (see the module docstring)."""
POLL_THREADS = 8
"""Threads the streams' database polls share (per process): apart from the request threadpool, so that many
open streams can neither take its threads from the other routes nor hold more than this many connections."""
_poll_limiter: RunVar[anyio.CapacityLimiter] = RunVar("stream_poll_limiter")


def poll_limiter() -> anyio.CapacityLimiter:
    """The event loop's limiter of stream polls."""
    try:
        return _poll_limiter.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(POLL_THREADS)
        _poll_limiter.set(limiter)
        return limiter


@dataclass(frozen=True)
class Cursor:
    metric_id: int = 0
    event_id: int = 0

    def __str__(self) -> str:
        return f"{self.metric_id}-{self.event_id}"

    @classmethod
    def parse(cls, text: str) -> "Cursor":
        metric_id, _, event_id = text.strip().partition("-")
        if not (metric_id.isdigit() and event_id.isdigit()):
            raise ValueError(text)
        cursor = cls(int(metric_id), int(event_id))
        if max(cursor.metric_id, cursor.event_id) > 2**63 - 1:  # row ids are BIGINT
            raise ValueError(text)
        return cursor


@dataclass
class Poll:
    """What one poll of the database found (plain data: the session is closed by then)."""

    status: str | None
    """None when the job is gone."""
    step: int = 0
    error: dict[str, str] | None = None
    metric_groups: list[tuple[int, int, dict[str, float]]] = field(default_factory=list)
    """(last row id, step, {name: value}) per run of consecutive rows of one step."""
    events: list[dict[str, Any]] = field(default_factory=list)
    more: bool = False
    """A batch was full: poll again at once."""


def poll(database_url: str, job_id: str, cursor: Cursor) -> Poll:
    with session_scope(database_url) as session:
        # The status is read first: once it is final, the rows read after it are all there will be.
        job = crud.get_job(session, job_id=job_id)
        if job is None:
            return Poll(status=None)
        error = {"code": job.error_code, "message": job.error_message or ""} if job.error_code else None
        found = Poll(status=job.status, step=job.step, error=error)
        rows = crud.metrics_after(session, job_id=job_id, after=cursor.metric_id, limit=METRIC_BATCH)
        for row in rows:
            if found.metric_groups and found.metric_groups[-1][1] == row.step:
                _, step, values = found.metric_groups[-1]
                found.metric_groups[-1] = (row.id, step, {**values, row.name: row.value})
            else:
                found.metric_groups.append((row.id, row.step, {row.name: row.value}))
        if len(rows) == METRIC_BATCH:
            found.more = True
            if len(found.metric_groups) > 1:  # the last step may continue in the next batch: send it whole then
                found.metric_groups.pop()
        events, more_events = crud.list_events(session, job_id=job_id, after=cursor.event_id, limit=EVENT_BATCH)
        found.events = [EventPublic.of(row).model_dump(mode="json") for row in events]
        found.more = found.more or more_events
        return found


def _json_safe(value: Any) -> Any:
    """NaN and infinities (a diverged loss) as null, as in the JSON responses."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def sse(event: str, data: Any, cursor: Cursor) -> str:
    payload = json.dumps(_json_safe(data), separators=(",", ":"), allow_nan=False)
    return f"id: {cursor}\nevent: {event}\ndata: {payload}\n\n"


async def job_events(
    database_url: str,
    job_id: str,
    cursor: Cursor,
    poll_interval: float,
    heartbeat_interval: float,
    event_settle_s: float = EVENT_SETTLE_S,
) -> AsyncIterator[str]:
    status: str | None = None
    last_sent = time.monotonic()
    first_seen: dict[int, float] = {}
    """Event id → when a poll of this connection first returned it (monotonic, after that poll)."""
    while True:
        polled_at = time.monotonic()  # before the poll: rows seen earlier than polled_at - settle have settled
        found = await anyio.to_thread.run_sync(poll, database_url, job_id, cursor, limiter=poll_limiter())
        if found.status is None:
            yield sse("end", {"status": None}, cursor)
            return
        seen_at = time.monotonic()
        final = found.status in FINAL_STATUSES
        messages = []
        if status is None:  # the first message of a connection: the current status
            status = found.status
            messages.append(sse("status", {"status": status, "step": found.step, "error": found.error}, cursor))
        for last_id, step, values in found.metric_groups:
            cursor = Cursor(last_id, cursor.event_id)
            messages.append(sse("metrics", {"step": step, "metrics": values}, cursor))
        held = False
        status_sent = None  # the status of the newest status-change event sent now: its message may follow it
        for event in found.events:  # every event of this poll starts settling now, not once those before are sent
            first_seen.setdefault(event["id"], seen_at)
        for event in found.events:
            if not final and first_seen[event["id"]] > polled_at - event_settle_s:
                held = True  # this one (and so every later one) waits for a later poll
                break
            first_seen.pop(event["id"], None)
            cursor = Cursor(cursor.metric_id, event["id"])
            messages.append(sse("event", event, cursor))
            if event["kind"] == "status":
                status_sent = event["data"].get("status")
        if found.status != status and (not held or status_sent == found.status):
            status = found.status
            messages.append(sse("status", {"status": status, "step": found.step, "error": found.error}, cursor))
        finished = final and not found.more
        if finished:
            messages.append(sse("end", {"status": status}, cursor))
        if messages:
            yield "".join(messages)
            last_sent = time.monotonic()
        if finished:
            return
        if found.more and not held:
            continue
        if time.monotonic() - last_sent >= heartbeat_interval:
            yield ": keep-alive\n\n"
            last_sent = time.monotonic()
        await anyio.sleep(poll_interval)


@router.get(
    "/{job_id}/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events until the job ends."}},
)
def stream_job(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    project: CurrentProject,
    job_id: str,
    last_event_id_header: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
    last_event_id: Annotated[
        str | None, Query(description="Resume after this cursor (the Last-Event-ID header wins when both are sent).")
    ] = None,
) -> StreamingResponse:
    """Stream the job's metrics, events and status changes until it is final (``event: end``)."""
    job = job_or_404(session, project, job_id)
    resume_from = last_event_id_header or last_event_id
    try:
        cursor = Cursor.parse(resume_from) if resume_from else Cursor()
    except ValueError:
        param = "Last-Event-ID" if last_event_id_header else "last_event_id"
        raise ApiError(
            422, "invalid_request", f"not a stream cursor: {resume_from!r} (expected '<n>-<m>')", param=param
        ) from None
    state = request.app.state
    settle = getattr(state, "event_settle_s", EVENT_SETTLE_S)
    body = job_events(
        settings.resolved_database_url, job.id, cursor, state.poll_interval, state.heartbeat_interval, settle
    )
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)
