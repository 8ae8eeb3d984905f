"""One rank of a job in several processes, as ``torchrun`` starts it (``python -m jobs.rank``): fetch the job from
the worker, join the process group through the worker's store, train, and report back. See
:mod:`jobs.distributed`."""

import base64
import contextlib
import logging
import os
import sys
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

from engine.callbacks import Callbacks, StopRequest
from engine.run import run_job
from engine.spec.config import JobSpec
from jobs.channel import Channel, connect
from jobs.distributed import CHANNEL_ENV, KEY_ENV, LOST, NODE_RANK_ENV, NUM_NODES_ENV
from jobs.runner import error_code

log = logging.getLogger("jobs.rank")


class CallbackError(RuntimeError):
    """The worker's callback raised (a lost lease, a database error); the worker knows why."""


class WorkerCallbacks(Callbacks):
    """Rank 0's callbacks: each one a call to the worker's, over the connection, waiting for its answer."""

    def __init__(self, conn: Channel) -> None:
        self.conn = conn

    def _call(self, name: str, *args: Any) -> Any:
        self.conn.send(["call", name, args])
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


class ChannelStore(dist.Store):
    """The process group's store: each request a call to the worker's store over a connection of its own (c10d
    calls it from the threads it likes; one request at a time). Nobody but the job's processes reaches it."""

    def __init__(self, channel: str, key: bytes) -> None:
        super().__init__()
        self.conn = connect(channel, key)
        self.lock = threading.Lock()

    def _ask(self, *request: Any) -> Any:
        with self.lock:
            self.conn.send(["store", *request])
            answer, value = self.conn.recv()
        if answer != "ok":
            raise RuntimeError(f"the worker's store refused {request[0]}: {value}")
        return value

    def set(self, key: str, value: bytes | str) -> None:
        self._ask("set", key, _b64(value))

    def get(self, key: str) -> bytes:
        return base64.b64decode(self._ask("get", key))

    def add(self, key: str, value: int) -> int:
        return int(self._ask("add", key, value))

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        return base64.b64decode(self._ask("compare_set", key, _b64(expected_value), _b64(desired_value)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._ask("wait", list(keys))

    def check(self, keys: list[str]) -> bool:
        return bool(self._ask("check", list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._ask("delete_key", key))

    def num_keys(self) -> int:
        return int(self._ask("num_keys"))

    def set_timeout(self, timeout: timedelta) -> None:
        pass  # a request waits until its keys come or the worker closes the channel


def _b64(value: bytes | str) -> str:
    return base64.b64encode(value.encode() if isinstance(value, str) else bytes(value)).decode()


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
    # this rank among every host's: torchrun numbers the ranks of its own host only
    local_rank, per_host = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    rank = int(os.environ[NODE_RANK_ENV]) * per_host + local_rank
    world_size = int(os.environ[NUM_NODES_ENV]) * per_host
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))  # for libraries that read them
    logging.basicConfig(level="INFO", format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    channel, key = os.environ[CHANNEL_ENV], bytes.fromhex(os.environ.pop(KEY_ENV))
    conn = connect(channel, key)
    conn.send(["hello", rank])
    _, spec_json, out_dir = conn.recv()
    spec = JobSpec.model_validate(spec_json)

    if torch.cuda.is_available():  # one GPU per rank
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=ChannelStore(channel, key), rank=rank, world_size=world_size)
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
            conn.send(["failed", code, message])
        sys.exit(1)
    if rank == 0:
        checkpoint = str(result.checkpoint) if result.checkpoint else None
        conn.send(["result", result.status, result.step, checkpoint, result.metrics])
    dist.destroy_process_group()
    conn.close()


if __name__ == "__main__":
    main()
