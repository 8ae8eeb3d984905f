"""A job across hosts (``resources.num_nodes: 2``), on one machine: two train workers as two "hosts" on loopback,
PostgreSQL and Redis between them. The worker that claims the job invites the other, which joins torchrun's c10d
rendezvous; the job trains sharded (FSDP2, one process per host). Its joined host is killed mid-job (frozen, then
killed with its ranks, as a host that dies): the attempt is lost, the job goes back to the queue, and with a new
host it resumes from its last sharded checkpoint, its steps after that checkpoint the same, bit for bit, as the lost
attempt's."""

import base64
import contextlib
import os
import pickle
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import redis
from torch.distributed import TCPStore

from engine.callbacks import StopRequest
from engine.core.loop import JobResult
from engine.spec.config import JobSpec
from jobs.celery_app import make_celery, send_job
from jobs.distributed import Hosts, Invitation, RankFailure, join_distributed, run_distributed
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
        run_distributed(job, tmp_path, Recorder(), 1, Hosts(2, "127.0.0.1", "job_x", 1, 3, invited.append, b"secret"))
    assert failure.value.code == "hosts_unavailable"
    assert "queue 'train'" in failure.value.message and "RLHF_NODE_ADDRESS" in failure.value.message
    [invitation] = invited
    assert (invitation.run_id, invitation.num_nodes, invitation.num_processes) == ("job_x-1", 2, 1)


class Payload:
    """What an attacker wants unpickled: a command run as the service's user."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def listening(process: psutil.Process) -> list[tuple[str, int]]:
    """The TCP ports ``process`` listens on (what ``ss -ltnp`` shows another user of the host)."""
    return [(c.laddr.ip, c.laddr.port) for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]


def attack(address: tuple[str, int], payload: bytes, run_ids: list[str]) -> None:
    """A port scan (connect and close), garbage, a pickle, and a pickle written into ``address`` as a c10d store,
    under the rendezvous's keys (torchrun's c10d rendezvous unpickles its state from its store)."""
    with contextlib.suppress(OSError):
        socket.create_connection(address, timeout=2).close()
    for data in (b"\x00\x00\x00\x10" + os.urandom(200), len(payload).to_bytes(4, "big") + payload):
        with contextlib.suppress(OSError), socket.create_connection(address, timeout=2) as peer:
            peer.sendall(data)
            peer.recv(64)
    with contextlib.suppress(Exception):
        store = TCPStore(address[0], address[1], is_master=False, timeout=timedelta(seconds=3))
        keys = {k for k in store.list_keys() if k.startswith("torch.rendezvous.")}
        for key in keys | {f"torch.rendezvous.{run_id}" for run_id in run_ids}:
            store.set(key, base64.b64encode(payload))


def test_an_attacker_without_the_key_runs_nothing_and_holds_nothing_up(tmp_path: Path) -> None:
    """Issue 39 (4.1, 4.2): another local user, knowing what the host shows (the channel's address, in the
    invitation in the broker in clear; torchrun's command line and the ports it listens on), attacks: a port scan,
    garbage, a connection that says nothing, a pickle on every port and into every store. Nothing is unpickled,
    their connections are dropped, and the job trains on both hosts."""
    job = JobSpec.model_validate(sft_spec(hyperparameters={"max_steps": 2}, resources={"num_nodes": 2}))
    marker, secret = tmp_path / "attacker-was-here", b"the hosts' secret"
    payload = pickle.dumps(Payload(marker))
    joined: list[int | None] = []

    def invite(invitation: Invitation) -> None:
        host, _, port = invitation.channel.rpartition(":")
        channel = (host, int(port))

        def attacker_then_host() -> None:
            silent = socket.create_connection(channel)  # says nothing, and stays
            attack(channel, payload, [])
            threading.Thread(target=lambda: joined.append(join_distributed(invitation, secret, lambda: True))).start()
            wait_for("torchrun's store", torchruns, 60, [])
            for torchrun in torchruns():
                run_ids = [arg.partition("=")[2] for arg in torchrun.cmdline() if arg.startswith("--rdzv-id=")]
                for address in listening(torchrun):
                    attack(address, payload, run_ids)
            time.sleep(6)  # torchrun's c10d rendezvous reads its state again (keep-alive)
            silent.close()

        threading.Thread(target=attacker_then_host, daemon=True).start()

    recorder = Recorder()
    result = run_distributed(job, tmp_path / "job", recorder, 1, Hosts(2, "127.0.0.1", "job_x", 1, 120, invite, secret))
    assert (result.status, result.step, sorted(recorder.metrics)) == ("succeeded", 2, [1, 2])
    wait_for("the joined host's end", lambda: joined, 60, [])
    assert joined[0] is not None, "the second host did not take part"
    assert not marker.exists()


def torchruns() -> list[psutil.Process]:
    """This process's torchrun children (the claiming worker's, the joined host's) that listen on some port."""
    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if "torch.distributed.run" in " ".join(child.cmdline()) and listening(child):
                found.append(child)
    return found


def test_a_cancel_ends_a_job_across_hosts_while_it_waits_for_them(tmp_path: Path) -> None:
    """Issue 39 (4.2): a port scan of the channel while the job waits for its other host, then a cancel: the job
    ends cancelled at once, not after the join timeout (10 minutes here)."""
    job = JobSpec.model_validate(sft_spec(resources={"num_nodes": 2}))

    class CancelledAfterTheScan(Recorder):
        scanned = False

        def should_stop(self) -> StopRequest | None:
            return "cancel" if self.scanned else None

    recorder = CancelledAfterTheScan()

    def invite(invitation: Invitation) -> None:  # nobody joins; someone scans
        host, _, port = invitation.channel.rpartition(":")
        socket.create_connection((host, int(port))).close()
        recorder.scanned = True

    ended: list[object] = []

    def run() -> None:
        try:
            ended.append(
                run_distributed(job, tmp_path, recorder, 1, Hosts(2, "127.0.0.1", "job_x", 1, 600, invite, b"s"))
            )
        except Exception as e:
            ended.append(e)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=120)  # a bound on waiting, far below the join timeout
    assert ended, "the cancelled job still waits for its hosts"
    [result] = ended
    assert isinstance(result, JobResult) and (result.status, result.checkpoint) == ("cancelled", None)


def test_a_job_with_more_hosts_than_workers_lets_the_joined_ones_go_having_run_nothing(tmp_path: Path) -> None:
    """Issue 39 (4.13): three hosts wanted, one more worker there. Nothing starts before every host joined, and when
    the wait ends the joined host is let go at once, having run no process: the job fails with hosts_unavailable."""
    job = JobSpec.model_validate(sft_spec(hyperparameters={"batch_size": 3}, resources={"num_nodes": 3}))
    joined: list[int | None] = []
    invitations: list[Invitation] = []

    def invite(invitation: Invitation) -> None:  # the first invitation is taken; nobody takes the second
        invitations.append(invitation)
        if len(invitations) == 1:
            host = threading.Thread(target=lambda: joined.append(join_distributed(invitation, b"s", lambda: True)))
            host.start()

    with pytest.raises(RankFailure) as failure:
        run_distributed(job, tmp_path, Recorder(), 1, Hosts(3, "127.0.0.1", "job_x", 1, 5, invite, b"s"))
    assert failure.value.code == "hosts_unavailable"
    assert "3 hosts (resources.num_nodes), and only 2 joined" in failure.value.message
    wait_for("the joined host let go", lambda: joined, 30, [])
    assert joined == [None]  # let go before any process of the job started there
    assert not torchruns()
