"""Load on the production setup: PostgreSQL (a fresh database) + Redis broker, separate ``rlhf api`` (uvicorn)
and ``rlhf worker --queues train`` processes.

It trains a small SFT model and reward model, starts a long PPO job, measures the PPO steps with no client
load, then for ``--seconds`` runs ``--pollers`` clients polling ``GET /v1/jobs/{id}`` and ``--streams`` clients
following the PPO job's SSE stream (``GET /v1/jobs/{id}/stream``). Afterwards the job is cancelled, each
stream runs to its ``end`` message, and what every stream received is compared with the database's history:
every metrics step and every event exactly once, in order.

Printed: requests/s, p50/p99 latency and errors of the polls; stream messages, reconnects, lost and
duplicated steps and events; the PPO step time (median ``time/step_s``, and the wall-clock time per step
from the job's progress) before the load and during it.

Run: ``python benchmarks/load_production.py [--seconds 60]`` (PostgreSQL on 127.0.0.1:5432 as user
``postgres``, Redis on 127.0.0.1:6379; the script creates and drops its own database and flushes the Redis
database it uses, 11 by default).
"""

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis

from jobs.client import Client

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
FINAL = ("succeeded", "failed", "cancelled")


@dataclass
class Services:
    data_dir: Path
    database_url: str
    broker_url: str
    port: int
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
        }

    def run(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=self.env(), capture_output=True, text=True,
            check=True, timeout=300,
        )  # fmt: skip
        return done.stdout

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        with (self.data_dir / f"{name}.log").open("ab") as log:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env={**self.env(), **(env or {})}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def stop(self) -> None:
        for process in self.processes.values():
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=20)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, condition: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
    return value


def finished(c: Client, job_id: str, timeout: float = 900) -> dict[str, Any]:
    job = wait_for(f"job {job_id}", lambda: (j := c.get_job(job_id))["status"] in FINAL and j, timeout)
    if job["status"] != "succeeded":
        raise SystemExit(f"job {job_id} ended {job['status']}: {job.get('error')}")
    return dict(job)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ms(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000 if len(values) > 1 else float("nan")


# --- the load ------------------------------------------------------------------------------------


@dataclass
class Polls:
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class Stream:
    steps: list[int] = field(default_factory=list)
    event_ids: list[int] = field(default_factory=list)
    messages: int = 0
    reconnects: int = 0
    errors: list[str] = field(default_factory=list)
    ended: bool = False


async def poller(http: httpx.AsyncClient, job_id: str, deadline: float, out: Polls) -> None:
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        try:
            response = await http.get(f"/v1/jobs/{job_id}")
            if response.status_code != 200:
                out.errors.append(f"HTTP {response.status_code}")
                continue
        except httpx.HTTPError as e:
            out.errors.append(repr(e))
            continue
        out.latencies.append(time.perf_counter() - t0)


async def follower(http: httpx.AsyncClient, job_id: str, out: Stream, give_up_at: Callable[[], float]) -> None:
    """Follow the stream from its start to ``end``, reconnecting with ``Last-Event-ID`` (counted) if it drops."""
    last_id: str | None = None
    while time.monotonic() < give_up_at():
        headers = {"Last-Event-ID": last_id} if last_id else {}
        try:
            async with http.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers) as response:
                if response.status_code != 200:
                    out.errors.append(f"HTTP {response.status_code}")
                    await asyncio.sleep(0.5)
                    continue
                event, data, event_id = "message", [], None
                async for line in response.aiter_lines():
                    if line.startswith(":"):
                        continue
                    if line:
                        name, _, value = line.partition(":")
                        value = value.removeprefix(" ")
                        if name == "event":
                            event = value
                        elif name == "data":
                            data.append(value)
                        elif name == "id":
                            event_id = value
                        continue
                    if not data:
                        continue
                    payload = json.loads("\n".join(data))
                    out.messages += 1
                    last_id = event_id or last_id
                    if event == "metrics":
                        out.steps.append(payload["step"])
                    elif event == "event":
                        out.event_ids.append(payload["id"])
                    elif event == "end":
                        out.ended = True
                        return
                    event, data = "message", []
        except httpx.HTTPError as e:
            out.errors.append(repr(e))
        out.reconnects += 1
        await asyncio.sleep(0.2)


async def load(
    url: str, key: str, job_id: str, seconds: float, pollers: int, streams: int, stop_job: Callable[[], None]
) -> tuple[Polls, list[Stream], float]:
    """Pollers for ``seconds``; streams from now until their ``end`` (after ``stop_job``). Returns the polls,
    the streams and the polling time."""
    headers = {"Authorization": f"Bearer {key}"}
    # Idle connections are dropped before uvicorn's 5 s keep-alive timeout would close them under a request.
    n = pollers + streams + 10
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=2.0)
    timeout = httpx.Timeout(30.0, read=90.0)
    polls, followed = Polls(), [Stream() for _ in range(streams)]
    give_up = [float("inf")]
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) as http:
        stream_tasks = [asyncio.create_task(follower(http, job_id, s, lambda: give_up[0])) for s in followed]
        start = time.monotonic()
        await asyncio.gather(*(poller(http, job_id, start + seconds, polls) for _ in range(pollers)))
        elapsed = time.monotonic() - start
        await asyncio.to_thread(stop_job)
        give_up[0] = time.monotonic() + 120
        await asyncio.gather(*stream_tasks)
    return polls, followed, elapsed


# --- the run -------------------------------------------------------------------------------------


def step_times(c: Client, job_id: str) -> dict[int, float]:
    data = c.request("GET", f"/v1/jobs/{job_id}/metrics", params={"names": "time/step_s"})["data"]
    return {p["step"]: p["value"] for p in data.get("time/step_s", [])}


def all_event_ids(c: Client, job_id: str) -> list[int]:
    ids: list[int] = []
    after = None
    while True:
        params: dict[str, Any] = {"limit": 100, **({"after": after} if after is not None else {})}
        page = c.request("GET", f"/v1/jobs/{job_id}/events", params=params)
        ids += [e["id"] for e in page["data"]]
        if not page["has_more"]:
            return ids
        after = ids[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="duration of the load")
    parser.add_argument("--pollers", type=int, default=50)
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--baseline-steps", type=int, default=15, help="PPO steps measured before the load")
    parser.add_argument("--redis-db", type=int, default=11)
    parser.add_argument(
        "--worker-threads", type=int, default=1, help="torch threads of the train worker (0: torch's default)"
    )
    parser.add_argument("--port", type=int, default=0, help="API port (default: a free one)")
    parser.add_argument("--logs", type=Path, help="copy the API and worker logs to this folder at the end")
    args = parser.parse_args()

    name = f"rlhf_load_{secrets.token_hex(4)}"
    broker = f"redis://127.0.0.1:6379/{args.redis_db}"
    admin = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5)
    admin.execute(f'CREATE DATABASE "{name}"')
    redis.Redis.from_url(broker).flushdb()
    with tempfile.TemporaryDirectory(prefix="rlhf-load-") as tmp:
        services = Services(Path(tmp), PG_URL.format(name=name), broker, args.port or free_port())
        try:
            run(services, args)
        finally:
            services.stop()
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                for log in Path(tmp).glob("*.log"):
                    shutil.copy(log, args.logs / log.name)
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
            admin.close()
            redis.Redis.from_url(broker).flushdb()


def run(services: Services, args: argparse.Namespace) -> None:
    services.run("db", "upgrade")
    key = json.loads(services.run("keys", "create", "--project", "load").strip().splitlines()[-1])["api_key"]
    services.start("api", "api", "--port", str(services.port))
    threads = {"OMP_NUM_THREADS": str(args.worker_threads)} if args.worker_threads else {}
    services.start("worker", "worker", "--queues", "train", env=threads)
    c = Client(services.url, key, timeout=60)

    def ready() -> bool:
        try:
            return httpx.get(f"{services.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for("the API", ready, 60)
    t0 = time.monotonic()
    sft = c.create_job({"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft",
                        "hyperparameters": {"max_steps": 60, "batch_size": 16, "learning_rate": 3e-3}})  # fmt: skip
    finished(c, sft["id"])
    rm = c.create_job({"type": "rm", "model": f"job:{sft['id']}", "dataset": "builtin:reviews-prefs",
                       "hyperparameters": {"max_steps": 20, "batch_size": 16}})  # fmt: skip
    finished(c, rm["id"])
    print(f"SFT and RM trained in {time.monotonic() - t0:.0f} s", flush=True)

    ppo = c.create_job(
        {
            "type": "ppo",
            "model": f"job:{sft['id']}",
            "reward_model": f"job:{rm['id']}",
            "dataset": "builtin:reviews-prompts",
            "hyperparameters": {
                "total_steps": 100_000,
                "batch_size": 16,
                "mini_batch_size": 16,
                "response_length": 12,
                "learning_rate": 3e-5,
            },
            "checkpoint_every": 20,
            "keep_checkpoints": 2,
        }
    )
    job_id = ppo["id"]
    first = wait_for("PPO to start", lambda: c.get_job(job_id)["step"], 300, 0.05)  # step 1 warms up: not counted
    baseline_start = time.monotonic()
    before = wait_for(
        "the steps without load",
        lambda: (s := c.get_job(job_id)["step"]) >= first + args.baseline_steps and s,
        600,
        0.05,
    )
    baseline_s = time.monotonic() - baseline_start
    print(f"PPO steps {first + 1}-{before} without load; now {args.pollers} pollers and {args.streams} streams "
          f"for {args.seconds:.0f} s", flush=True)  # fmt: skip

    load_start = time.monotonic()
    during: list[int] = []

    def stop_job() -> None:
        during.append(c.get_job(job_id)["step"])
        during.append(int((time.monotonic() - load_start) * 1000))
        c.request("POST", f"/v1/jobs/{job_id}/cancel")
        wait_for("the PPO job to stop", lambda: c.get_job(job_id)["status"] in FINAL, 300)

    polls, streams, elapsed = asyncio.run(
        load(services.url, key, job_id, args.seconds, args.pollers, args.streams, stop_job)
    )
    after, load_ms = during

    # Compare every stream with the database.
    times = step_times(c, job_id)
    db_steps = sorted(times)
    db_events = all_event_ids(c, job_id)
    lost_steps = sum(len(set(db_steps) - set(s.steps)) for s in streams)
    dup_steps = sum(len(s.steps) - len(set(s.steps)) for s in streams)
    lost_events = sum(len(set(db_events) - set(s.event_ids)) for s in streams)
    dup_events = sum(len(s.event_ids) - len(set(s.event_ids)) for s in streams)
    in_order = all(s.steps == db_steps and s.event_ids == db_events for s in streams)
    unended = sum(not s.ended for s in streams)
    stream_errors = [e for s in streams for e in s.errors]

    base = [times[s] for s in range(first + 1, before + 1) if s in times]
    loaded = [times[s] for s in range(before + 1, after + 1) if s in times]
    print()
    print(
        f"polls: {len(polls.latencies)} in {elapsed:.1f} s = {len(polls.latencies) / elapsed:.0f} requests/s, "
        f"p50 {ms(polls.latencies, 50):.1f} ms, p99 {ms(polls.latencies, 99):.1f} ms, errors {len(polls.errors)}"
    )
    print(
        f"streams: {len(streams)}, {sum(s.messages for s in streams)} messages, reconnects "
        f"{sum(s.reconnects for s in streams)}, errors {len(stream_errors)}, not ended {unended}"
    )
    print(
        f"stream vs database ({len(db_steps)} steps, {len(db_events)} events per stream): lost steps {lost_steps}, "
        f"duplicated steps {dup_steps}, lost events {lost_events}, duplicated events {dup_events}, "
        f"every stream identical to the history in order: {in_order}"
    )
    print(
        f"PPO time/step_s median: {median(base):.3f} s without load (steps {first + 1}-{before}), "
        f"{median(loaded):.3f} s under load (steps {before + 1}-{after})"
    )
    print(
        f"PPO wall-clock per step: {baseline_s / max(1, before - first):.3f} s without load, "
        f"{load_ms / 1000 / max(1, after - before):.3f} s under load"
    )
    for error in (polls.errors + stream_errors)[:10]:
        print(f"  error: {error}")


if __name__ == "__main__":
    main()
