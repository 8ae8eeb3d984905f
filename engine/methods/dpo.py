"""DPO numerics: sequence log-probabilities and the pairwise preference losses.

Pure functions of tensors; each is tested against a naive loop in tests/engine/test_dpo_math.py.
Shapes: B preference pairs, L tokens of prompt + completion; labels are -100 where not trained.
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def sequence_logps(token_logps: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ_t log p(label_t | tokens_<t) over the trained tokens: (B, L-1), (B, L) -> (B,).

    ``token_logps`` are the log-probabilities of tokens 1 .. L-1 of the sequences the labels mark
    (:func:`engine.core.models.token_logprobs` from position 1), labels of -100 (prompt, padding) contribute 0.
    """
    return torch.where(labels[:, 1:] != IGNORE_INDEX, token_logps, 0.0).sum(-1)


@dataclass
class DPOLossOut:
    losses: torch.Tensor
    """Per-pair loss (B,), differentiable; not reduced."""
    chosen_rewards: torch.Tensor
    """Implicit reward β·(log π(y_c) - log π_ref(y_c)), (B,), detached."""
    rejected_rewards: torch.Tensor
    """Implicit reward β·(log π(y_r) - log π_ref(y_r)), (B,), detached."""


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss_type: Literal["sigmoid", "ipo", "hinge"],
    label_smoothing: float = 0.0,
) -> DPOLossOut:
    """Per-pair preference loss from the log-probabilities (B,) of the chosen and rejected completions.

    With h = (π_c - π_r) - (ref_c - ref_r):
    sigmoid: -(1-ε)·log σ(βh) - ε·log σ(-βh), DPO (arXiv:2305.18290, eq. 7) and, for ε > 0, conservative DPO
      (https://ericmitchell.ai/cdpo.pdf, eq. 3), ε the probability that a label is flipped;
    ipo: (h - 1/(2β))², IPO (arXiv:2310.12036, eq. 17), β being the paper's τ; the loop passes per-token *average*
      log-probabilities for ipo (as TRL does), sums for the others;
    hinge: relu(1 - βh), SLiC (arXiv:2305.10425).
    ``label_smoothing`` applies to sigmoid only; ipo and hinge ignore it, as TRL does.
    trl/trainer/dpo_trainer.py (DPOTrainer.dpo_loss)
    """
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)  # (B,)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(-beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected 'sigmoid', 'ipo' or 'hinge'")
    with torch.no_grad():
        chosen_rewards = beta * (policy_chosen - ref_chosen)
        rejected_rewards = beta * (policy_rejected - ref_rejected)
    return DPOLossOut(losses, chosen_rewards, rejected_rewards)
