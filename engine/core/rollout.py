"""Rollouts, for every online method (PPO, GRPO and its relatives, distillation): sample responses to a batch of
prompts, ``group_size`` each, then take the reference's log-probs, the reward's scores and, with a critic, its
values. Every forward here runs without a graph; the training forwards are the :class:`engine.core.learner.Learner`'s.
"""

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.core.distributed import Ranks
from engine.core.generate import response_texts
from engine.core.learner import Learner, Tokens, base_of, chunks
from engine.core.models import (
    ScalarHead,
    folded_adapters,
)
from engine.core.ops import is_stop, truncate_after_stop
from engine.rewards.graders import RewardScores
from engine.rewards.reward_model import score_texts, sequence_scores
from engine.spec.policy_losses import rollout_correction


@dataclass
class Rollout:
    """A batch's samples: N = prompts × group_size rows, a prompt's samples next to each other."""

    query_responses: torch.Tensor
    """Prompt (left-padded) followed by response (right-padded): (N, P + T)."""
    attention_mask: torch.Tensor
    """1 on prompt and kept response tokens: (N, P + T)."""
    context_length: int
    """P, where the responses start."""
    responses: torch.Tensor
    """Response tokens, pad after the stop token: (N, T)."""
    mask: torch.Tensor
    """1 on kept response tokens (up to and including the stop token): (N, T)."""
    stopped: torch.Tensor
    """Whether each response produced a stop token: (N,)."""
    logprobs: torch.Tensor
    """The sampling policy's log-probabilities of the response tokens at the sampling temperature, 0 after the
    stop: (N, T). Taken while sampling: the same numbers as a forward over the whole sequence, up to rounding."""
    ref_logprobs: torch.Tensor
    """The reference's, same temperature, 0 after the stop; the policy's own without a reference: (N, T)."""
    scores: torch.Tensor
    """The reward of each sample: (N,)."""
    values: torch.Tensor | None = None
    """With a critic, its values of the states before each response token: (N, T)."""
    sampler_logprobs: torch.Tensor | None = None
    """Where the trainer's log-probs were taken again (``logprobs``, for ``rollout_correction``), the sampler's,
    0 after the stop: (N, T)."""

    @property
    def tokens(self) -> Tokens:
        return Tokens(self.query_responses, self.attention_mask, self.context_length)


Scorer = Callable[[Sequence[dict[str, Any]], Tokens], tuple[torch.Tensor, RewardScores | None]]
"""The reward of rollout rows: (their dataset rows, their tokens) -> (scores (n,), and for a reward of graders their
:class:`RewardScores`, each component's). See :func:`token_scorer`, :func:`text_scorer` and
:func:`engine.rewards.function.grader_scorer`."""


@torch.inference_mode()
def roll_out(
    learner: Learner,
    rows: Sequence[dict[str, Any]],
    queries: torch.Tensor,
    query_mask: torch.Tensor,
    generator: torch.Generator,
    scorer: Scorer,
    pad_token_id: int,
    group_size: int = 1,
    critic: PreTrainedModel | None = None,
    trainer_logprobs: bool = False,
) -> tuple[Rollout, RewardScores | None]:
    """``group_size`` responses to each query (B, P) of the dataset ``rows``, each up to its first stop token,
    with the sampler's log-probs (:meth:`Learner.sample`; with ``trainer_logprobs``, the trainer's taken again by
    :meth:`Learner.forward`, the sampler's kept as ``sampler_logprobs``), the reference's (none: the policy's own), the
    ``scorer``'s rewards and, with a ``critic`` (a sequence-classification model), its values, taken under
    :func:`engine.core.models.folded_adapters` (folded in float32, unfused in half precision, so the values agree with
    the update's). Forwards run ``learner.chunk_size`` rows at a time."""
    raw, raw_logprobs = learner.sample(queries, query_mask, generator, group_size, retake=not trainer_logprobs)
    responses, mask, stopped = truncate_after_stop(raw, learner.sampling.stop_token_ids, pad_token_id)
    query_responses = torch.cat([queries.repeat_interleave(group_size, 0), responses], dim=1)  # (N, P + T)
    attention_mask = torch.cat([query_mask.repeat_interleave(group_size, 0), mask], dim=1)
    tokens = Tokens(query_responses, attention_mask, queries.shape[1])
    logprobs = sampler_logprobs = raw_logprobs * mask  # (N, T)
    if trainer_logprobs:  # the policy before the step's updates, as the training pass computes it
        logprobs = learner.forward(tokens) * mask
    ref_logprobs = learner.forward(tokens, reference=True) * mask if learner.reference is not None else logprobs
    scores, graded = scorer([row for row in rows for _ in range(group_size)], tokens)
    values = None
    if critic is not None:
        critic.eval()
        with folded_adapters(critic):  # after the scorer, which may take the critic's base (adapters disabled)
            head = ScalarHead(critic)
            parts = chunks(len(tokens), learner.chunk_size)
            values = torch.cat([response_values(head, query_responses[c], attention_mask[c], tokens.context_length)
                                for c in parts])  # fmt: skip
    rollout = Rollout(query_responses, attention_mask, tokens.context_length, responses, mask, stopped, logprobs,
                      ref_logprobs, scores, values, sampler_logprobs if trainer_logprobs else None)  # fmt: skip
    return rollout, graded


def response_values(
    critic: torch.nn.Module, query_responses: torch.Tensor, attention_mask: torch.Tensor, context_length: int
) -> torch.Tensor:
    """Critic values for the states before each response token: (B, T). ``critic``: a :class:`ScalarHead`."""
    values, _ = critic(query_responses, attention_mask)  # (B, P + T)
    return values[:, context_length - 1 : -1]


def token_scorer(reward_model: PreTrainedModel | None, value_model: PreTrainedModel, chunk_size: int) -> Scorer:
    """Scores of the sampled tokens themselves, for a reward model of the policy's vocabulary (``None``: the
    critic's base with its LoRA adapters disabled, the critic having started as the reward model)."""

    def score(rows: Sequence[dict[str, Any]], tokens: Tokens) -> tuple[torch.Tensor, None]:
        parts = []
        for c in chunks(len(tokens), chunk_size):
            with base_of(value_model) if reward_model is None else nullcontext():
                model = reward_model or value_model
                parts.append(sequence_scores(model, tokens.query_responses[c], tokens.attention_mask[c]))
        return torch.cat(parts), None

    return score


def text_scorer(
    reward_model: PreTrainedModel,
    reward_tokenizer: PreTrainedTokenizerBase,
    policy_tokenizer: PreTrainedTokenizerBase,
    stop_token_ids: Sequence[int],
    chunk_size: int,
) -> Scorer:
    """Scores of the decoded responses, encoded anew by the reward model's own tokenizer (:func:`score_texts`)."""

    def score(rows: Sequence[dict[str, Any]], tokens: Tokens) -> tuple[torch.Tensor, None]:
        parts = []
        for c in chunks(len(tokens), chunk_size):
            texts, stopped = decode_responses(policy_tokenizer, tokens.rows(c), stop_token_ids)
            prompts = [row["prompt"] for row in rows[c]]
            parts.append(score_texts(reward_model, reward_tokenizer, prompts, texts, stopped, policy_tokenizer))
        return torch.cat(parts), None

    return score


def decode_responses(
    tokenizer: PreTrainedTokenizerBase, tokens: Tokens, stop_token_ids: Sequence[int]
) -> tuple[list[str], list[bool]]:
    """The responses of rollout rows as text (up to their stop token, special tokens dropped), and whether each
    ended with a stop token (any of ``stop_token_ids``)."""
    P = tokens.context_length
    responses, mask = tokens.query_responses[:, P:], tokens.attention_mask[:, P:]  # (B, T)
    stopped = (is_stop(responses, stop_token_ids) & (mask == 1)).any(1).tolist()
    return response_texts(tokenizer, responses, mask, stop_token_ids), stopped


def correction_metrics(ro: Rollout, cap: float | None) -> dict[str, float]:
    """Where the rollout took the trainer's log-probs again (``sampler_logprobs``): ``rollout/logprob_gap``, the
    mean over response tokens of |sampler's - trainer's| log-prob (the sync check), and with ``cap``
    ``rollout/correction_capped_fraction``, the share of them whose weight min(π_old/π_sampler, cap) is the cap.
    Else none."""
    if ro.sampler_logprobs is None:
        return {}
    mask = ro.mask.float()  # (N, T)
    n_tokens = mask.sum().clamp(min=1)
    metrics = {"rollout/logprob_gap": ((ro.sampler_logprobs - ro.logprobs).abs() * mask).sum() / n_tokens}
    if cap is not None:
        _, capped = rollout_correction(mask, ro.logprobs, ro.sampler_logprobs, cap)
        metrics["rollout/correction_capped_fraction"] = (capped * mask).sum() / n_tokens
    return {name: value.item() for name, value in metrics.items()}


def samples_due(step: int, every: int | None) -> bool:
    """Whether ``step`` keeps a sample of its rollouts: step 1 and every ``every`` steps (None: never)."""
    return every is not None and (step == 1 or step % every == 0)


def logged_samples(
    tokenizer: PreTrainedTokenizerBase,
    ro: Rollout,
    rewards: Mapping[str, Sequence[float]],
    n: int,
    stop_token_ids: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """The first ``n`` rollout rows as :meth:`engine.callbacks.Callbacks.on_samples` takes them: the prompt as the
    policy saw it (its unpadded query tokens, special tokens kept: a chat prompt shows its template), the response
    as graders read it (up to its stop token, special tokens dropped), ``rewards`` by name, the summed log-ratio to
    the reference over the response tokens, and their count (with the stop token)."""
    ids, attention, P = ro.query_responses[:n], ro.attention_mask[:n], ro.context_length
    mask = attention[:, P:]  # (n, T)
    prompts = [tokenizer.decode(query[kept.bool()]) for query, kept in zip(ids[:, :P], attention[:, :P], strict=True)]
    texts = response_texts(tokenizer, ids[:, P:], mask, stop_token_ids)
    kls = ((ro.logprobs[:n] - ro.ref_logprobs[:n]) * mask).sum(1).tolist()  # (n,)
    lengths = mask.sum(1).tolist()  # (n,)
    return [
        {
            "prompt": prompt,
            "response": text,
            "rewards": {name: float(values[i]) for name, values in rewards.items()},
            "kl": float(kls[i]),
            "length": int(lengths[i]),
        }
        for i, (prompt, text) in enumerate(zip(prompts, texts, strict=True))
    ]


def merged(parts: Sequence[RewardScores]) -> RewardScores:
    """The scores of several batches as one (each batch's components alike)."""
    components: dict[str, list[float]] = {}
    for part in parts:
        for name, values in part.components.items():
            components.setdefault(name, []).extend(values)
    return RewardScores([value for part in parts for value in part.total], components)


def pad_responses(ro: Rollout, length: int, pad_token_id: int) -> Rollout:
    """``ro`` with its responses padded to ``length`` tokens (masked out, zero log-probabilities and values)."""
    extra = length - ro.responses.shape[1]
    if extra == 0:
        return ro

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, extra), value=value)

    return replace(
        ro,
        query_responses=pad(ro.query_responses, pad_token_id),
        attention_mask=pad(ro.attention_mask, 0),
        responses=pad(ro.responses, pad_token_id),
        mask=pad(ro.mask, 0),
        logprobs=pad(ro.logprobs, 0),
        ref_logprobs=pad(ro.ref_logprobs, 0),
        values=None if ro.values is None else pad(ro.values, 0),
        sampler_logprobs=None if ro.sampler_logprobs is None else pad(ro.sampler_logprobs, 0),
    )


def gather_rollout(ro: Rollout, ranks: Ranks, pad_token_id: int) -> Rollout:
    """Every rank's rollout rows, in rank order: the whole batch, on every rank. Responses are first padded to
    the longest of any rank (sampling stops early when all of a rank's rows have stopped)."""
    if ranks.world_size == 1:
        return ro
    ro = pad_responses(ro, ranks.max(ro.responses.shape[1]), pad_token_id)
    kept = [f.name for f in fields(ro) if f.name != "context_length" and getattr(ro, f.name) is not None]
    return Rollout(context_length=ro.context_length, **{name: ranks.gather(getattr(ro, name)) for name in kept})
