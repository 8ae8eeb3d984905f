"""Entry point for running one job, used by the local CLI and by the workers."""

from collections.abc import Callable
from importlib import import_module
from pathlib import Path

import torch

from engine.callbacks import Callbacks
from engine.core.checkpoint import latest_checkpoint
from engine.core.generate import release_compiled
from engine.core.loop import JobResult, end_unfinished_runs
from engine.core.models import pick_device
from engine.rewards.graders import RewardStopped
from engine.spec.config import JOB_TYPES, JobSpec

Trainer = Callable[[JobSpec, Path, Callbacks, torch.device], JobResult]


def trainer(job_type: str) -> Trainer:
    """The training loop of ``job_type``, as its :data:`engine.spec.config.JOB_TYPES` entry names it."""
    module, function = JOB_TYPES[job_type].trainer.split(":")
    loop: Trainer = getattr(import_module(module), function)
    return loop


def run_job(
    spec: JobSpec, out_dir: Path, callbacks: Callbacks | None = None, device: torch.device | None = None
) -> JobResult:
    """Train ``spec`` with its artifacts under ``out_dir``, resuming from the newest checkpoint there.

    Model and dataset references must already be resolved to what the engine loads: builtin names,
    hub ids, local paths or job folders. ``job:<id>`` and ``file-<id>`` are resolved by the service.
    Whether a run already in ``out_dir`` is of the same spec is checked by the local command line
    (``engine.cli.train``), not here: on the server every job has a folder of its own.

    A stop requested while the reward waits for a service ends the job there, paused or cancelled, without
    checkpointing the step it was in: its result names the newest checkpoint, where a resume starts from.
    """
    callbacks = callbacks or Callbacks()
    try:
        return trainer(spec.type)(spec, Path(out_dir), callbacks, device or pick_device())
    except RewardStopped as e:
        return _stopped_in_reward(e, Path(out_dir), callbacks)
    finally:
        end_unfinished_runs()  # a job that raised: its rollout engine's server stopped, its decoder closed
        release_compiled()  # no compiled function or CUDA graph outlives the job, nor keeps its models alive


def _stopped_in_reward(stop: RewardStopped, out_dir: Path, callbacks: Callbacks) -> JobResult:
    """The result of a job stopped inside a reward call: at its newest checkpoint, that step its result's."""
    newest = latest_checkpoint(out_dir)
    step, checkpoint = newest if newest else (0, None)
    if stop.request == "pause":
        shown = f"step {step}" if newest else "none (a resume starts afresh)"
        message = "paused within a step, while the reward waited for a service; a resume starts from the newest "
        callbacks.on_event("info", f"{message}checkpoint: {shown}", {"checkpoint_step": step if newest else None})
    return JobResult("paused" if stop.request == "pause" else "cancelled", step, checkpoint)
