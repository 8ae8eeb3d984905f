"""Critic-free policy-gradient numerics: group baselines and the clipped surrogate with separate clip ranges (the loss
aggregations, which every method's learner uses, are engine/core/ops.py's ``aggregate``). Pure functions of tensors,
each tested against a naive per-example loop of its paper's formula in tests/engine/test_grpo_math.py.

Shapes: N = prompts × ``group_size`` samples, the samples of one prompt next to each other (rows
``g*G .. g*G + G - 1`` are group g); T response tokens; ``mask`` (N, T) is 1 on the kept tokens.
"""

import torch

from engine.core.ops import masked_whiten
from engine.spec.config import WHITENED, Estimator

STD_EPS = 1e-4
"""Added to a group's standard deviation before dividing by it (as TRL's GRPO)."""


def groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) → (N / group_size, group_size): one row per prompt."""
    if x.shape[0] % group_size:
        raise ValueError(f"{x.shape[0]} samples do not split into groups of {group_size}")
    return x.view(-1, group_size)


def sequence_advantages(scores: torch.Tensor, group_size: int, estimator: Estimator) -> torch.Tensor:
    """Each sample's advantage from the scores (N,) of its group, before any KL term:

    - ``grpo`` (Shao et al., arXiv:2402.03300): (r - mean) / (std + ε), std the group's unbiased one;
    - ``dr_grpo`` (Liu et al., arXiv:2503.20783): r - mean, no division by the std;
    - ``rloo`` (Ahmadian et al., arXiv:2402.14740): r minus the mean of the group's other samples;
    - ``reinforce_pp`` (Hu, arXiv:2501.03262): r itself (whitened over the batch later);
    - ``reinforce_pp_baseline``: r - mean (whitened over the batch later).
    """
    if estimator == "reinforce_pp":
        return scores.clone()
    g = groups(scores, group_size)  # (n, G)
    mean = g.mean(1, keepdim=True)
    if estimator == "grpo":
        std = g.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        return ((g - mean) / (std + STD_EPS)).flatten()
    if estimator == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs group_size of at least 2: each sample's baseline is the others' mean")
        return ((g - mean) * group_size / (group_size - 1)).flatten()
    return (g - mean).flatten()  # dr_grpo, reinforce_pp_baseline


def kl_to_go(kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """The KL penalty's return from each token on: Σ_{s ≥ t} -β·kl_s over the kept tokens (γ = 1): (N, T)."""
    penalty = -kl_coef * kl * mask
    return penalty.flip(1).cumsum(1).flip(1) * mask


def token_advantages(
    scores: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    estimator: Estimator,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Advantages (N, T): the sequence advantage on every kept token, plus with ``kl`` (the per-token KL to the
    reference, when it is part of the reward) its return from each token on; whitened over the batch's kept
    tokens for the REINFORCE++ estimators (Hu 2025: the score and the KL rewards form the return, then the batch
    normalises it)."""
    advantages = sequence_advantages(scores, group_size, estimator).unsqueeze(1) * mask  # (N, T)
    if kl is not None:
        advantages = advantages + kl_to_go(kl, mask, kl_coef)
    if estimator in WHITENED:
        advantages = masked_whiten(advantages, mask)
    return advantages * mask


def tied_groups(scores: torch.Tensor, group_size: int, estimator: Estimator) -> torch.Tensor:
    """Share of the batch's samples whose score (N,) carries no learning signal: it ties with every score its
    baseline is taken from, so its advantage holds no score term (0 for the group estimators, bar a KL in the
    reward; after the REINFORCE++ whitening, only the batch's common shift and the KL's return).

    - group baselines (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp_baseline``: the group mean subtracted): the
      samples of groups whose scores all tie, r - mean being 0 on each (at ``group_size`` 1, every sample);
    - ``reinforce_pp`` (no group baseline, whitened over the batch): the whole batch when all its scores tie
      (whitening a constant leaves 0), else none: a tied group still differs from the batch's mean.

    Ties are of the scores themselves, not of advantages that round to 0. Groups are of one size, so the share of
    tied groups is the share of samples.
    """
    if estimator == "reinforce_pp":
        group_size = scores.shape[0]  # its one baseline is the batch's
    g = groups(scores, group_size)  # (n, G)
    return (g.max(1).values == g.min(1).values).float().mean()


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective per token with the ratio kept in [1 - clip_low, 1 + clip_high] (DAPO's
    clip-higher, arXiv:2503.14476, when clip_high > clip_low). Returns (loss (N, T), where the clipped term was
    taken (N, T) as floats)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()
