"""Training-health alerts for PPO: the collapse signals of MOSS-RLHF (arXiv:2307.04964 §2.1).

A policy that found a shortcut in the reward model shows it in four curves at once, at the same step: the
reward jumps, the KL to the reference jumps, the perplexity of its own samples falls (it became
near-deterministic: mode collapse) and the responses grow long. :class:`CollapseMonitor` watches these
against a short window of recent steps and names the signals of a step that broke away from it.

Pure Python (no torch): it reads only metrics that every process of a job computes alike from the gathered
batch (never a ``time/*`` metric), so every rank takes the same decision at the same step.
"""

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median, pstdev
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from engine.core.loop import JobResult, Run

Signal = Literal["reward_jump", "kl_jump", "perplexity_collapse", "length_blowup"]
Rule = Callable[[float, float, float, float], str | None]
"""A collapse rule of :class:`CollapseMonitor`: (value, median, spread, threshold) -> why it fires, or None."""

WATCHED = {
    "reward": "objective/scores",
    "kl": "objective/kl",
    "perplexity": "response/perplexity",
    "length": "response/length_mean",
}
"""The series the monitor keeps, and the metric each is read from."""

MAD_TO_STD = 1.4826
"""Scales a median absolute deviation to a standard deviation for normal data."""

MIN_SPREAD_FRACTION = 0.05
"""A z-score's spread is at least this fraction of the baseline's size, so a near-constant history (a few
identical values) does not turn ordinary noise into a huge z-score."""

MIN_SPREAD = 1e-3
"""And at least this, for a baseline near zero."""


class TrainingCollapseError(RuntimeError):
    """A collapse signal fired and the job's ``collapse.action`` is ``"stop"``: the job fails (no checkpoint of
    the anomalous step is written)."""


@dataclass(frozen=True)
class Alert:
    signal: Signal
    step: int
    value: float
    """The metric at ``step``."""
    baseline: float
    """What it was compared with: its median over the window of recent steps."""
    message: str

    def data(self) -> dict[str, object]:
        """The event data of a ``warning`` event (the dashboard highlights warnings with an ``alert`` key)."""
        return {"alert": self.signal, "step": self.step, "value": self.value, "baseline": self.baseline}


class CollapseMonitor:
    """Fed each PPO step's metrics in order; returns the collapse alerts of that step.

    Every rule compares the step's value with the median of the previous ``window`` steps (robust to the
    odd step a healthy run has), and judges only once ``warmup`` steps of history are kept. A threshold of
    None turns its signal off.

    - ``reward_jump``: ``objective/scores`` more than ``reward_z`` spreads above its median, the spread being
      the larger of the window's standard deviation and 1.4826 × its median absolute deviation (and at least
      5 % of the median's size). Scores may be negative or near 0, so a ratio would not do.
    - ``kl_jump``: ``objective/kl`` at least ``kl_min`` and at least ``kl_factor`` × its median: the policy
      broke away from the reference (KL is non-negative and grows in a healthy run, so a ratio judges it better
      than a z-score over a short window).
    - ``perplexity_collapse``: log ``response/perplexity`` (the mean surprisal of the sampled tokens) below
      ``perplexity_ratio`` × its median: the policy became near-deterministic.
    - ``length_blowup``: ``response/length_mean`` at least ``length_factor`` × its median, or every response
      at ``max_length`` after a rise of at least half that factor (the cap keeps it from rising further).

    Each step's values join the history after it was judged, so a lasting change alerts for a few steps until
    it is the new normal.
    """

    def __init__(
        self,
        *,
        window: int = 20,
        warmup: int = 5,
        reward_z: float | None = 6.0,
        kl_factor: float | None = 3.0,
        kl_min: float = 5.0,
        perplexity_ratio: float | None = 0.5,
        length_factor: float | None = 1.5,
        max_length: int | None = None,
    ) -> None:
        if not 1 <= warmup <= window:
            raise ValueError(f"warmup ({warmup}) must be between 1 and window ({window})")
        self.window, self.warmup = window, warmup
        self.reward_z, self.kl_factor, self.kl_min = reward_z, kl_factor, kl_min
        self.perplexity_ratio, self.length_factor, self.max_length = perplexity_ratio, length_factor, max_length
        self.history: dict[str, deque[float]] = {name: deque(maxlen=window) for name in WATCHED}

    def update(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        """Judge ``step`` against the history, then add its values to it; returns its alerts (often none).

        A missing or non-finite metric is neither judged nor kept.
        """
        values = {name: metrics.get(key, math.nan) for name, key in WATCHED.items()}
        alerts = self._judge(step, values)
        for name, value in values.items():
            if math.isfinite(value):
                self.history[name].append(float(value))
        return alerts

    def _judge(self, step: int, values: dict[str, float]) -> list[Alert]:
        """Each rule whose threshold is set, once its series has a baseline: an alert where it fires."""
        rules: list[tuple[Signal, str, float | None, Rule]] = [
            ("reward_jump", "reward", self.reward_z, self._reward_jump),
            ("kl_jump", "kl", self.kl_factor, self._kl_jump),
            ("perplexity_collapse", "perplexity", self.perplexity_ratio, self._perplexity_collapse),
            ("length_blowup", "length", self.length_factor, self._length_blowup),
        ]
        alerts = []
        for signal, name, threshold, rule in rules:
            value = values[name]
            if threshold is None or (base := self._baseline(name, value)) is None:
                continue
            center, spread = base
            if (why := rule(value, center, spread, threshold)) is not None:
                alerts.append(Alert(signal, step, value, center, f"step {step}: {why}"))
        return alerts

    def _baseline(self, name: str, value: float) -> tuple[float, float] | None:
        """(median, robust spread) of ``name``'s history, or None before the warm-up or for a bad value."""
        history = self.history[name]
        if len(history) < self.warmup or not math.isfinite(value):
            return None
        center = median(history)
        mad = median(abs(v - center) for v in history)
        # the larger of two estimates: either alone, over a short window, is now and then far too small
        return center, max(MAD_TO_STD * mad, pstdev(history), MIN_SPREAD_FRACTION * abs(center), MIN_SPREAD)

    # The rules: (the step's value, its series' median and robust spread, the rule's threshold) -> why the signal
    # fires (the alert's message after "step N: "), or None

    def _reward_jump(self, value: float, center: float, spread: float, reward_z: float) -> str | None:
        z = (value - center) / spread
        if z <= reward_z:
            return None
        return (
            f"reward jumped to {value:.4g} from a recent median of {center:.4g} ({z:.1f} times its recent spread "
            "above it); the policy may have found a shortcut in the reward model"
        )

    def _kl_jump(self, value: float, center: float, spread: float, kl_factor: float) -> str | None:
        if value < self.kl_min or value < kl_factor * max(center, 0.0):
            return None
        return (
            f"KL to the reference jumped to {value:.4g} from a recent median of {center:.4g}; the policy broke away "
            "from the reference, its outputs may have collapsed"
        )

    def _perplexity_collapse(self, value: float, center: float, spread: float, ratio: float) -> str | None:
        # log perplexity is the mean surprisal per token: 0 for a deterministic policy
        if center <= 1.0 or value <= 0 or math.log(max(value, 1.0)) >= ratio * math.log(center):
            return None
        return (
            f"perplexity fell to {value:.4g} from a recent median of {center:.4g}; the policy became "
            "near-deterministic (mode collapse)"
        )

    def _length_blowup(self, value: float, center: float, spread: float, factor: float) -> str | None:
        # Pinned at the cap, which keeps the length from reaching the threshold: a blow-up when the rise is at
        # least half the threshold's (responses at the cap from the start, 15.8 -> 16 of 16, are no blow-up).
        rise = 1 + (factor - 1) / 2
        pinned = self.max_length is not None and value >= self.max_length >= rise * center
        if not (value >= factor * center and value > center) and not pinned:
            return None
        why = f"every response hit the maximum length ({self.max_length})" if pinned else "responses blew up"
        return f"mean response length rose to {value:.4g} from a recent median of {center:.4g}; {why}"

    def state_dict(self) -> dict[str, Any]:
        return {"history": {name: list(values) for name, values in self.history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in WATCHED:
            self.history[name] = deque(state["history"].get(name, []), maxlen=self.window)


def check_collapse(
    action: str,
    monitor: CollapseMonitor,
    run: "Run",
    step: int,
    metrics: dict[str, float],
    models: dict[str, Any],
) -> "JobResult | None":
    """Judge ``step``'s metrics for collapse signals (unless ``action`` is "off"): a ``warning`` event for each;
    then with ``action`` "pause" the job ends paused at this step without checkpointing it (the returned result),
    with "stop" it fails (:class:`TrainingCollapseError`, also without that checkpoint). None: train on."""
    if action == "off" or not (alerts := monitor.update(step, metrics)):
        return None
    for alert in alerts:
        run.callbacks.on_event("warning", alert.message, alert.data())
    if action not in ("pause", "stop"):
        return None
    names = ", ".join(alert.signal for alert in alerts)
    reason = f"training collapse at step {step} ({names})"
    error = TrainingCollapseError(f"{reason}; collapse.action is stop") if action == "stop" else None
    return run.halt(step, metrics, models, reason, error)  # raises the error when given: the job fails
