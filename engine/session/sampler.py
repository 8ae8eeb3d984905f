"""Sampling as Tinker's ``asample`` does it: ``num_samples`` continuations of one prompt of token ids, each with the
log-probs of its tokens and why it stopped, and on request the log-probs of the prompt's own tokens (what a
client's KL penalty against a reference needs)."""

import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.core.generate import sample as generate
from engine.core.models import folded_adapters, lm_logits, stop_token_ids
from engine.core.ops import logprobs_from_logits
from engine.session.errors import UserError
from engine.session.wire import SampledSequence

Stop = str | list[str] | list[int] | None


@dataclass(frozen=True)
class SamplingParams:
    """The SDK's ``SamplingParams``."""

    max_tokens: int | None = None
    """None: up to the model's context."""
    temperature: float = 1.0
    """0: greedy."""
    top_k: int = -1
    """-1: no limit."""
    top_p: float = 1.0
    stop: Stop = None
    """None: the model's stop tokens (EOS); ``[]``: none at all; strings or token ids."""
    seed: int | None = None


def check_prompt(prompt: Sequence[int], params: SamplingParams, vocab_size: int, max_length: int | None) -> None:
    """A :class:`UserError` naming the field of a request the model cannot sample."""
    if not prompt:
        raise UserError("prompt.chunks: the prompt has no tokens")
    outside = [token for token in prompt if not 0 <= token < vocab_size]
    if outside:
        raise UserError(f"prompt.chunks: token id {outside[0]} is outside the vocabulary (0 to {vocab_size - 1})")
    if params.max_tokens is not None and params.max_tokens < 1:
        raise UserError(f"sampling_params.max_tokens: at least 1, not {params.max_tokens}")
    if max_length is not None and len(prompt) + (params.max_tokens or 1) > max_length:
        raise UserError(f"sampling_params.max_tokens: the prompt's {len(prompt)} tokens and {params.max_tokens or 1} "
                        f"new ones exceed the model's context of {max_length}")  # fmt: skip
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise UserError(f"sampling_params.temperature: 0 or more, not {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise UserError(f"sampling_params.top_p: in (0, 1], not {params.top_p}")
    if params.top_k == 0 or params.top_k < -1:
        raise UserError(f"sampling_params.top_k: -1 (no limit) or at least 1, not {params.top_k}")


def check_work(
    prompt: Sequence[int], params: SamplingParams, num_samples: int, max_length: int | None, max_tokens: int
) -> None:
    """A :class:`UserError` when the request would decode more than ``max_tokens`` tokens in all (``num_samples``
    × its ``max_tokens``, or up to the model's context without one): the server's bound on one request's work."""
    limit = params.max_tokens or max(1, (max_length or len(prompt) + 1) - len(prompt))
    if num_samples * limit > max_tokens:
        given = f"max_tokens {limit}" if params.max_tokens else f"no max_tokens (up to the context: {limit})"
        raise UserError(
            f"sampling_params.max_tokens: {num_samples} samples with {given} is {num_samples * limit} "
            f"tokens; a request may decode at most {max_tokens} (RLHF_SESSION_MAX_SAMPLE_TOKENS): fewer "
            "samples or tokens per request"
        )


@torch.inference_mode()
def sample(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: Sequence[int], num_samples: int,
    params: SamplingParams, prompt_logprobs: bool = False, stop: Callable[[], bool] | None = None,
) -> tuple[list[SampledSequence], list[float] | None]:  # fmt: skip
    """``num_samples`` continuations of ``prompt`` (the prompt prefilled once), and with ``prompt_logprobs`` the
    prompt's own log-probs (NaN at position 0, which nothing predicts). A sequence keeps the token it stopped at;
    log-probs are of the model's full distribution at ``temperature``, as the engine's rollouts take them.
    ``stop``: asked between decoding steps; True ends the request (:class:`engine.core.generate.Interrupted`)."""
    model.eval()
    device = model.device
    ids = torch.tensor([list(prompt)], device=device)
    limit = params.max_tokens or max(1, (_context(model) or len(prompt) + 1) - len(prompt))
    stop_ids, stop_texts = _stops(params.stop, model, tokenizer)
    generator = torch.Generator(device=device).manual_seed(params.seed if params.seed is not None
                                                           else secrets.randbits(63))  # fmt: skip
    with folded_adapters(model):
        raw, logprobs = generate(
            model,
            ids,
            torch.ones_like(ids),
            limit,
            params.temperature,
            top_k=max(params.top_k, 0),
            top_p=params.top_p,
            eos_token_id=stop_ids or None,
            generator=generator,
            group_size=num_samples,
            stop=stop,
        )
        prompt_scores = _prompt_logprobs(model, ids) if prompt_logprobs else None
    sequences = [_cut(raw[i].tolist(), logprobs[i].tolist(), stop_ids, stop_texts, tokenizer, limit)
                 for i in range(num_samples)]  # fmt: skip
    return sequences, prompt_scores


def _context(model: PreTrainedModel) -> int | None:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(model.config, name, None)
        if isinstance(value, int):
            return value
    return None


def _stops(stop: Stop, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[str]]:
    """(stop token ids, stop strings): the model's own stop tokens for None."""
    if stop is None:
        return list(stop_token_ids(model, tokenizer)), []
    if isinstance(stop, str):
        return [], [stop]
    if all(isinstance(item, int) for item in stop):
        return [int(item) for item in stop], []
    return [], [str(item) for item in stop if str(item)]


def _cut(tokens: list[int], logprobs: list[float], stop_ids: list[int], stop_texts: list[str],
         tokenizer: PreTrainedTokenizerBase, limit: int) -> SampledSequence:  # fmt: skip
    """The sequence up to and with its first stop: a stop token, or the token whose text completes a stop string
    (decoded prefix by prefix: a string may span tokens, and the token that completes it is the one it ends in)."""
    for t, token in enumerate(tokens):
        if token in stop_ids or (stop_texts and any(s in tokenizer.decode(tokens[: t + 1]) for s in stop_texts)):
            return SampledSequence(tokens[: t + 1], logprobs[: t + 1], "stop")
    return SampledSequence(tokens[:limit], logprobs[:limit], "length")


def _prompt_logprobs(model: PreTrainedModel, ids: torch.Tensor) -> list[float]:
    """log p(prompt[i] | prompt[:i]) at temperature 1 for every i, NaN at 0."""
    logits = lm_logits(model, ids, torch.ones_like(ids))[:, :-1].float()  # (1, P-1, V)
    scores = logprobs_from_logits(logits, ids[:, 1:])[0].tolist()
    return [math.nan, *scores]
