"""A :class:`engine.callbacks.Callbacks` that records what a job reports, for jobs run in the test process
(``engine.run.run_job``, ``jobs.distributed.run_distributed``).

    recorder = Recorder(stop_after=3, stop="pause")  # asks for a pause once step 3 is reported
    run_job(spec, out_dir, recorder, device=torch.device("cpu"))
    assert recorder.checkpoint_steps() == [3]
"""

from pathlib import Path
from typing import Any

from engine.callbacks import Callbacks, StopRequest, VllmSettings


class Recorder(Callbacks):
    """Stores everything a job reports; can ask for ``"pause"`` or ``"cancel"`` after a given step."""

    def __init__(
        self, stop_after: int | None = None, stop: StopRequest = "pause", vllm: VllmSettings | None = None
    ) -> None:
        self.stop_after = stop_after
        self.stop = stop
        self.vllm_settings = vllm
        """What :meth:`vllm` offers a ``rollout_engine: vllm`` job."""
        self.starts: list[tuple[int, int]] = []
        self.metrics: dict[int, dict[str, float]] = {}
        self.samples: dict[int, list[dict[str, Any]]] = {}
        self.events: list[tuple[str, str, dict[str, object] | None]] = []
        self.checkpoints: list[tuple[int, Path]] = []
        self.stop_requests: list[int] = []

    def on_start(self, start_step: int, total_steps: int) -> None:
        self.starts.append((start_step, total_steps))

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        assert step not in self.metrics, f"step {step} reported twice"
        self.metrics[step] = dict(metrics)

    def on_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        assert step not in self.samples, f"samples of step {step} reported twice"
        assert step not in self.metrics, f"samples of step {step} reported after its metrics"
        self.samples[step] = [dict(sample) for sample in samples]

    def on_event(self, kind: str, message: str, data: dict[str, object] | None = None) -> None:
        self.events.append((kind, message, data))

    def on_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        assert path.is_dir(), f"on_checkpoint({step}) before {path} exists"
        self.checkpoints.append((step, path))

    def should_stop(self) -> StopRequest | None:
        last = max(self.metrics) if self.metrics else 0
        if self.stop_after is not None and last == self.stop_after:
            self.stop_requests.append(last)
            return self.stop
        return None

    def vllm(self) -> VllmSettings | None:
        return self.vllm_settings

    def series(self, name: str) -> list[float]:
        """``name`` at every reported step, in step order."""
        return [self.metrics[s][name] for s in sorted(self.metrics)]

    def checkpoint_steps(self) -> list[int]:
        """The steps of the checkpoints reported, in the order they came."""
        return [step for step, _ in self.checkpoints]

    def warnings(self) -> list[str]:
        return [message for kind, message, _ in self.events if kind == "warning"]
