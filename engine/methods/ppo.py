"""PPO numerics for language models: rewards, GAE, losses, KL controllers, score normaliser.

Pure functions of tensors; each is tested against a naive loop in tests/engine/test_ppo_math.py.
Shapes: B rollouts, T response tokens; ``mask`` (B, T) is 1 on the tokens kept after truncation.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.ops import last_valid_index, masked_var
from engine.spec.config import PPOConfig


def compute_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards: -β·KL on every token, plus the sequence score on its last kept token.

    Returns (rewards, non_score_reward), both (B, T) and zero outside ``mask``.
    lm-human-preferences/lm_human_preferences/train_policy.py (compute_rewards)
    """
    non_score_reward = -kl_coef * kl * mask  # (B, T)
    rewards = non_score_reward.clone()
    last = last_valid_index(mask)  # (B,)
    rows = torch.arange(scores.shape[0], device=scores.device)
    rewards[rows, last] += scores
    return rewards, non_score_reward


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., arXiv:1506.02438).

    delta_t = r_t + γ V_{t+1} - V_t and A_t = delta_t + γλ A_{t+1}, with V = 0 after the
    last kept token. Returns (advantages, returns = advantages + values), zero outside ``mask``.
    """
    rewards, values = rewards * mask, values * mask
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(T)):
        next_values = values[:, t + 1] if t + 1 < T else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


@dataclass
class PolicyLossOut:
    pg_loss: torch.Tensor
    """Clipped surrogate loss (scalar, differentiable)."""
    clipfrac: torch.Tensor
    """Fraction of tokens where the clipped term was taken."""
    approxkl: torch.Tensor
    """0.5·E[(log ratio)²], an estimate of KL(old || new)."""


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    n_tokens: float | torch.Tensor | None = None,
) -> PolicyLossOut:
    """PPO's clipped surrogate (arXiv:1707.06347, eq. 7), averaged over masked tokens.

    ``n_tokens`` is the divisor of the token mean; pass the minibatch's token count when the
    minibatch is split into micro-batches, so accumulated gradients equal the whole-batch one.
    """
    n = mask.sum() if n_tokens is None else n_tokens
    log_ratio = logprobs - old_logprobs  # (B, T)
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = (torch.maximum(pg_losses, pg_losses_clipped) * mask).sum() / n
    with torch.no_grad():
        clipfrac = ((pg_losses_clipped > pg_losses).float() * mask).sum() / n
        approxkl = (0.5 * log_ratio**2 * mask).sum() / n
    return PolicyLossOut(pg_loss, clipfrac, approxkl)


def value_loss(
    vpreds: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    n_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5·max((v - R)², (clip(v, V ± ε_v) - R)²) over masked tokens.

    Returns (vf_loss, vf_clipfrac). lm-human-preferences/lm_human_preferences/train_policy.py
    """
    n = mask.sum() if n_tokens is None else n_tokens
    vpreds_clipped = old_values + torch.clamp(vpreds - old_values, -cliprange_value, cliprange_value)
    vf_losses = (vpreds - returns) ** 2
    vf_losses_clipped = (vpreds_clipped - returns) ** 2
    vf_loss = 0.5 * (torch.maximum(vf_losses, vf_losses_clipped) * mask).sum() / n
    with torch.no_grad():
        vf_clipfrac = ((vf_losses_clipped > vf_losses).float() * mask).sum() / n
    return vf_loss, vf_clipfrac


class FixedKLController:
    """A constant β."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """β ← β·(1 + clip(KL/target - 1, ±0.2)·n/horizon) (Ziegler et al., arXiv:1909.08593, sec. 2.2)."""

    def __init__(self, kl_coef: float, target: float, horizon: int) -> None:
        super().__init__(kl_coef)
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


class RunningMoments:
    """Running mean and std of every value seen (Chan et al. parallel update), for score scaling.

    MOSS-RLHF's PPO-max normalises rewards by these moments (arXiv:2307.04964).
    """

    def __init__(self) -> None:
        self.mean = 0.0
        self.var = 1.0
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().double().flatten()
        n = x.numel()
        batch_mean = x.mean().item()
        batch_var = x.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over masked tokens."""
    return 1 - masked_var(returns - values, mask) / masked_var(returns, mask).clamp(min=1e-8)


def shape_scores(
    scores: torch.Tensor, stopped: torch.Tensor | None, cfg: PPOConfig, moments: RunningMoments
) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, shaped) scores (B,): the reward's less the missing-stop penalty for responses that did not stop
    (``stopped``: None when responses have no stop token), then normalised by the running ``moments`` (updated
    here) and clipped, where configured (PPO-max)."""
    raw_scores = scores.clone()  # (B,)
    if stopped is not None:
        raw_scores -= cfg.missing_eos_penalty * (~stopped).float()
    scores = raw_scores
    if cfg.normalize_scores:
        moments.update(scores)
        scores = (scores - moments.mean) / max(moments.std, 1e-8)
    if cfg.score_clip is not None:
        scores = scores.clamp(-cfg.score_clip, cfg.score_clip)
    return raw_scores, scores
