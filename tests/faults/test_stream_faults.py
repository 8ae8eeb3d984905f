"""The SSE stream under faults (issue 4, fault 4, and the stream cursor):

- the API process is killed (SIGKILL) while a client follows a job's stream, then started again on the same
  port: the client reconnects with ``Last-Event-ID`` and gets every later message once — real
  ``rlhf api`` and ``rlhf worker --queues train`` processes on PostgreSQL and Redis;
- events committed out of id order (two PostgreSQL transactions, the first one committing last) reach a
  live stream once each, in id order: none is skipped by the cursor.

PostgreSQL and Redis tests skip when the server is unreachable, except under ``CI=true``.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import redis

from api.routes.stream import Cursor, job_events
from jobs.client import Client, ClientError, SseMessage, parse_sse
from jobs.store import crud, db, migrate
from jobs.store.models import utcnow
from tests.helpers import free_port, wait_until
from tests.services import postgres_database, unavailable

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = "redis://127.0.0.1:6379/12"
"""A Redis database of this module's own (flushed before and after each test)."""
# kombu's SQLAlchemy transport still uses a loader option SQLAlchemy 2.1 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")


# --- services ----------------------------------------------------------------------------------


@pytest.fixture
def fresh_pg() -> Iterator[str]:
    """A fresh, empty PostgreSQL database (not migrated); dropped after the test."""
    with postgres_database("rlhf_stream", migrated=False) as url:
        yield url


@pytest.fixture
def fresh_redis() -> Iterator[str]:
    connection = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        connection.flushdb()
    except redis.ConnectionError as e:
        unavailable("Redis", e)
    try:
        yield REDIS_URL
    finally:
        connection.flushdb()
        connection.close()


@dataclass
class Service:
    """``rlhf`` commands as real processes (each in its own process group) against one database and broker."""

    data_dir: Path
    database_url: str
    broker_url: str
    port: int = field(default_factory=free_port)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLHF_")}
        return {
            **env,
            "RLHF_ENVIRONMENT": "production",
            "RLHF_DATA_DIR": str(self.data_dir),
            "RLHF_DATABASE_URL": self.database_url,
            "RLHF_BROKER_URL": self.broker_url,
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",  # a small model on a small machine: one thread per process, no contention
        }

    def run(self, *args: str) -> str:
        """``rlhf ARGS`` to completion; its standard output."""
        done = subprocess.run(
            [sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=self.env(), capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, f"rlhf {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def start(self, name: str, *args: str) -> None:
        log = (self.data_dir / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=self.env(), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()

    def start_api(self) -> None:
        self.start("api", "api", "--port", str(self.port))

    def api_ready(self) -> bool:
        assert self.processes["api"].poll() is None, f"the API exited\n{self.logs()}"
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self, name: str) -> None:
        """SIGKILL the process group of ``name``; waits until it is gone."""
        process = self.processes[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def close(self) -> None:
        for name in self.processes:
            self.kill(name)

    def logs(self, chars: int = 3000) -> str:
        parts = []
        for name in self.processes:
            log = self.data_dir / f"{name}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            parts.append(f"--- {name} ({log}) ---\n{text[-chars:]}")
        return "\n".join(parts)


@pytest.fixture
def service(fresh_pg: str, fresh_redis: str, tmp_path: Path) -> Iterator[Service]:
    """A migrated database, an API key, and the API plus a train worker as separate processes."""
    svc = Service(tmp_path, fresh_pg, fresh_redis)
    try:
        svc.run("db", "upgrade")
        svc.start_api()
        svc.start("worker", "worker", "--queues", "train")
        wait_until(svc.api_ready, 60, "the API to be ready", svc.logs)
        yield svc
    finally:
        svc.close()


def all_events(c: Client, job_id: str) -> list[dict[str, Any]]:
    found, after = [], None
    while True:
        params: dict[str, Any] = {"limit": 100, **({"after": after} if after is not None else {})}
        page = c.request("GET", f"/v1/jobs/{job_id}/events", params=params)
        found += page["data"]
        if not page["has_more"]:
            return found
        after = found[-1]["id"]


# --- fault 4: the API restarted under a live stream --------------------------------------------

STEPS = 150


def test_stream_survives_an_api_restart(service: Service) -> None:
    key = json.loads(service.run("keys", "create", "--project", "stream-faults").strip().splitlines()[-1])["api_key"]
    c = Client(service.url, key, timeout=30)
    stream_requests: list[str | None] = []  # the Last-Event-ID of each stream request
    c.http.event_hooks["request"].append(
        lambda r: stream_requests.append(r.headers.get("Last-Event-ID")) if r.url.path.endswith("/stream") else None
    )
    spec = {
        "type": "sft",
        "model": "builtin:tiny",
        "dataset": "builtin:reviews-sft",
        "hyperparameters": {"max_steps": STEPS, "batch_size": 16, "learning_rate": 1e-3},
        "checkpoint_every": 100,
    }
    job_id = c.create_job(spec)["id"]

    received: list[SseMessage] = []
    failure: list[BaseException] = []

    def follow() -> None:
        try:
            for message in c.stream(job_id, reconnect_for=60):
                received.append(message)
        except BaseException as e:
            failure.append(e)

    def steps() -> list[int]:
        return [m.data["step"] for m in list(received) if m.event == "metrics"]

    def state() -> str:
        return f"{len(received)} messages, steps up to {max(steps(), default=0)}; {failure}\n{service.logs()}"

    follower = threading.Thread(target=follow, name="sse-follower", daemon=True)
    follower.start()
    wait_until(lambda: len(steps()) >= 20, 120, "the stream to deliver 20 steps", state)

    # SIGKILL the API mid-stream; the worker keeps training. Down for a while (the client's reconnects are
    # refused), then a new API process on the same port.
    service.kill("api")
    at_kill = len(steps())
    assert at_kill < STEPS, "the job ended before the API was killed: make it longer"
    time.sleep(1.5)
    assert follower.is_alive(), f"the client gave up when the API went away: {failure}"
    service.start_api()
    wait_until(service.api_ready, 60, "the restarted API to be ready", service.logs)

    follower.join(timeout=180)
    assert not follower.is_alive(), f"the stream did not end: {state()}"
    assert not failure, f"the stream failed: {failure[0]!r}\n{service.logs()}"

    job = c.get_job(job_id)
    assert job["status"] == "succeeded", job
    assert received[-1].event == "end" and received[-1].data == {"status": "succeeded"}
    assert len(stream_requests) >= 2 and stream_requests[0] is None, stream_requests
    assert all(stream_requests[1:]), f"a reconnect without Last-Event-ID: {stream_requests}"
    assert steps() == list(range(1, STEPS + 1)), f"metrics steps not 1..{STEPS} once each, in order: {state()}"
    assert len(steps()) > at_kill, "nothing arrived after the restart"
    event_ids = [m.data["id"] for m in received if m.event == "event"]
    assert event_ids == sorted(set(event_ids)), f"events repeated or out of order: {event_ids}"
    assert event_ids == [e["id"] for e in all_events(c, job_id)], "the stream's events differ from the job's"
    history = c.request("GET", f"/v1/jobs/{job_id}/metrics", params={"names": "loss/sft"})["data"]["loss/sft"]
    streamed = {m.data["step"]: m.data["metrics"]["loss/sft"] for m in received if m.event == "metrics"}
    assert {p["step"]: p["value"] for p in history} == streamed


# --- the cursor: events committed out of id order ----------------------------------------------


def collect(url: str, job_id: str, settle: float, out: list[SseMessage]) -> None:
    """Run the stream's generator (what ``GET /v1/jobs/{id}/stream`` sends) until ``end``."""

    async def main() -> None:
        buffer = ""
        async for chunk in job_events(url, job_id, Cursor(), 0.02, 60.0, settle):
            buffer += chunk
            complete, _, buffer = buffer.rpartition("\n\n")
            out.extend(parse_sse(iter((complete + "\n\n").split("\n"))))

    anyio.run(main)


def test_events_committed_out_of_id_order_are_streamed_once_in_order(fresh_pg: str) -> None:
    migrate.upgrade(fresh_pg)
    with db.session_scope(fresh_pg) as session:
        project = crud.create_project(session, name="cursor")
        job, _ = crud.create_job(session, project_id=project.id, spec={"type": "sft"}, idempotency_key=None)
        job_id = job.id
        assert crud.transition(session, job_id=job_id, from_statuses=("queued",), to="running")
    with db.session_scope(fresh_pg) as session:
        before = [e.id for e in crud.list_events(session, job_id=job_id, after=None, limit=100)[0]]

    # Transaction A takes the next event id but commits last (the API's cancel racing a worker's write).
    slow = db.session_factory(fresh_pg)()
    try:
        late = crud.add_event(slow, job_id=job_id, kind="info", message="committed late").id
        with db.session_scope(fresh_pg) as session:
            early = crud.add_event(session, job_id=job_id, kind="info", message="committed first").id
        assert early > late

        received: list[SseMessage] = []
        streaming = threading.Thread(target=collect, args=(fresh_pg, job_id, 2.0, received), daemon=True)
        streaming.start()
        wait_until(lambda: received, 10, "the stream's first message")
        time.sleep(0.3)  # a dozen polls see `early`, not `late`
        slow.commit()
    finally:
        slow.close()
    with db.session_scope(fresh_pg) as session:
        crud.transition(session, job_id=job_id, from_statuses=("running",), to="succeeded", finished_at=utcnow())
    streaming.join(timeout=30)
    assert not streaming.is_alive(), "the stream did not end"

    with db.session_scope(fresh_pg) as session:
        recorded = [e.id for e in crud.list_events(session, job_id=job_id, after=None, limit=100)[0]]
    sent = [m.data["id"] for m in received if m.event == "event"]
    assert late in recorded and early in recorded
    assert sent == recorded, f"events sent {sent}, recorded {recorded} (late {late}, early {early})"
    assert sent[: len(before)] == before
    # The status change follows its event; the stream ends with the final status.
    assert [m.event for m in received[-3:]] == ["event", "status", "end"]
    assert received[-2].data["status"] == "succeeded"


def test_the_client_gives_up_on_a_stream_whose_api_stays_down() -> None:
    c = Client(f"http://127.0.0.1:{free_port()}", "no-key")  # nothing listens there
    started = time.monotonic()
    with pytest.raises(ClientError) as error:
        next(c.stream("job_000000000000", reconnect_for=1.0))
    assert error.value.code == "stream_unavailable" and "ConnectError" in str(error.value)
    assert time.monotonic() - started < 10, "the reconnect budget was not kept"
