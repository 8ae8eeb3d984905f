"""PPO rollouts: sample responses, then score them with policy, reference, critic and reward model.

Every forward here runs under ``torch.inference_mode()``; the training forwards are in ppo_train.py.
"""

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.distributed import Ranks
from engine.generate import Decoder, response_texts, sample
from engine.models import ScalarHead, folded_adapters, rounds_when_folded, token_logprobs
from engine.ops import is_stop, truncate_after_stop
from engine.reward import score_texts, sequence_scores


@dataclass
class Rollout:
    query_responses: torch.Tensor
    """Prompt (left-padded) followed by response (right-padded): (B, P + T)."""
    attention_mask: torch.Tensor
    """1 on prompt and kept response tokens: (B, P + T)."""
    context_length: int
    """P, where the responses start."""
    responses: torch.Tensor
    """Response tokens, pad after the stop token: (B, T)."""
    mask: torch.Tensor
    """1 on kept response tokens (up to and including the stop token): (B, T)."""
    stopped: torch.Tensor
    """Whether each response produced a stop token: (B,)."""
    logprobs: torch.Tensor
    """Policy log-probabilities of the response tokens at the sampling temperature, 0 after the stop: (B, T).
    Taken while sampling: the same numbers as a forward over the whole sequence, up to rounding."""
    ref_logprobs: torch.Tensor
    """Reference log-probabilities, same temperature: (B, T)."""
    values: torch.Tensor
    """Critic's values of the states before each response token: (B, T)."""
    scores: torch.Tensor
    """Reward model's score at the last kept token: (B,)."""


def response_values(
    critic: torch.nn.Module, query_responses: torch.Tensor, attention_mask: torch.Tensor, context_length: int
) -> torch.Tensor:
    """Critic values for the states before each response token: (B, T). ``critic``: a :class:`ScalarHead`."""
    values, _ = critic(query_responses, attention_mask)  # (B, P + T)
    return values[:, context_length - 1 : -1]


def base_of(model: PreTrainedModel) -> AbstractContextManager[None]:
    """Within this block a LoRA model computes as its frozen base model."""
    return model.disable_adapter()  # type: ignore[operator]


Scorer = Callable[[Sequence[dict[str, Any]], torch.Tensor, torch.Tensor, int], torch.Tensor]
"""Scores of rollout rows: (their dataset rows, query_responses (b, P + T), attention_mask (b, P + T), P) -> (b,).
See :func:`token_scorer`, :func:`text_scorer` and :func:`engine.rewards.grader_scorer`."""


def token_scorer(reward_model: PreTrainedModel | None, value_model: PreTrainedModel) -> Scorer:
    """Scores of the sampled tokens themselves, for a reward model of the policy's vocabulary (``None``: the
    critic's base with its LoRA adapters disabled, the critic having started as the reward model)."""

    def score(
        rows: Sequence[dict[str, Any]], query_responses: torch.Tensor, attention_mask: torch.Tensor, P: int
    ) -> torch.Tensor:
        with base_of(value_model) if reward_model is None else nullcontext():
            return sequence_scores(reward_model or value_model, query_responses, attention_mask)

    return score


def text_scorer(
    reward_model: PreTrainedModel,
    reward_tokenizer: PreTrainedTokenizerBase,
    policy_tokenizer: PreTrainedTokenizerBase,
    stop_token_ids: Sequence[int],
) -> Scorer:
    """Scores of the decoded responses, encoded anew by the reward model's own tokenizer (:func:`score_texts`)."""

    def score(
        rows: Sequence[dict[str, Any]], query_responses: torch.Tensor, attention_mask: torch.Tensor, P: int
    ) -> torch.Tensor:
        texts, stopped = decode_responses(policy_tokenizer, query_responses, attention_mask, P, stop_token_ids)
        prompts = [row["prompt"] for row in rows]
        return score_texts(reward_model, reward_tokenizer, prompts, texts, stopped, policy_tokenizer)

    return score


def decode_responses(
    tokenizer: PreTrainedTokenizerBase,
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    P: int,
    stop_token_ids: Sequence[int],
) -> tuple[list[str], list[bool]]:
    """The responses of rollout rows as text (up to their stop token, special tokens dropped), and whether each
    ended with a stop token (any of ``stop_token_ids``)."""
    responses, mask = query_responses[:, P:], attention_mask[:, P:]  # (B, T)
    stopped = (is_stop(responses, stop_token_ids) & (mask == 1)).any(1).tolist()
    return response_texts(tokenizer, responses, mask, stop_token_ids), stopped


def samples_due(step: int, every: int | None) -> bool:
    """Whether ``step`` keeps a sample of its rollouts: step 1 and every ``every`` steps (None: never)."""
    return every is not None and (step == 1 or step % every == 0)


def logged_samples(
    tokenizer: PreTrainedTokenizerBase,
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    P: int,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    rewards: Mapping[str, Sequence[float]],
    n: int,
    stop_token_ids: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """The first ``n`` rollout rows as :meth:`engine.callbacks.Callbacks.on_samples` takes them: the prompt as the
    policy saw it (its unpadded query tokens, special tokens kept: a chat prompt shows its template), the response
    as graders read it (up to its stop token, special tokens dropped), ``rewards`` by name, the summed log-ratio to
    the reference over the response tokens, and their count (with the stop token). ``query_responses``,
    ``attention_mask``: (B, P + T); ``logprobs``, ``ref_logprobs``: (B, T)."""
    qr, am = query_responses[:n], attention_mask[:n]
    mask = am[:, P:]  # (n, T)
    prompts = [tokenizer.decode(query[kept.bool()]) for query, kept in zip(qr[:, :P], am[:, :P], strict=True)]
    texts = response_texts(tokenizer, qr[:, P:], mask, stop_token_ids)
    kls = ((logprobs[:n] - ref_logprobs[:n]) * mask).sum(1).tolist()  # (n,)
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


@torch.inference_mode()
def sample_responses(
    policy: PreTrainedModel,
    queries: torch.Tensor,
    query_mask: torch.Tensor,
    response_length: int,
    temperature: float,
    top_k: int,
    stop_token_ids: Sequence[int],
    generator: torch.Generator,
    chunk_size: int,
    group_size: int = 1,
    decoder: Decoder | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``group_size`` responses to each query (B, P), with their log-probs: raw tokens and log-probs (B·G, T), as
    :func:`engine.generate.sample` gives them. LoRA adapters are folded into the weights for the sampling (the full
    model's speed). Where folding rounds them (half-precision weights, :func:`engine.models.rounds_when_folded`),
    the log-probs of the sampled tokens are taken again by the training pass itself (adapters unfused,
    ``chunk_size`` rows at a time): PPO's old log-probs, ratio, approx-KL and KL then agree with the update's. That
    is one forward over the sampled tokens, where decoding unfused pays the adapters' kernels at every token."""
    with folded_adapters(policy, rounded=True):
        raw, logprobs = sample(policy, queries, query_mask, response_length, temperature, top_k=top_k,
                               eos_token_id=stop_token_ids, generator=generator, group_size=group_size,
                               decoder=decoder)  # fmt: skip
    if rounds_when_folded(policy):
        P = queries.shape[1]
        query_responses = torch.cat([queries.repeat_interleave(group_size, 0), raw], dim=1)  # (B·G, P + T)
        attention_mask = torch.cat([query_mask.repeat_interleave(group_size, 0), torch.ones_like(raw)], dim=1)
        # taken over every sampled token: those after a row's stop are junk, as the sampler's are (the caller masks)
        chunks = [slice(i, i + chunk_size) for i in range(0, raw.shape[0], chunk_size)]
        logprobs = torch.cat(
            [token_logprobs(policy, query_responses[c], attention_mask[c], P, temperature)[0] for c in chunks]
        )
    return raw, logprobs


@torch.inference_mode()
def make_rollout(
    policy: PreTrainedModel,
    ref_policy: PreTrainedModel | None,
    value_model: PreTrainedModel,
    scorer: Scorer,
    rows: Sequence[dict[str, Any]],
    queries: torch.Tensor,
    query_mask: torch.Tensor,
    response_length: int,
    temperature: float,
    top_k: int,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator,
    chunk_size: int,
    decoder: Decoder | None = None,
) -> Rollout:
    """Sample one response per query (B, P) of the dataset ``rows``, each up to its first of ``stop_token_ids``
    (none: ``response_length`` tokens), and evaluate it with reference, critic and reward
    model (``scorer``) in chunks of ``chunk_size``. The policy's log-probabilities come from sampling itself
    (:func:`sample_responses`: LoRA folded, its log-probs taken again where the fold rounds); the critic's forward
    runs under :func:`folded_adapters` (folded in float32, unfused in half precision, so the values agree with
    the update's).

    A ``None`` reference means: the policy's base, with its LoRA adapters disabled. ``decoder``: the job's
    compiled decoding on static caches (:class:`engine.generate.Decoder`); None: the growing cache, eagerly.
    """
    policy.eval()
    value_model.eval()
    raw, raw_logprobs = sample_responses(
        policy,
        queries,
        query_mask,
        response_length,
        temperature,
        top_k,
        stop_token_ids,
        generator,
        chunk_size,
        decoder=decoder,
    )  # (B, T)
    responses, mask, stopped = truncate_after_stop(raw, stop_token_ids, pad_token_id)
    query_responses = torch.cat([queries, responses], dim=1)  # (B, P + T)
    attention_mask = torch.cat([query_mask, mask], dim=1)
    P = queries.shape[1]
    chunks = [slice(i, i + chunk_size) for i in range(0, queries.shape[0], chunk_size)]
    ref_logprobs, scores = [], []
    for c in chunks:
        qr, am = query_responses[c], attention_mask[c]
        with base_of(policy) if ref_policy is None else nullcontext():
            ref_logprobs.append(token_logprobs(ref_policy or policy, qr, am, P, temperature)[0])
        scores.append(scorer(rows[c], qr, am, P))
    with folded_adapters(value_model):  # after the scorer, which may take the critic's base (adapters disabled)
        values = [response_values(ScalarHead(value_model), query_responses[c], attention_mask[c], P) for c in chunks]
    return Rollout(
        query_responses=query_responses,
        attention_mask=attention_mask,
        context_length=P,
        responses=responses,
        mask=mask,
        stopped=stopped,
        logprobs=raw_logprobs * mask,
        ref_logprobs=torch.cat(ref_logprobs),
        values=torch.cat(values),
        scores=torch.cat(scores),
    )


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
        values=pad(ro.values, 0),
    )


def gather_rollout(ro: Rollout, ranks: Ranks, pad_token_id: int) -> Rollout:
    """Every rank's rollout rows, in rank order: the whole batch, on every rank. Responses are first padded to
    the longest of any rank (sampling stops early when all of a rank's rows have stopped)."""
    if ranks.world_size == 1:
        return ro
    ro = pad_responses(ro, ranks.max(ro.responses.shape[1]), pad_token_id)
    tensors = {f.name: ranks.gather(getattr(ro, f.name)) for f in fields(ro) if f.name != "context_length"}
    return Rollout(context_length=ro.context_length, **tensors)
