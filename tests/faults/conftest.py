"""Fault tests: real train workers (``python -m jobs.cli worker --queues train``) and ``rlhf serve`` on the
real services, broken on purpose — killed, stopped, their broker restarted, their database connections
cut — with the outcome checked in the database and on disk.

Two backends: the embedded default (SQLite database, ``sqla+sqlite`` broker) and production's PostgreSQL +
Redis (a fresh database per module, dropped after; Redis database 13, flushed). Leases are 3 s, so a lost
worker is noticed in seconds. The PPO job starts from a tiny SFT model and reward model trained once per
session, and :func:`reference_run` is that job run in this process without any fault.

These are the fixtures; what the tests run and check with is in ``tests.faults.helpers``.

PostgreSQL and Redis tests skip when the server is unreachable, except under ``CI=true``.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from engine.run import run_job as run_engine
from engine.spec.config import JobSpec
from tests.engine.helpers import Pretrained
from tests.faults.helpers import (
    PPO_STEPS,
    REDIS_URL,
    TORCH_THREADS,
    Backend,
    Processes,
    Reference,
    ensure_redis,
    make_backend,
    ppo_spec,
    redis_client,
)
from tests.recorder import Recorder
from tests.services import postgres_database, unavailable

# --- services ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for the module, migrated; dropped after."""
    with postgres_database("rlhf_faults") as url:
        yield url


@pytest.fixture
def redis_db() -> Iterator[str]:
    """Redis database 13, empty before and after the test."""
    connection = redis_client()
    try:
        connection.flushdb()
    except redis.ConnectionError as e:
        unavailable("Redis", e)
    try:
        yield REDIS_URL
    finally:
        ensure_redis()
        connection.flushdb()
        connection.close()


# --- backends ----------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "redis-postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """The embedded default (SQLite database and broker), then PostgreSQL + Redis."""
    if request.param == "sqlite":
        return make_backend("sqlite", tmp_path / "data")
    backend: Backend = request.getfixturevalue("pg_backend")
    return backend


@pytest.fixture
def pg_backend(pg_url: str, redis_db: str, tmp_path: Path) -> Backend:
    return make_backend("redis-postgresql", tmp_path / "data", pg_url, redis_db)


# --- the PPO job -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Pretrained:
    root = tmp_path_factory.mktemp("pretrained")
    cpu = torch.device("cpu")
    sft = {"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft",
           "hyperparameters": {"max_steps": 4, "batch_size": 8, "learning_rate": 3e-3}}  # fmt: skip
    assert run_engine(JobSpec.model_validate(sft), root / "sft", device=cpu).status == "succeeded"
    rm = {"type": "rm", "model": str(root / "sft"), "dataset": "builtin:reviews-prefs",
          "hyperparameters": {"max_steps": 4, "batch_size": 8, "learning_rate": 1e-3}}  # fmt: skip
    assert run_engine(JobSpec.model_validate(rm), root / "rm", device=cpu).status == "succeeded"
    return Pretrained(root / "sft", root / "rm")


@pytest.fixture(scope="session")
def reference_run(pretrained: Pretrained, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    out_dir = tmp_path_factory.mktemp("reference")
    spec = JobSpec.model_validate(ppo_spec(str(pretrained.sft), str(pretrained.rm)))
    recorder = Recorder()
    threads = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)  # as in the workers: the same numbers, bit for bit
    try:
        result = run_engine(spec, out_dir, recorder, device=torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert (result.status, result.step) == ("succeeded", PPO_STEPS)
    return Reference(out_dir, recorder.metrics)


# --- processes ---------------------------------------------------------------------------------


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.close()
