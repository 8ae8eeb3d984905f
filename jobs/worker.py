"""A Celery worker in this process: ``rlhf worker --queues train`` (once per GPU), ``rlhf worker
--queues inference``, and the worker children of ``rlhf serve``. Also ``python -m jobs.worker``.

A train worker runs one job at a time in the solo pool: no forked children, so torch and CUDA are
initialised once, in the process that uses them. An inference worker may serve several requests at
once from threads (the loaded checkpoints are shared through the cache).
"""

import argparse
import logging
import os
import re
import socket
import time

from huggingface_hub import constants as hub_constants
from sqlalchemy.exc import IntegrityError, OperationalError
from transformers.utils import logging as hf_logging

from engine.spec.config import QUEUE_NAME
from jobs import tasks
from jobs.celery_app import INFERENCE_QUEUE, TRAIN_QUEUE, celery_app
from jobs.store.settings import Settings, get_settings


def worker_argv(queues: list[str], concurrency: int = 1, loglevel: str = "INFO") -> list[str]:
    """The ``celery worker`` arguments for ``queues``: ``inference`` serves generate requests, any other name is
    a train queue (``train`` by default; a job picks one with ``resources.queue``), one job at a time."""
    bad = [q for q in queues if not re.match(QUEUE_NAME, q)]
    if not queues or bad:
        raise ValueError(
            f"queues are names of a-z, 0-9, '_', '.', '-' ({TRAIN_QUEUE}, {INFERENCE_QUEUE}, or a train queue of your "
            f"own such as {TRAIN_QUEUE}-a100); got {', '.join(map(repr, bad)) or 'none'}"
        )
    if set(queues) - {INFERENCE_QUEUE} and concurrency != 1:
        raise ValueError("a train worker runs one job at a time (concurrency 1); start one worker per GPU")
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    return [
        "worker",
        f"--queues={','.join(queues)}",
        f"--pool={'solo' if concurrency == 1 else 'threads'}",
        f"--concurrency={concurrency}",
        f"--loglevel={loglevel}",
        f"--hostname={'+'.join(queues)}-{os.getpid()}@{socket.gethostname()}",
        "--without-gossip",
        "--without-mingle",
    ]


def declare_queues(queues: list[str], tries: int = 3) -> None:
    """Create ``queues`` on the embedded broker before consuming them. kombu's SQLAlchemy transport creates
    its tables and a queue's row on first use, guarded only within one process: of two workers starting
    together on a fresh broker, one would die of "already exists". Here the loser tries again."""
    if not str(celery_app.conf.broker_url).startswith("sqla+"):
        return
    for attempt in range(1, tries + 1):
        try:
            with celery_app.connection_for_write() as connection:
                for queue in queues:
                    connection.default_channel.queue_declare(queue=queue, durable=True, auto_delete=False)
            return
        except (IntegrityError, OperationalError):
            if attempt == tries:
                raise
            time.sleep(0.2 * attempt)


def keep_off_the_hub(settings: Settings) -> None:
    """Unless ``settings.hub_downloads``, this worker and the processes it starts (torchrun) never download: a
    hub id loads from the Hugging Face cache, or fails at once. huggingface_hub reads ``HF_HUB_OFFLINE`` into
    its constants when imported, which this process has done already (with transformers): its constant is set
    as well, and huggingface_hub, transformers and peft read that one at each call."""
    if settings.hub_downloads:
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub_constants.HF_HUB_OFFLINE = True


def start_worker(
    queues: list[str], settings: Settings | None = None, concurrency: int = 1, loglevel: str = "INFO"
) -> None:
    """Consume ``queues`` until the worker is shut down (SIGTERM or Ctrl-C). A generate request in progress
    finishes; a training job stops after its current step, with a checkpoint, and goes back to the queue."""
    argv = worker_argv(queues, concurrency, loglevel)
    settings = settings or get_settings()
    settings.check()
    settings.prepare_data_dir()
    logging.basicConfig(level=loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    hf_logging.disable_progress_bar()  # tqdm bars would reach the log as warnings, one per checkpoint
    keep_off_the_hub(settings)
    tasks.configure(settings)
    declare_queues(queues)
    celery_app.worker_main(argv)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlhf worker", description="Run a Celery worker of rlhf-server.")
    parser.add_argument(
        "--queues",
        default=TRAIN_QUEUE,
        help=f"comma-separated: {INFERENCE_QUEUE}, {TRAIN_QUEUE} or another train queue named by jobs' resources.queue",
    )
    parser.add_argument("--concurrency", type=int, default=1, help="parallel requests (inference only)")
    parser.add_argument("--loglevel", default="INFO")
    args = parser.parse_args(argv)
    start_worker([q for q in args.queues.split(",") if q], concurrency=args.concurrency, loglevel=args.loglevel)


if __name__ == "__main__":
    main()
