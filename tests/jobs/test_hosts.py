"""A job across hosts (``resources.num_nodes: 2``), on one machine: two train workers as two "hosts" on loopback,
PostgreSQL and Redis between them. The worker that claims the job invites the other, which joins torchrun's c10d
rendezvous; the job trains sharded (FSDP2, one process per host). Its joined host is killed mid-job (frozen, then
killed with its ranks, as a host that dies): the attempt is lost, the job goes back to the queue, and with a new
host it resumes from its last sharded checkpoint, its steps after that checkpoint the same, bit for bit, as the lost
attempt's."""

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import redis

from engine.spec.config import JobSpec
from jobs.celery_app import make_celery, send_job
from jobs.distributed import Hosts, Invitation, RankFailure, run_distributed
from jobs.store import crud, db
from jobs.store.settings import Settings
from tests.factories import create_job, make_settings, new_project
from tests.jobs.helpers import LEASE_SECONDS, REDIS_URL, counts, events, get_job, metric_series, sft_spec
from tests.jobs.test_worker import worker_process
from tests.recorder import Recorder
from tests.services import unavailable

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")
HOST = {"RLHF_NODE_ADDRESS": "127.0.0.1", "RLHF_JOIN_TIMEOUT_SECONDS": "120"}
STEPS = 8


def values(settings: Settings, job_id: str, name: str) -> dict[int, float]:
    with db.session_scope(settings.resolved_database_url) as session:
        history = crud.metric_history(session, job_id=job_id, names=[name], start_step=None, end_step=None,
                                      max_points=None)  # fmt: skip
    return dict(history.get(name, []))


def wait_for(what: str, check: Callable[[], object], timeout: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
    raise AssertionError(f"no {what} after {timeout} s\n{tails}")


def test_a_job_on_two_hosts_trains_and_resumes_after_one_host_dies(postgresql_url: str, tmp_path: Path) -> None:
    try:
        broker = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
        broker.flushdb()
    except redis.ConnectionError as e:
        unavailable("Redis", e)
    settings = make_settings(tmp_path / "data", postgresql_url, lease_seconds=LEASE_SECONDS, broker_url=REDIS_URL)
    settings.data_dir.mkdir(parents=True)
    spec = sft_spec(
        hyperparameters={"max_steps": STEPS, "batch_size": 8, "gradient_accumulation_steps": 2},
        checkpoint_every=3, seed=5, resources={"num_nodes": 2, "num_processes": 1, "sharding": "fsdp"},
    )  # fmt: skip
    job_id = create_job(settings, new_project(settings).id, spec)
    logs = [tmp_path / f"worker-{name}.log" for name in ("a", "b", "c")]
    client = make_celery(settings)
    try:
        with (
            worker_process(settings, logs[0], "train", **HOST) as a,
            worker_process(settings, logs[1], "train", **HOST) as b,
        ):
            send_job(client, job_id, "train")
            wait_for("step 4", lambda: 4 in values(settings, job_id, "loss/sft"), 180, logs)
            leader = int(str(get_job(settings, job_id).worker).rpartition(":")[2])
            joined = b if leader == a.pid else a
            assert leader in (a.pid, b.pid)
            host = [psutil.Process(joined.pid), *psutil.Process(joined.pid).children(recursive=True)]
            assert len(host) >= 3, "the joined worker runs torchrun and a rank"  # worker, torchrun, rank
            for process in host:  # the host stops dead: what the job recorded until now is the lost attempt's
                process.send_signal(signal.SIGSTOP)
            time.sleep(1)
            lost = {name: values(settings, job_id, name) for name in ("loss/sft", "grad_norm")}
            with db.session_scope(settings.resolved_database_url) as session:
                resume_from = max(c.step for c in crud.list_checkpoints(session, job_id=job_id))
            for process in host:
                process.send_signal(signal.SIGKILL)

            wait_for("second attempt", lambda: get_job(settings, job_id).attempt == 2, 60, logs)
            with worker_process(settings, logs[2], "train", **HOST):  # a new host
                wait_for("the end", lambda: get_job(settings, job_id).status in ("succeeded", "failed"), 180, logs)
    finally:
        broker.flushdb()
        broker.close()
        client.close()

    job = get_job(settings, job_id)
    assert (job.status, job.step, job.attempt, job.error_code) == ("succeeded", STEPS, 2, None)
    [warning] = [e for e in events(settings, job_id) if e.data.get("code") == "worker_lost"]
    assert "goes back to the queue for attempt 2" in warning.message
    assert set(counts(metric_series(settings, job_id))) == {STEPS}  # every step once
    # the steps the lost attempt took after its last checkpoint, taken again from it: the same
    again = [step for step in lost["loss/sft"] if step > resume_from]
    assert again, f"the host was killed at its checkpoint ({resume_from}); nothing to compare"
    for name, before in lost.items():
        now = values(settings, job_id, name)
        assert {s: now[s] for s in again} == {s: before[s] for s in again}, name
    checkpoint = settings.resolved_artifacts_dir / "jobs" / job_id / "checkpoints" / f"step-{STEPS}"
    assert sorted(p.name for p in (checkpoint / "optimizer").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (checkpoint / "policy" / "model.safetensors").is_file()
    assert os.environ.get("RLHF_NODE_ADDRESS") is None  # the hosts' addresses came from their own settings


def test_a_job_whose_other_hosts_never_join_fails_with_hosts_unavailable(tmp_path: Path) -> None:
    """Nobody takes the invitation: the rendezvous gives up after the join timeout, and the job says why."""
    job = JobSpec.model_validate(sft_spec(resources={"num_nodes": 2}))
    invited: list[Invitation] = []
    with pytest.raises(RankFailure) as failure:
        run_distributed(job, tmp_path, Recorder(), 1, Hosts(2, "127.0.0.1", "job_x", 1, 3, invited.append))
    assert failure.value.code == "hosts_unavailable"
    assert "queue 'train'" in failure.value.message and "RLHF_NODE_ADDRESS" in failure.value.message
    [invitation] = invited
    assert (invitation.run_id, invitation.num_nodes, invitation.num_processes) == ("job_x-1", 2, 1)
