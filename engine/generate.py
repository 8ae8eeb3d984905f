"""Sampling with a KV cache, for PPO rollouts and for generating from any checkpoint."""

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StaticCache

from engine.data import encode_prompts
from engine.models import check_fits, context_length
from engine.models import stop_token_ids as model_stop_ids
from engine.ops import is_stop, logprobs_from_logits, position_ids_from_mask, stop_ids, truncate_after_stop
from engine.rows import Text


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row from (B, V) logits; temperature 0 is greedy. Returns (B,)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p
        drop_sorted[:, 0] = False  # the top token stays, however small top_p (one below float32's range is 0)
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = logits.softmax(-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


logger = logging.getLogger(__name__)
_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, Callable[..., Any]]" = weakref.WeakKeyDictionary()


def compiled_decoder(model: PreTrainedModel) -> Callable[..., Any]:
    """``model``'s forward compiled for decoding with a static cache (``mode="reduce-overhead"``: on CUDA, the
    step is captured as a CUDA graph and replayed), once per model and reused across rollouts and updates.
    Its inputs keep their shapes from step to step, so one graph serves every step of a shape."""
    if model not in _COMPILED:
        _COMPILED[model] = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)
    return _COMPILED[model]


def _repeat_static(cache: StaticCache, repeats: int) -> None:
    """Each row of a prefilled static cache ``repeats`` times in a row (what ``batch_repeat_interleave`` does for a
    growing cache), into new static tensors marked as such for CUDA graphs."""
    layers: list[Any] = list(cache.layers)  # StaticLayer: keys and values (B, heads, positions, head dim)
    for layer in layers:
        layer.keys = layer.keys.repeat_interleave(repeats, dim=0)
        layer.values = layer.values.repeat_interleave(repeats, dim=0)
        layer.batch_size *= repeats
        torch._dynamo.mark_static_address(layer.keys)
        torch._dynamo.mark_static_address(layer.values)


@torch.inference_mode()
def sample(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    group_size: int = 1,
    static_cache: bool = False,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``max_new_tokens`` after left-padded prompts (B, P), reusing the KV cache; with
    ``group_size`` G, G samples of each prompt (rows ``i*G .. i*G + G - 1`` are prompt i's), the prompt
    prefilled once and its cache repeated for its group.

    Stops early once every row has produced a stop token, any of ``eos_token_id`` (one id or several, as
    transformers' ``generate`` takes it). Returns the raw tokens (B·G, T), T ≤ max_new_tokens, and their
    log-probabilities (B·G, T) under the model's full distribution at ``temperature`` (before top-k/top-p
    filtering: the quantity PPO's ratio is taken of), so a PPO rollout needs no second policy forward. Tokens
    after a row's stop token are junk for the caller to truncate (:func:`engine.ops.truncate_after_stop`).

    ``static_cache``: the KV cache is preallocated for P + max_new_tokens positions and every decoding step has
    the same shapes (the attention mask spans them all, 0 ahead), the same tokens as the growing cache and
    log-probs equal up to rounding; ``compiled`` (with it) runs each step through :func:`compiled_decoder`.
    """
    B, P = input_ids.shape
    position_ids = position_ids_from_mask(attention_mask)  # (B, P)
    if static_cache:
        cache: Any = StaticCache(config=model.config, max_cache_len=P + max_new_tokens)
        attention_mask = torch.cat([attention_mask, attention_mask.new_zeros(B, max_new_tokens)], dim=1)
        prefill = torch.arange(P, device=input_ids.device)
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                    use_cache=True, cache_position=prefill, logits_to_keep=1)  # fmt: skip
    else:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                    logits_to_keep=1)  # fmt: skip
        cache = out.cache
    first_logits = out.logits[:, -1]  # (B, V)
    if group_size > 1:
        if static_cache:
            _repeat_static(cache, group_size)
        else:
            cache.batch_repeat_interleave(group_size)  # in place: (B·G, ...) from here on
        first_logits = first_logits.repeat_interleave(group_size, dim=0)
        attention_mask = attention_mask.repeat_interleave(group_size, dim=0)
        position_ids = position_ids.repeat_interleave(group_size, dim=0)
    decode = compiled_decoder(model) if static_cache and compiled else model
    next_positions = position_ids[:, -1:] + 1  # (B·G, 1)
    finished = torch.zeros(attention_mask.shape[0], dtype=torch.bool, device=input_ids.device)
    stops = torch.tensor(stop_ids(eos_token_id), dtype=input_ids.dtype, device=input_ids.device)  # (S,)
    tokens, logprobs = [], []
    for t in range(max_new_tokens):
        logits = first_logits if t == 0 else out.logits[:, -1]  # (B·G, V)
        token = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
        tokens.append(token)
        logprobs.append(logprobs_from_logits(logits.float() / max(temperature, 1e-7), token))
        if len(stops):
            finished |= torch.isin(token, stops)
            if finished.all():
                break
        if t == max_new_tokens - 1:
            break
        if static_cache:
            attention_mask[:, P + t] = 1
            position = torch.full((1,), P + t, dtype=torch.long, device=input_ids.device)
            step = {"input_ids": token.unsqueeze(1), "attention_mask": attention_mask, "position_ids": next_positions,
                    "cache": cache, "use_cache": True, "cache_position": position}  # fmt: skip
            try:
                out = decode(**step)
            except Exception:
                if decode is model:
                    raise
                # the step could not be compiled here (no compiler for this device, say): eager from now on
                logger.warning("the decoding step could not be compiled; sampling continues eagerly", exc_info=True)
                _COMPILED[model] = decode = model
                out = decode(**step)
        else:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
            out = model(input_ids=token.unsqueeze(1), attention_mask=attention_mask, position_ids=next_positions,
                        cache=cache, use_cache=True)  # fmt: skip
        next_positions = next_positions + 1
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)  # (B, T), (B, T)


@dataclass
class Completion:
    prompt: Text
    text: str
    finish_reason: str
    """``stop`` when the model produced a stop token, ``length`` when it ran out of tokens."""
    tokens: list[int] = field(default_factory=list)
    """The response's token ids, up to and including its stop token."""
    prompt_tokens: int = 0
    """Tokens of the prompt the model was given (after truncation)."""


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Text],
    max_new_tokens: int = 32,
    temperature: float = 0.7,
    top_p: float = 1.0,
    seed: int = 0,
    max_prompt_length: int = 512,
    n: int = 1,
    stop_token_ids: Sequence[int] | None = None,
) -> list[Completion]:
    """Complete each prompt ``n`` times (one batch, each prompt repeated ``n`` times in a row); seeded, so the
    same call returns the same texts. A prompt is text (after the tokenizer's BOS, where it adds one) or chat
    messages (rendered by the chat template with the generation prompt): encoded as training encodes prompts.

    A completion ends at the first of ``stop_token_ids`` (None: the model's, :func:`engine.models.stop_token_ids`,
    where transformers' ``generate`` ends), its text without it. Prompts longer than the model's context allows
    (after room for ``max_new_tokens``) keep their end.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    check_fits(model, max_new_tokens + 1, "max_new_tokens + a one-token prompt")
    limit = context_length(model)
    if limit is not None:
        max_prompt_length = min(max_prompt_length, limit - max_new_tokens)
    device = next(model.parameters()).device
    model.eval()
    batch = [prompt for prompt in prompts for _ in range(n)]
    input_ids, attention_mask = encode_prompts(tokenizer, batch, max_prompt_length)  # (B, P)
    generator = torch.Generator(device).manual_seed(seed)
    stops = model_stop_ids(model, tokenizer) if stop_token_ids is None else tuple(stop_token_ids)
    raw, _ = sample(
        model,
        input_ids.to(device),
        attention_mask.to(device),
        max_new_tokens,
        temperature,
        top_p=top_p,
        eos_token_id=stops,
        generator=generator,
    )
    responses, mask, stopped = truncate_after_stop(raw, stops, tokenizer.pad_token_id)
    texts = response_texts(tokenizer, responses, mask, stops)
    lengths, prompt_lengths = mask.sum(1).tolist(), attention_mask.sum(1).tolist()
    return [
        Completion(prompt, text, "stop" if done else "length", responses[i, : lengths[i]].tolist(), prompt_lengths[i])
        for i, (prompt, text, done) in enumerate(zip(batch, texts, stopped.tolist(), strict=True))
    ]


def response_texts(
    tokenizer: PreTrainedTokenizerBase, responses: torch.Tensor, mask: torch.Tensor, stop_token_ids: Sequence[int]
) -> list[str]:
    """The text of each response (B, T) up to its stop token, without it, special tokens dropped: what a grader
    or a client reads. ``mask`` (B, T): 1 on kept tokens, those of :func:`engine.ops.truncate_after_stop`."""
    text_mask = mask.bool() & ~is_stop(responses, stop_token_ids)  # (B, T): the stop token is the last kept one
    return tokenizer.batch_decode(responses.masked_fill(~text_mask, tokenizer.pad_token_id), skip_special_tokens=True)
