"""How a training loop talks to whoever runs it: the local CLI, or a worker that writes to the database."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engine.rewards.judge import Endpoint

StopRequest = Literal["cancel", "pause"]


@dataclass(frozen=True)
class VllmSettings:
    """Where a job's vLLM server comes from (the worker's ``RLHF_VLLM_PYTHON`` or ``RLHF_VLLM_URL``)."""

    python: str | None = None
    """The python of a separate environment with vLLM installed: the job starts its own server with it."""
    url: str | None = None
    """Or the base URL of a running vLLM server (``http://127.0.0.1:8000``), dedicated to the job: its weights
    are replaced by the job's at the first sync."""
    start_timeout: float = 600.0
    """Seconds a started server may take to answer ``/health``."""
    skip_sync_at: int | None = None
    """A test hook: the sync due after this many optimizer steps is not made (the check must then fail)."""
    server: object | None = None
    """A test hook: a running :class:`engine.core.vllm.VllmServer` the job samples on as on its own, and leaves
    running (tests share one across their jobs: a start takes a minute)."""


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

    def on_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Some rollouts of step ``step`` (PPO, GRPO: every ``log_samples_every`` steps and step 1), each
        ``{"prompt": str, "response": str, "rewards": {name: float}, "kl": float, "length": int}``: the prompt as
        the policy saw it (chat prompts rendered), the response as text, the reward's components (a reward model:
        ``{"score": ...}``; graders: each named grader and ``"total"``), the summed log-ratio to the reference over
        the response, and the response's token count. Called before that step's :meth:`on_metrics`."""

    def on_event(self, kind: str, message: str, data: dict[str, object] | None = None) -> None:
        """Something worth recording: ``warning``, ``eval``, ``info``."""

    def on_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        """A checkpoint of ``step`` is complete at ``path`` (already renamed into place)."""

    def should_stop(self) -> StopRequest | None:
        """Asked after every step: ``"pause"`` saves a checkpoint and returns, ``"cancel"`` just returns."""
        return None

    def judge(self, model: str) -> Endpoint | None:
        """The judge a ``score_model`` or ``label_model`` grader names by ``model``: the service's endpoint for it,
        None when none is offered (then the grader fails the job as a reward service would)."""
        return None

    def vllm(self) -> VllmSettings | None:
        """Where a job with ``rollout_engine: vllm`` gets its vLLM server: the python of the operator's vLLM
        environment or a server's URL; None when this runner offers none (then such a job fails at its start)."""
        return None
