"""Masked statistics and token-level helpers, the per-token KL estimators and the loss aggregations, which every
method's learner uses. Pure functions, each tested against a naive loop."""

from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from engine.spec.policy_losses import Aggregation


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (over all dims, or along ``dim``)."""
    if dim is None:
        return (x * mask).sum() / mask.sum()
    return (x * mask).sum(dim) / mask.sum(dim)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Biased variance over the masked positions, as in lm-human-preferences (not TRL's unbiased one)."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``x`` to unit variance (and zero mean when ``shift_mean``) over the masked positions.

    Positions outside the mask come back as 0. lm-human-preferences/lm_human_preferences/utils/core_torch.py
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision values to float32 for softmax; float32 and float64 stay as they are."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under ``logits``: (B, T, V), (B, T) -> (B, T).

    As logit minus log-sum-exp, so no (B, T, V) log-softmax is kept for the backward pass.
    """
    logits = _upcast(logits)
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position: (B, T, V) -> (B, T)."""
    logp = F.log_softmax(_upcast(logits), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def chunked_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    chunk: int,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token) under the logits ``head(hidden)``, and their entropy when ``entropy``: (B, T, H), (B, T) ->
    (B, T), (B, T) or None. The same numbers as :func:`logprobs_from_logits` and :func:`entropy_from_logits` of
    the whole (B, T, V) logits, which never exist at once here: ``chunk`` positions at a time, each chunk's logits
    recomputed in the backward pass (activation checkpointing) instead of kept for it. The entropy takes part in
    the backward only with ``entropy_grad``.
    """
    B, T, H = hidden.shape
    flat_hidden, flat_tokens = hidden.reshape(B * T, H), tokens.reshape(B * T)

    def stats(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(h)  # (chunk, V)
        logprobs = logprobs_from_logits(logits, t)
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            ent = entropy_from_logits(logits) if entropy else logprobs.new_zeros(())
        return logprobs, ent

    recompute = torch.is_grad_enabled() and chunk < B * T
    parts = [
        checkpoint(stats, flat_hidden[i : i + chunk], flat_tokens[i : i + chunk], use_reentrant=False)
        if recompute
        else stats(flat_hidden[i : i + chunk], flat_tokens[i : i + chunk])
        for i in range(0, B * T, chunk)
    ]
    logprobs = torch.cat([lp for lp, _ in parts]).reshape(B, T)
    return logprobs, torch.cat([ent for _, ent in parts]).reshape(B, T) if entropy else None


def first_true_index(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first True per row of a (B, T) tensor, or T where a row has none."""
    T = bools.shape[-1]
    positions = torch.arange(T, device=bools.device).expand_as(bools)
    return torch.where(bools, positions, T).min(-1).values


def stop_ids(ids: int | Sequence[int] | None) -> tuple[int, ...]:
    """Token ids as transformers writes ``eos_token_id`` (one id, a list, or None), as a tuple without repeats."""
    if ids is None:
        return ()
    return tuple(dict.fromkeys([ids] if isinstance(ids, int) else ids))


def is_stop(tokens: torch.Tensor, stop_token_ids: int | Sequence[int] | None) -> torch.Tensor:
    """Whether each token is one of the stop tokens: a bool tensor shaped like ``tokens``."""
    ids = stop_ids(stop_token_ids)
    if not ids:
        return torch.zeros_like(tokens, dtype=torch.bool)
    return torch.isin(tokens, torch.tensor(ids, dtype=tokens.dtype, device=tokens.device))


def truncate_after_stop(
    responses: torch.Tensor, stop_token_ids: int | Sequence[int] | None, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep each response up to and including its first stop token (any of ``stop_token_ids``: one id or several,
    as transformers' ``eos_token_id``); pad the rest.

    Returns (responses, mask, stopped): the padded responses (B, T), the mask of kept tokens
    (B, T) and whether each row contained a stop token (B,).
    """
    B, T = responses.shape
    if not stop_ids(stop_token_ids):
        return responses, torch.ones_like(responses), torch.zeros(B, dtype=torch.bool, device=responses.device)
    stop_at = first_true_index(is_stop(responses, stop_token_ids))  # (B,)
    positions = torch.arange(T, device=responses.device).expand(B, T)
    mask = (positions <= stop_at.unsqueeze(1)).long()  # (B, T)
    return torch.where(mask.bool(), responses, pad_token_id), mask, stop_at < T


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting valid tokens only, so left padding does not shift them: (B, T) -> (B, T)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_valid_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a (B, T) mask (rows may be padded on both sides)."""
    T = attention_mask.shape[-1]
    positions = torch.arange(T, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, -1).max(-1).values


def reward_index(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """Where a sequence-classification model reads each row of (B, T): its last valid token that is not the pad
    token, as transformers' ``*ForSequenceClassification`` pools (so a saved reward model scores in plain
    transformers what it scored in training, also when pad is EOS); a row of nothing else, its last valid token.
    """
    readable = attention_mask.bool() if pad_token_id is None else attention_mask.bool() & (input_ids != pad_token_id)
    index = last_valid_index(readable.long())  # (B,)
    return torch.where(index >= 0, index, last_valid_index(attention_mask))


def kl_per_token(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Literal["k1", "k2", "k3"] = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    k1 = log π - log π_ref (unbiased, can be negative); k2 = ½ (log π - log π_ref)² (biased, always ≥ 0, its
    gradient is the KL's); k3 = (r - 1) - log r with r = π_ref / π (unbiased, always ≥ 0).
    http://joschu.net/blog/kl-approx.html
    """
    log_ratio = logprobs - ref_logprobs  # (B, T)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.expm1(-log_ratio) + log_ratio


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    how: Aggregation,
    n_sequences: int | None = None,
    n_tokens: float | torch.Tensor | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """A loss (N, T) per token reduced to a scalar over the kept tokens:

    - ``token_mean``: Σ loss / the number of kept tokens (DAPO);
    - ``sequence_mean``: the mean over sequences of each one's token mean (the GRPO paper);
    - ``constant``: Σ loss / (sequences × ``max_tokens``), a constant, so no length bias (Dr. GRPO).

    When a minibatch is split into micro-batches, pass its ``n_sequences`` and ``n_tokens``: the parts then sum
    to the whole minibatch's value (and so do their gradients).
    """
    n_seq = per_token.shape[0] if n_sequences is None else n_sequences
    total = per_token * mask
    if how == "token_mean":
        return total.sum() / (mask.sum() if n_tokens is None else n_tokens)
    if how == "sequence_mean":
        return (total.sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seq
    if max_tokens is None:
        raise ValueError("the constant aggregation needs max_tokens")
    return total.sum() / (n_seq * max_tokens)
