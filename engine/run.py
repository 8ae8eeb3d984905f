"""Entry point for running one job, used by the local CLI and by the workers."""

from pathlib import Path

import torch

from engine.callbacks import Callbacks
from engine.config import JobSpec
from engine.loop import JobResult
from engine.models import pick_device
from engine.ppo_train import train_ppo
from engine.rm import train_rm
from engine.sft import train_sft

TRAINERS = {"sft": train_sft, "rm": train_rm, "ppo": train_ppo}


def run_job(
    spec: JobSpec, out_dir: Path, callbacks: Callbacks | None = None, device: torch.device | None = None
) -> JobResult:
    """Train ``spec`` with its artifacts under ``out_dir``, resuming from the newest checkpoint there.

    Model and dataset references must already be resolved to what the engine loads: builtin names,
    hub ids, local paths or job folders. ``job:<id>`` and ``file-<id>`` are resolved by the service.
    Whether a run already in ``out_dir`` is of the same spec is checked by the local command line
    (``engine.cli.train``), not here: on the server every job has a folder of its own.
    """
    return TRAINERS[spec.type](spec, Path(out_dir), callbacks or Callbacks(), device or pick_device())
