"""Policy losses, registered by name beside their formulas (``policy_loss`` of ``ppo`` and ``grpo`` jobs).

Importable without torch: engine/config.py validates names against :data:`POLICY_LOSSES`. The bodies use tensor
methods only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LossSettings:
    clip_low: float
    """The ratio is clipped below at 1 - clip_low."""
    clip_high: float
    """The ratio is clipped above at 1 + clip_high."""


@dataclass
class PolicyLossOut:
    per_token: torch.Tensor
    """The loss of each token (n, T), differentiable; the caller aggregates it over the mask."""
    clipped: torch.Tensor
    """1.0 where a clip was active (n, T), for ``policy/clipfrac``."""


PolicyLoss = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor", LossSettings], PolicyLossOut]
"""(logprobs (n, T) with the graph, old_logprobs, advantages, mask, settings) -> :class:`PolicyLossOut`."""

POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    def add(loss: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES[name] = loss
        return loss

    return add


@register("ppo_clip")
def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
) -> PolicyLossOut:
    """PPO's clipped surrogate (arXiv:1707.06347, eq. 7) with the ratio kept in [1 - clip_low, 1 + clip_high]."""
    ratio = (logprobs - old_logprobs).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)
    return PolicyLossOut(unclipped.maximum(clipped), (clipped > unclipped).float())
