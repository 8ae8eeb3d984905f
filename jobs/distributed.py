"""One job in several processes: the worker runs the engine under ``torchrun`` (DistributedDataParallel) and
stays the only one that talks to the database.

    worker: runner.run_job → run_distributed()          torchrun --nproc-per-node N -m jobs.rank
    ──────────────────────────────────────────          ─────────────────────────────────────────────
    claims the job, renews its lease; listens on its    each rank connects, is given the spec and the job
    channel (jobs/channel.py); answers rank 0's         folder, joins the process group (NCCL on GPUs, gloo
    callbacks with its DbCallbacks (metrics, events,    on CPU) through the worker's store, and runs
    checkpoints, stop requests) and every rank's        engine.run.run_job. Rank 0's callbacks are calls
    store requests; gets the result, or a rank's error  over the channel; the others' report nothing

Rank 0 reports metrics (the loops reduce them over the ranks), writes checkpoints and asks whether to stop;
its answer is broadcast, so all ranks stop together. A pause, a cancel, a worker shutting down (the job is
handed back with a checkpoint) and a lost lease behave as in one process. If the worker dies, torchrun is
told (parent-death signal) and stops the ranks; the job is recovered from its last checkpoint like any other.

Nothing of a job is reachable without its key: the channel is a Unix socket in a private folder (one host) or a
TCP port that refuses any peer not proving it holds the attempt's key (jobs/channel.py; across hosts the key is
derived from the secret the hosts share, :func:`jobs.channel.node_secret`, and never sent). The process group
meets through the worker's store, which is a dictionary behind that channel: no c10d rendezvous or TCPStore that
others could write to. torchrun only starts and watches the ranks of its own host (a static rendezvous of one
node, whose store the ranks never read), and nothing read off the network is unpickled.

Across hosts (``resources.num_nodes``): the claiming worker listens on TCP at its host's address instead and
invites ``num_nodes - 1`` more train workers of the job's queue (an :class:`Invitation`, sent as a Celery task,
holding no secret); each runs :func:`join_distributed`: it proves it holds the key, is given its host's place
(``node``), and runs its own torchrun, whose ranks connect to the claiming worker like its own. Only the claiming
worker writes to the database. A rank lost without a word (its host died, its worker was killed) or a collective
that broke with it fails the attempt as ``worker_lost``, and the job goes back to the queue for its next attempt,
from its last checkpoint. The worker watches the job's status itself while its processes gather or say nothing
(a cancel then ends the job at once, wherever its ranks are), and the hosts that joined leave as soon as the
claiming worker closes their connection.
"""

import base64
import contextlib
import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.callbacks import Callbacks, StopRequest
from engine.core.loop import JobResult
from engine.spec.config import JobSpec
from jobs.channel import Channel, ChannelServer, connect, job_key, readable

log = logging.getLogger(__name__)

CHANNEL_ENV = "RLHF_RANK_CHANNEL"
"""The worker's channel, for the ranks: a Unix socket's path, or ``host:port`` across hosts."""
KEY_ENV = "RLHF_RANK_CHANNEL_KEY"
"""Hex of the channel's key (in the ranks' environment, which only the service's user reads; never on a command
line)."""
NODE_RANK_ENV = "RLHF_NODE_RANK"
"""This host's place among the job's hosts (0: the claiming worker's); a rank's global rank is ``node_rank *
nproc_per_node + local_rank``."""
NUM_NODES_ENV = "RLHF_NUM_NODES"
CALLBACKS = frozenset({"on_start", "on_metrics", "on_samples", "on_event", "on_checkpoint", "should_stop"})
"""What rank 0 may call on the worker's callbacks."""
STOP_GRACE_S = 30
"""How long torchrun has to stop its ranks once the worker is done with them."""
POLL_S = 1.0
"""How often the worker asks for the job's status itself while its processes gather or rank 0 says nothing."""
SILENT_S = 5.0
"""Rank 0 silent this long (a long step, a stuck collective): the worker asks for the job's status itself."""
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
    """What another host needs to take part in a job: the claiming worker sends one per host it waits for. It holds
    no secret: a host derives the channel's key from the secret the hosts share, the job, its attempt and
    ``nonce``."""

    job_id: str
    attempt: int
    """The job's attempt: a host joins only while the job runs it."""
    num_nodes: int
    num_processes: int
    """Processes per host."""
    channel: str
    """``host:port`` where the claiming worker answers the hosts and the ranks."""
    nonce: str
    """This run's part of the key (:func:`jobs.channel.job_key`), fresh for every run of an attempt."""
    join_timeout_s: float
    """How long the claiming worker waits for every host."""

    @property
    def run_id(self) -> str:
        """The run of this attempt, no other's."""
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
    secret: bytes
    """The secret the hosts share (:func:`jobs.channel.node_secret`), from which the channel's key is derived."""


def torchrun_command(num_processes: int) -> list[str]:
    """torchrun starting and watching this host's ``num_processes`` ranks: a static rendezvous of one node on
    loopback, whose store serves torchrun alone (the ranks meet through the worker's store)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--node-rank=0", "--rdzv-backend=static",
        "--rdzv-endpoint=127.0.0.1:0", f"--nproc-per-node={num_processes}", "--max-restarts=0", "-m", "jobs.rank",
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
    with tempfile.TemporaryDirectory(prefix="rlhf-ranks-") as folder:  # mode 0700: this user's alone
        joining = None
        if hosts is None:
            key = secrets.token_bytes(32)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(os.path.join(folder, "channel"))
        else:
            nonce = secrets.token_hex(16)
            key = job_key(hosts.secret, hosts.job_id, hosts.attempt, nonce)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((hosts.address, 0))
        sock.listen(64)
        with ChannelServer(sock, key) as server:
            if hosts is not None:
                joining = Invitation(
                    hosts.job_id, hosts.attempt, hosts.num_nodes, num_processes, server.address, nonce,
                    hosts.join_timeout_s,
                )  # fmt: skip
            nodes = hosts.num_nodes if hosts else 1

            def start() -> subprocess.Popen[bytes]:
                return _torchrun(server.address, key, num_processes, node_rank=0, num_nodes=nodes)

            serving = _Serving(server, start, spec, out_dir, callbacks, num_processes * nodes, joining)
            try:
                if joining is not None:
                    for _ in range(joining.num_nodes - 1):
                        hosts.invite(joining)  # type: ignore[union-attr]
                return serving.run()
            finally:
                if serving.process is not None:
                    _stop(serving.process)


def join_distributed(
    invitation: Invitation, secret: bytes, wanted: Callable[[], bool], poll_s: float = 2.0
) -> int | None:
    """Take part in another worker's job as one more host: prove to the claiming worker that this one holds the
    key, and run its ranks here until they end, the claiming worker lets this host go, or ``wanted()`` (asked every
    ``poll_s``) says the job no longer runs this attempt. Returns torchrun's exit code; None when the claiming
    worker could not be reached or needs no more hosts. Writes nothing anywhere: what the ranks report goes to the
    claiming worker."""
    key = job_key(secret, invitation.job_id, invitation.attempt, invitation.nonce)
    try:
        control = connect(invitation.channel, key)
        control.send(["host"])
        while not readable([control], poll_s):  # the answer comes once every host is there
            if not wanted():
                control.close()
                return None
        answer = control.recv()
    except (OSError, EOFError) as e:
        log.warning("job %s: the claiming worker at %s: %s", invitation.job_id, invitation.channel, e)
        return None
    if not (isinstance(answer, list) and answer[:1] == ["node"] and isinstance(answer[1], int)):
        control.close()
        log.info("job %s needs no more hosts", invitation.job_id)
        return None
    process = _torchrun(invitation.channel, key, invitation.num_processes, answer[1], invitation.num_nodes)
    try:
        while process.poll() is None:
            if readable([control], poll_s):  # the claiming worker is done with this host (or gone)
                log.info("job %s: the claiming worker let this host go", invitation.job_id)
                with contextlib.suppress(subprocess.TimeoutExpired):  # ranks that finished the job end by themselves
                    process.wait(timeout=5)
                break
            if not wanted():
                log.info("job %s no longer runs attempt %d here", invitation.job_id, invitation.attempt)
                break
    finally:
        control.close()
        _stop(process)
    return process.returncode


def _torchrun(channel: str, key: bytes, num_processes: int, node_rank: int, num_nodes: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        CHANNEL_ENV: channel,
        KEY_ENV: key.hex(),
        NODE_RANK_ENV: str(node_rank),
        NUM_NODES_ENV: str(num_nodes),
    }
    # CPU ranks share this worker's cores (torchrun would give each one thread)
    env.setdefault("OMP_NUM_THREADS", str(max(1, torch.get_num_threads() // num_processes)))
    command = torchrun_command(num_processes)
    return subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_stop_with_parent())


@dataclass
class _Serving:
    """The worker's side of a job's processes: answers the job's ``world`` ranks until torchrun exits, or until
    rank 0 reports a stop (the caller then stops the others), or until the worker itself ends the job (a stop
    while the processes gather or say nothing, hosts that never joined); :meth:`run` then returns the result or
    raises what went wrong."""

    server: ChannelServer
    start: Callable[[], subprocess.Popen[bytes]]
    """Starts torchrun for this host's ranks: at once on one host, once every host joined across hosts."""
    spec: JobSpec
    out_dir: Path
    callbacks: Callbacks
    world: int
    joining: Invitation | None = None
    process: subprocess.Popen[bytes] | None = None
    connections: list[Channel] = field(default_factory=list)
    ranks: set[int] = field(default_factory=set)
    """The ids of the ranks' connections (a rank's store has one more)."""
    spoke: set[int] = field(default_factory=set)
    """The connections whose rank said how it ended (its result or its failure)."""
    hosts: list[Channel] = field(default_factory=list)
    """The joined hosts' connections: closing one lets that host go."""
    store: dict[str, bytes] = field(default_factory=dict)
    waiting: list[tuple[Channel, list[str], bool]] = field(default_factory=list)
    """Store requests waiting for their keys: the connection, the keys, and whether it wants the value (get)."""
    greeted: int = 0
    lost: int = 0
    step: int = 0
    result: JobResult | None = None
    failure: RankFailure | None = None
    callback_error: BaseException | None = None
    stopped: bool = False
    ended: bool = False
    """The worker ended the job itself (:meth:`_end`)."""
    started: float = field(default_factory=time.monotonic)
    heard: float = field(default_factory=time.monotonic)
    """When rank 0 last called back."""
    polled: float = 0.0

    def run(self) -> JobResult:
        exited_at: float | None = None
        if self.joining is None:
            self.process = self.start()
        try:
            while not (self.stopped or self.ended):
                while not self.server.accepted.empty():
                    self.connections.append(self.server.accepted.get())
                if not self.connections:
                    time.sleep(0.2)
                for conn in readable(self.connections, 0.2):
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):  # the process exited, or its host left
                        self._closed(conn)
                        continue
                    self._answer(conn, message)
                self._watch()
                if self.process is not None and self.process.poll() is not None:
                    exited_at = exited_at or time.monotonic()
                    # what the ranks sent before they exited has been read once their connections are closed; a
                    # rank that torchrun could not stop would keep its own open: a moment for it, no more
                    others = [c for c in self.connections if c not in self.hosts]
                    if not others or time.monotonic() - exited_at > 5:
                        break
        finally:
            for conn in self.connections:  # the joined hosts, told so, stop their ranks
                conn.close()
        return self._outcome()

    def _outcome(self) -> JobResult:
        if self.callback_error is not None:
            raise self.callback_error
        if self.failure is not None and not self.stopped:
            raise self.failure
        if self.result is not None:
            return self.result
        code = self.process.returncode if self.process is not None else None
        raise RankFailure(
            LOST,
            f"{self.lost or 'the'} processes of the job were lost (torchrun exited with code {code}) before it ended",
        )

    def _closed(self, conn: Channel) -> None:
        self.connections.remove(conn)
        conn.close()
        if conn in self.hosts:
            self.hosts.remove(conn)
            if self.process is not None and self.greeted < self.world:  # its ranks may never come
                self._end(RankFailure(LOST, "a host that joined the job left before its processes started"))
        elif id(conn) in self.ranks and id(conn) not in self.spoke:
            self.lost += 1
        self.waiting = [w for w in self.waiting if w[0] is not conn]

    def _end(self, failure: RankFailure | None = None, result: JobResult | None = None) -> None:
        """The worker ends the job itself: ``failure`` raised, or ``result`` returned."""
        if result is not None:
            self.result, self.stopped = result, True
        else:
            self.failure = failure
        self.ended = True

    def _answer(self, conn: Channel, message: Any) -> None:
        if not (isinstance(message, list) and message and isinstance(message[0], str)):
            raise RuntimeError(f"unexpected message from a process of the job: {str(message)[:200]!r}")
        kind, *body = message
        if kind == "hello":
            self.greeted += 1
            self.ranks.add(id(conn))
            conn.send(["job", self.spec.model_dump(mode="json"), str(self.out_dir)])
        elif kind == "call" and body and body[0] in CALLBACKS:
            name, args = body
            self.heard = time.monotonic()
            if name == "on_metrics":
                self.step = int(args[0])
            try:
                conn.send(["ok", _call(self.callbacks, name, args)])
            except Exception as e:  # the rank stops; the error is the job's, as in one process
                self.callback_error = self.callback_error or e
                conn.send(["error", f"{type(e).__name__}: {e}"])
        elif kind == "result":
            self.spoke.add(id(conn))
            status, step, checkpoint, metrics = body
            self.result = JobResult(status, step, Path(checkpoint) if checkpoint else None, metrics)
            # Stopped on request, its checkpoint (if any) written: the other ranks may be waiting for rank 0
            # in a collective (a stop reaches rank 0 alone inside a reward call), and what they would report
            # next is the echo of its leaving.
            self.stopped = status != "succeeded"
        elif kind == "failed":
            self.spoke.add(id(conn))
            # the first, which is usually the cause (the later ones its echo); a rank's own error before a
            # collective that broke when a rank left
            if self.failure is None or (self.failure.code == LOST and body[0] != LOST):
                self.failure = RankFailure(*body)
        elif kind == "store":
            self._store(conn, body)
        elif kind == "host":
            self._host(conn)
        else:
            raise RuntimeError(f"unexpected message from a process of the job: {kind!r}")

    def _host(self, conn: Channel) -> None:
        """A worker of another host that proved it holds the key: once every host is there, each is given its place
        and the ranks start; "full" when none is wanted."""
        wanted = self.joining.num_nodes - 1 if self.joining else 0
        if len(self.hosts) >= wanted:
            conn.send(["full"])
            self.connections.remove(conn)
            conn.close()
            return
        self.hosts.append(conn)
        if len(self.hosts) == wanted:  # nothing runs anywhere before: a job that cannot gather holds no memory
            for node, host in enumerate(self.hosts, start=1):
                host.send(["node", node])
            self.process = self.start()

    def _store(self, conn: Channel, body: list[Any]) -> None:
        """The process group's store (c10d's ``Store``, as :class:`jobs.rank.ChannelStore` asks it): values as
        base64; ``get`` and ``wait`` answered once their keys are there."""
        op, *args = body
        answer: object = None
        if op == "set":
            self.store[args[0]] = base64.b64decode(args[1])
        elif op == "add":
            answer = int(self.store.get(args[0], b"0")) + int(args[1])
            self.store[args[0]] = str(answer).encode()
        elif op == "compare_set":
            key, expected, desired = args[0], base64.b64decode(args[1]), base64.b64decode(args[2])
            current = self.store.get(key)
            if current == expected or (current is None and not expected):
                self.store[key] = current = desired
            answer = base64.b64encode(current if current is not None else expected).decode()
        elif op in ("get", "wait"):
            self.waiting.append((conn, [args[0]] if op == "get" else list(args[0]), op == "get"))
        elif op == "check":
            answer = all(key in self.store for key in args[0])
        elif op == "delete_key":
            answer = self.store.pop(args[0], None) is not None
        elif op == "num_keys":
            answer = len(self.store)
        else:
            raise RuntimeError(f"unexpected store request from a rank: {op!r}")
        if op not in ("get", "wait"):
            conn.send(["ok", answer])
        ready = [w for w in self.waiting if all(key in self.store for key in w[1])]
        self.waiting = [w for w in self.waiting if w not in ready]
        for waiter, keys, value in ready:
            waiter.send(["ok", base64.b64encode(self.store[keys[0]]).decode() if value else None])

    def _watch(self) -> None:
        """While the processes gather, or rank 0 says nothing for :data:`SILENT_S`, the worker looks at the job's
        status itself: a cancel ends the job at once (its ranks may be stuck), as does a pause before they all
        started; hosts that never joined fail it."""
        now = time.monotonic()
        gathering = self.greeted < self.world
        if self.joining is not None and gathering and now - self.started > self.joining.join_timeout_s:
            self._end(RankFailure("hosts_unavailable", self._unavailable()))
            return
        if not (gathering or now - self.heard > SILENT_S) or now - self.polled < POLL_S:
            return
        self.polled = now
        request: StopRequest | None = self.callbacks.should_stop()
        if request == "cancel" or (request is not None and gathering):
            log.info(
                "a %s while the job's processes %s: ending it now", request, "gather" if gathering else "say nothing"
            )
            self._end(result=JobResult("cancelled" if request == "cancel" else "paused", self.step, None, {}))

    def _unavailable(self) -> str:
        assert self.joining is not None
        return (
            f"the job trains on {self.joining.num_nodes} hosts (resources.num_nodes), and only {len(self.hosts) + 1} "
            f"joined within {self.joining.join_timeout_s:.0f} s: start train workers of queue "
            f"{self.spec.resources.queue!r} on more hosts, each reachable at its RLHF_NODE_ADDRESS"
        )


def _call(callbacks: Callbacks, name: str, args: list[Any]) -> object:
    if name == "on_checkpoint":
        step, path, metrics = args
        args = [step, Path(path), metrics]
    return getattr(callbacks, name)(*args)


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
