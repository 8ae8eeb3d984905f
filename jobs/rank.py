"""One rank of a job in several processes, as ``torchrun`` starts it (``python -m jobs.rank``): join the
process group, fetch the job from the worker, train, and report back. See :mod:`jobs.distributed`."""

import contextlib
import logging
import os
import sys
import traceback
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

from engine.callbacks import Callbacks, StopRequest
from engine.run import run_job
from engine.spec.config import JobSpec
from jobs.distributed import CHANNEL_ENV, KEY_ENV, LOST
from jobs.runner import error_code

log = logging.getLogger("jobs.rank")


class CallbackError(RuntimeError):
    """The worker's callback raised (a lost lease, a database error); the worker knows why."""


class WorkerCallbacks(Callbacks):
    """Rank 0's callbacks: each one a call to the worker's, over the connection, waiting for its answer."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def _call(self, name: str, *args: Any) -> Any:
        self.conn.send(("call", name, args))
        answer, value = self.conn.recv()
        if answer == "error":
            raise CallbackError(value)
        return value

    def on_start(self, start_step: int, total_steps: int) -> None:
        self._call("on_start", start_step, total_steps)

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._call("on_metrics", step, metrics)

    def on_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        self._call("on_samples", step, samples)

    def on_event(self, kind: str, message: str, data: dict[str, object] | None = None) -> None:
        self._call("on_event", kind, message, data)

    def on_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        self._call("on_checkpoint", step, str(path), metrics)

    def should_stop(self) -> StopRequest | None:
        stop: StopRequest | None = self._call("should_stop")
        return stop


def connect(channel: str, key: bytes) -> Connection:
    """The worker's channel: a Unix socket's path, or ``host:port`` (a job across hosts)."""
    if channel.startswith("/"):
        return Client(channel, family="AF_UNIX", authkey=key)
    host, _, port = channel.rpartition(":")
    return Client((host, int(port)), family="AF_INET", authkey=key)


def failure_code(error: BaseException) -> str:
    """The job's error code for what a rank raised: :data:`~jobs.distributed.LOST` for a collective that broke
    because another rank is gone (its host died, its process was killed), else the engine's error code."""
    text = str(error)
    if isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError)
        and any(sign in text for sign in ("gloo/transport", "Connection reset by peer", "Connection closed by peer"))
    ):
        return LOST
    return error_code(error)


def main() -> None:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    logging.basicConfig(level="INFO", format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    conn = connect(os.environ[CHANNEL_ENV], bytes.fromhex(os.environ[KEY_ENV]))
    conn.send(("hello", rank))
    _, spec_json, out_dir = conn.recv()
    spec = JobSpec.model_validate(spec_json)

    if torch.cuda.is_available():  # one GPU per rank
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    callbacks = WorkerCallbacks(conn) if rank == 0 else Callbacks()
    try:
        result = run_job(spec, Path(out_dir), callbacks, device)
    except CallbackError:
        log.error("the worker's callback failed; stopping")
        sys.exit(1)
    except Exception as e:
        traceback.print_exc()
        code, message = failure_code(e), str(e) or type(e).__name__
        if code == LOST:  # gloo's text: "[…/pair.cc:537] Read error [host]:port: Connection reset by peer. This …"
            message = f"rank {rank} lost its connection to another: {message.split('. ')[0].rpartition('] ')[2]}"
        with contextlib.suppress(OSError):  # the worker may be gone, or done with this job
            conn.send(("failed", code, message))
        sys.exit(1)
    if rank == 0:
        checkpoint = str(result.checkpoint) if result.checkpoint else None
        conn.send(("result", result.status, result.step, checkpoint, result.metrics))
    dist.destroy_process_group()
    conn.close()


if __name__ == "__main__":
    main()
