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
"""

import contextlib
import ctypes
import logging
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any

import torch

from engine.callbacks import Callbacks
from engine.core.loop import JobResult
from engine.spec.config import JobSpec

log = logging.getLogger(__name__)

CHANNEL_ENV = "RLHF_RANK_CHANNEL"
"""The worker's socket, for the ranks."""
KEY_ENV = "RLHF_RANK_CHANNEL_KEY"
"""Hex of the socket's authentication key (both ends prove they know it)."""
CALLBACKS = frozenset({"on_start", "on_metrics", "on_samples", "on_event", "on_checkpoint", "should_stop"})
"""What rank 0 may call on the worker's callbacks."""
STOP_GRACE_S = 30
"""How long torchrun has to stop its ranks once the worker is done with them."""


class RankFailure(RuntimeError):
    """A rank failed: ``code`` is the job's error code (as :func:`jobs.runner.error_code` gives it)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def torchrun_command(num_processes: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_processes}",
        "--max-restarts=0", "-m", "jobs.rank",
    ]  # fmt: skip


def run_distributed(spec: JobSpec, out_dir: Path, callbacks: Callbacks, num_processes: int) -> JobResult:
    """Train ``spec`` in ``num_processes`` processes; returns rank 0's result.

    Raises :class:`RankFailure` when a rank failed, and re-raises what a callback raised (a lost lease, a
    database error), as the engine would in one process.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() < num_processes:
        raise RankFailure(
            "invalid_spec",
            f"resources.num_processes is {num_processes}, one per GPU, but this worker sees "
            f"{torch.cuda.device_count()} GPU(s); route the job to a queue of workers with enough (resources.queue)",
        )
    key = secrets.token_bytes(32)
    with tempfile.TemporaryDirectory(prefix="rlhf-ranks-") as folder:
        address = os.path.join(folder, "channel")
        with Listener(address, family="AF_UNIX", authkey=key) as listener:
            env = {**os.environ, CHANNEL_ENV: address, KEY_ENV: key.hex()}
            # CPU ranks share this worker's cores (torchrun would give each one thread)
            env.setdefault("OMP_NUM_THREADS", str(max(1, torch.get_num_threads() // num_processes)))
            process = subprocess.Popen(
                torchrun_command(num_processes), env=env, start_new_session=True, preexec_fn=_stop_with_parent()
            )
            try:
                return _serve(listener, process, spec, out_dir, callbacks, num_processes)
            finally:
                _stop(process)


def _serve(
    listener: Listener,
    process: subprocess.Popen[bytes],
    spec: JobSpec,
    out_dir: Path,
    callbacks: Callbacks,
    num_processes: int,
) -> JobResult:
    """Answer the ranks until torchrun exits, or until rank 0 reports a stop (the caller then stops the others);
    then return the result or raise what went wrong."""
    accepted: queue.Queue[Connection] = queue.Queue()
    threading.Thread(target=_accept, args=(listener, accepted, num_processes), daemon=True).start()
    connections: list[Connection] = []
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
                continue
            kind, *body = message
            if kind == "hello":
                conn.send(("job", spec.model_dump(mode="json"), str(out_dir)))
            elif kind == "call" and body[0] in CALLBACKS:
                name, args = body
                try:
                    conn.send(("ok", _call(callbacks, name, args)))
                except Exception as e:  # the rank stops; the error is the job's, as in one process
                    callback_error = callback_error or e
                    conn.send(("error", f"{type(e).__name__}: {e}"))
            elif kind == "result":
                status, step, checkpoint, metrics = body
                result = JobResult(status, step, Path(checkpoint) if checkpoint else None, metrics)
                # Stopped on request, its checkpoint (if any) written: the other ranks may be waiting for rank 0
                # in a collective (a stop reaches rank 0 alone inside a reward call), and what they would report
                # next is the echo of its leaving.
                stopped = status != "succeeded"
            elif kind == "failed":
                failure = failure or RankFailure(*body)  # the first: later ones are usually its echo
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
    if result is None:
        raise RuntimeError(f"the job's {num_processes} processes exited with code {process.returncode}, no result")
    return result


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
