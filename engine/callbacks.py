"""How a training loop talks to whoever runs it: the local CLI, or a worker that writes to the database."""

from pathlib import Path
from typing import Literal

StopRequest = Literal["cancel", "pause"]


class Callbacks:
    """Receives a job's progress. Subclass and override what you need; the defaults ignore everything.

    Every call happens on the training thread between optimizer steps. A callback that raises
    fails the job.
    """

    def on_start(self, start_step: int, total_steps: int) -> None:
        """Training begins at ``start_step`` (0 for a fresh job, N when resuming from step N)."""

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Metrics of 1-based optimizer step ``step``, keyed by name (``loss/sft``, ``objective/kl``, ...: the
        README lists them)."""

    def on_event(self, kind: str, message: str, data: dict[str, object] | None = None) -> None:
        """Something worth recording: ``warning``, ``eval``, ``info``."""

    def on_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        """A checkpoint of ``step`` is complete at ``path`` (already renamed into place)."""

    def should_stop(self) -> StopRequest | None:
        """Asked after every step: ``"pause"`` saves a checkpoint and returns, ``"cancel"`` just returns."""
        return None
