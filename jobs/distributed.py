"""One job in several processes: the worker runs the engine under ``torchrun`` (DistributedDataParallel) and
stays the only one that talks to the database.

    worker: runner.run_job → run_distributed()          torchrun --nproc-per-node N -m jobs.rank
    ──────────────────────────────────────────          ─────────────────────────────────────────────
    claims the job, renews its lease; listens on a      each rank joins the process group (NCCL on GPUs,
    private Unix socket; answers rank 0's callbacks     gloo on CPU), connects, is given the spec and the
    with its DbCallbacks (metrics, events,              job folder, and runs engine.run.run_job. Rank 0's
    checkpoints, stop requests); gets the result, or    callbacks are calls over the socket; the others'
    a rank's error                                      report nothing

Rank 0 reports metrics (the loops reduce them over the ranks), writes checkpoints and asks whether to stop;
its answer is broadcast, so all ranks stop together. A pause, a cancel, a worker shutting down (the job is
handed back with a checkpoint) and a lost lease behave as in one process. If the worker dies, torchrun is
told (parent-death signal) and stops the ranks; the job is recovered from its last checkpoint like any other.

Across hosts (``resources.num_nodes``): the claiming worker listens on TCP at its host's address instead, hosts
torchrun's c10d rendezvous store, and invites ``num_nodes - 1`` more train workers of the job's queue (an
:class:`Invitation`, sent as a Celery task); each runs :func:`join_distributed`: its own torchrun, whose ranks
connect to the claiming worker like its own. Only the claiming worker writes to the database. A rank lost without
a word (its host died, its worker was killed) or a collective that broke with it fails the attempt as
``worker_lost``, and the job goes back to the queue for its next attempt, from its last checkpoint.
"""

import contextlib
import ctypes
import logging
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any

import torch

from engine.callbacks import Callbacks
from engine.core.loop import JobResult
from engine.spec.config import JobSpec

log = logging.getLogger(__name__)

CHANNEL_ENV = "RLHF_RANK_CHANNEL"
"""The worker's socket, for the ranks: a Unix socket's path, or ``host:port`` across hosts."""
KEY_ENV = "RLHF_RANK_CHANNEL_KEY"
"""Hex of the socket's authentication key (both ends prove they know it)."""
CALLBACKS = frozenset({"on_start", "on_metrics", "on_samples", "on_event", "on_checkpoint", "should_stop"})
"""What rank 0 may call on the worker's callbacks."""
STOP_GRACE_S = 30
"""How long torchrun has to stop its ranks once the worker is done with them."""
LOST = "worker_lost"
"""A :class:`RankFailure`'s code when a process of the job was lost rather than failed: the attempt is lost, as
with a lost lease, and the job is run again from its last checkpoint."""


class RankFailure(RuntimeError):
    """A rank failed: ``code`` is the job's error code (as :func:`jobs.runner.error_code` gives it), or
    :data:`LOST` when a rank was lost."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Invitation:
    """What another host needs to take part in a job: the claiming worker sends one per host it waits for."""

    job_id: str
    attempt: int
    """The job's attempt: a host joins only while the job runs it."""
    num_nodes: int
    num_processes: int
    """Processes per host."""
    rendezvous: str
    """``host:port`` of the c10d rendezvous store, which the claiming worker's torchrun holds."""
    channel: str
    """``host:port`` where the claiming worker answers the ranks."""
    key: str
    """Hex of the channel's key."""
    join_timeout_s: float
    """How long the rendezvous waits for every host."""

    @property
    def run_id(self) -> str:
        """The rendezvous of this attempt, no other's."""
        return f"{self.job_id}-{self.attempt}"

    def to_message(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Hosts:
    """How the claiming worker runs a job across ``num_nodes`` hosts."""

    num_nodes: int
    address: str
    """This host's address, which the other hosts reach (``RLHF_NODE_ADDRESS``)."""
    job_id: str
    attempt: int
    join_timeout_s: float
    invite: Callable[[Invitation], None]
    """Asks one more train worker of the job's queue to join."""


def torchrun_command(num_processes: int, joining: Invitation | None = None, address: str = "", host: bool = False
                     ) -> list[str]:  # fmt: skip
    """torchrun on one host (``--standalone``), or as one of ``joining.num_nodes`` hosts of a c10d rendezvous
    (``host``: this one holds its store, at ``address``)."""
    if joining is None:
        where = ["--standalone"]
    else:
        where = [
            f"--nnodes={joining.num_nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={joining.rendezvous}",
            f"--rdzv-id={joining.run_id}", f"--local-addr={address}",
            f"--rdzv-conf=join_timeout={round(joining.join_timeout_s)},is_host={int(host)}",
        ]  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={num_processes}",
        "--max-restarts=0", "-m", "jobs.rank",
    ]  # fmt: skip


def run_distributed(
    spec: JobSpec, out_dir: Path, callbacks: Callbacks, num_processes: int, hosts: Hosts | None = None
) -> JobResult:
    """Train ``spec`` in ``num_processes`` processes, on this host or on each of ``hosts``; returns rank 0's
    result.

    Raises :class:`RankFailure` when a rank failed or was lost, and re-raises what a callback raised (a lost
    lease, a database error), as the engine would in one process.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() < num_processes:
        raise RankFailure(
            "invalid_spec",
            f"resources.num_processes is {num_processes}, one per GPU, but this worker sees "
            f"{torch.cuda.device_count()} GPU(s); route the job to a queue of workers with enough (resources.queue)",
        )
    key = secrets.token_bytes(32)
    with tempfile.TemporaryDirectory(prefix="rlhf-ranks-") as folder:
        if hosts is None:
            listener = Listener(os.path.join(folder, "channel"), family="AF_UNIX", authkey=key)
        else:
            listener = Listener((hosts.address, 0), family="AF_INET", authkey=key)
        with listener:
            joining = None
            if hosts is None:
                channel = str(listener.address)
            else:
                channel = f"{hosts.address}:{listener.address[1]}"
                joining = Invitation(
                    hosts.job_id, hosts.attempt, hosts.num_nodes, num_processes,
                    f"{hosts.address}:{_free_port(hosts.address)}", channel, key.hex(), hosts.join_timeout_s,
                )  # fmt: skip
            command = torchrun_command(num_processes, joining, hosts.address if hosts else "", host=True)
            process = _torchrun(command, channel, key.hex(), num_processes)
            try:
                if joining is not None:
                    for _ in range(joining.num_nodes - 1):
                        hosts.invite(joining)  # type: ignore[union-attr]
                world = num_processes * (hosts.num_nodes if hosts else 1)
                return _serve(listener, process, spec, out_dir, callbacks, world, joining)
            finally:
                _stop(process)


def join_distributed(invitation: Invitation, address: str, wanted: Callable[[], bool], poll_s: float = 2.0) -> int:
    """Take part in another worker's job as one more host: run its ranks here until they end, or until
    ``wanted()`` (asked every ``poll_s``) says the job no longer runs this attempt. Returns torchrun's exit code.
    Writes nothing anywhere: what the ranks report goes to the claiming worker."""
    command = torchrun_command(invitation.num_processes, invitation, address)
    process = _torchrun(command, invitation.channel, invitation.key, invitation.num_processes)
    try:
        while process.poll() is None:
            try:
                process.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                if not wanted():
                    log.info("job %s no longer runs attempt %d here", invitation.job_id, invitation.attempt)
                    break
    finally:
        _stop(process)
    return process.returncode


def _torchrun(command: list[str], channel: str, key: str, num_processes: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, CHANNEL_ENV: channel, KEY_ENV: key}
    # CPU ranks share this worker's cores (torchrun would give each one thread)
    env.setdefault("OMP_NUM_THREADS", str(max(1, torch.get_num_threads() // num_processes)))
    return subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_stop_with_parent())


def _free_port(address: str) -> int:
    """A port free at ``address`` now, for the rendezvous store (torchrun binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        port: int = probe.getsockname()[1]
        return port


def _serve(
    listener: Listener,
    process: subprocess.Popen[bytes],
    spec: JobSpec,
    out_dir: Path,
    callbacks: Callbacks,
    world: int,
    joining: Invitation | None = None,
) -> JobResult:
    """Answer the job's ``world`` ranks until torchrun exits, or until rank 0 reports a stop (the caller then
    stops the others); then return the result or raise what went wrong."""
    accepted: queue.Queue[Connection] = queue.Queue()
    threading.Thread(target=_accept, args=(listener, accepted, world), daemon=True).start()
    connections: list[Connection] = []
    spoke: set[int] = set()  # the connections whose rank said how it ended (its result or its failure)
    greeted = lost = 0
    result: JobResult | None = None
    failure: RankFailure | None = None
    callback_error: BaseException | None = None
    exited_at: float | None = None
    stopped = False
    while not stopped:
        while not accepted.empty():
            connections.append(accepted.get())
        if not connections:
            time.sleep(0.2)
        for conn in wait(connections, timeout=0.2):
            assert isinstance(conn, Connection)
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the rank exited
                connections.remove(conn)
                lost += id(conn) not in spoke
                continue
            kind, *body = message
            if kind == "hello":
                greeted += 1
                conn.send(("job", spec.model_dump(mode="json"), str(out_dir)))
            elif kind == "call" and body[0] in CALLBACKS:
                name, args = body
                try:
                    conn.send(("ok", _call(callbacks, name, args)))
                except Exception as e:  # the rank stops; the error is the job's, as in one process
                    callback_error = callback_error or e
                    conn.send(("error", f"{type(e).__name__}: {e}"))
            elif kind == "result":
                spoke.add(id(conn))
                status, step, checkpoint, metrics = body
                result = JobResult(status, step, Path(checkpoint) if checkpoint else None, metrics)
                # Stopped on request, its checkpoint (if any) written: the other ranks may be waiting for rank 0
                # in a collective (a stop reaches rank 0 alone inside a reward call), and what they would report
                # next is the echo of its leaving.
                stopped = status != "succeeded"
            elif kind == "failed":
                spoke.add(id(conn))
                # the first, which is usually the cause (the later ones its echo); a rank's own error before a
                # collective that broke when a rank left
                if failure is None or (failure.code == LOST and body[0] != LOST):
                    failure = RankFailure(*body)
            else:
                raise RuntimeError(f"unexpected message from a rank: {kind!r}")
        if process.poll() is not None:
            exited_at = exited_at or time.monotonic()
            # what the ranks sent before they exited has been read once their connections are closed; a rank
            # that torchrun could not stop would keep its own open: a moment for it, no more
            if not connections or time.monotonic() - exited_at > 5:
                break
    for conn in connections:
        conn.close()
    if callback_error is not None:
        raise callback_error
    if failure is not None and not stopped:
        raise failure
    if result is not None:
        return result
    if joining is not None and greeted < world:
        raise RankFailure(
            "hosts_unavailable",
            f"the job trains on {joining.num_nodes} hosts (resources.num_nodes), and fewer joined within "
            f"{joining.join_timeout_s:.0f} s: start train workers of queue {spec.resources.queue!r} on more hosts, "
            "each reachable at its RLHF_NODE_ADDRESS",
        )
    raise RankFailure(LOST, f"{lost or 'the'} processes of the job were lost (torchrun exited with code "
                            f"{process.returncode}) before it ended")  # fmt: skip


def _call(callbacks: Callbacks, name: str, args: tuple[Any, ...]) -> object:
    if name == "on_checkpoint":
        step, path, metrics = args
        args = (step, Path(path), metrics)
    return getattr(callbacks, name)(*args)


def _accept(listener: Listener, accepted: queue.Queue[Connection], expected: int) -> None:
    for _ in range(expected):
        try:
            accepted.put(listener.accept())
        except (OSError, EOFError):  # closed: the job is over; or a caller without the key
            return


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Ask torchrun to stop its ranks (SIGTERM), then insist."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _stop_with_parent() -> Any:
    """A ``preexec_fn`` that has Linux send SIGTERM to torchrun when the worker dies (torchrun then stops the
    ranks); None elsewhere. Resolved here, so the child calls only into libc between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return preexec
