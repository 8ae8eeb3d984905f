"""Generating from any checkpoint of a job, optionally scored by the job's reward model (the
``rlhf.generate`` task). Loaded models stay in small LRU caches, so repeated requests for the same
checkpoint do not reload it.
"""

import logging
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from sqlalchemy.orm import Session
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.core import generate as engine_generate
from engine.core.models import (
    ModelNotFoundError,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    pick_device,
    prepare,
    resolve_model_ref,
    stop_token_ids,
)
from engine.rewards.reward_model import score_texts
from engine.spec.config import JOB_TYPES
from engine.spec.hub import is_hub_id
from engine.spec.rows import Text
from jobs.downloads import cached_snapshot
from jobs.store import crud, refs
from jobs.store.db import session_scope
from jobs.store.settings import Settings

log = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


LATEST_TRIES = 3
"""Lookups of a job's latest checkpoint per request: a training job's retention may remove the one just found."""


class GenerateError(ValueError):
    """A generate request that cannot be served: unknown job or checkpoint, a job type that does not
    generate, or scores asked of a job without a reward model."""


class ChatTemplateMissing(GenerateError):
    """Chat messages sent to a checkpoint whose tokenizer has no chat template. The API recognises it by its
    class name (Celery re-creates a remote exception under the same name) and answers 400."""


MAX_PROMPT_LENGTH = 512
"""Prompt tokens kept (the last ones) when the model's context allows more."""


class LRUCache(Generic[K, V]):
    """At most ``size`` values, the least recently used evicted first; counts hits and misses.

    Loading happens under the lock, so two threads asking for the same key load it once.
    """

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K, load: Callable[[], V]) -> V:
        with self._lock:
            if key in self._items:
                self.hits += 1
                self._items.move_to_end(key)
                return self._items[key]
            self.misses += 1
            value = load()
            self._items[key] = value
            while len(self._items) > self.size:
                evicted, _ = self._items.popitem(last=False)
                log.info("evicted %s from the inference cache", evicted)
            return value

    def resize(self, size: int) -> None:
        with self._lock:
            self.size = max(1, size)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.hits = self.misses = 0

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "size": len(self._items), "capacity": self.size}


@dataclass
class Loaded:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


policies: LRUCache[tuple[str, int], Loaded] = LRUCache(2)
"""Policies by (job id, checkpoint step)."""
reward_models: LRUCache[tuple[str, int], Loaded] = LRUCache(2)
"""Reward models by (model directory or reference, seed)."""


def cache_stats() -> dict[str, dict[str, int]]:
    return {"policies": policies.stats(), "reward_models": reward_models.stats()}


def clear_caches() -> None:
    policies.clear()
    reward_models.clear()


@dataclass
class _Request:
    """What the database says about a generate request."""

    job_id: str
    job_type: str
    step: int
    policy_dir: Path
    seed: int
    dtype: str
    reward_model: str | None


def generate(
    job_id: str,
    step: int | str | None,
    prompts: list[str],
    max_new_tokens: int = 32,
    temperature: float = 0.7,
    top_p: float = 1.0,
    seed: int = 0,
    score: bool = False,
    *,
    n: int = 1,
    stop: list[str] | None = None,
    messages: list[dict[str, str]] | None = None,
    settings: Settings,
) -> dict[str, Any]:
    """Complete each prompt ``n`` times from checkpoint ``step`` (None or ``"latest"``: the newest) of a job that
    trains a policy. Same arguments, same texts (seeded sampling; the ``n`` samples of a prompt are distinct draws).

    A completion ends at the checkpoint's stop tokens (its generation config's ``eos_token_id``, e.g. Llama 3's
    ``<|eot_id|>``, and its tokenizer's EOS: where transformers' ``generate`` ends), finish reason ``stop``, the
    token not in the text. ``stop``: up to 4 strings; a text is cut before the first one it contains (finish reason
    ``stop``); a stop string may name special tokens (:func:`complete`).
    ``messages``: one chat conversation (``[{"role", "content"}]``) formatted by the checkpoint's chat template
    (with the generation prompt) and completed in place of ``prompts`` (which must then be empty); a tokenizer
    without a template raises ChatTemplateMissing.

    Returns ``{"checkpoint": step, "completions": [{"prompt", "text", "finish_reason"[, "score"]}], "usage":
    {"prompt_tokens", "completion_tokens"}}``: completions prompt by prompt, ``n`` each; ``usage`` counts each
    prompt's tokens once (as sampled from: truncated to fit the context) and every sampled token up to the end
    of its text (its stop token, or the token completing a stop string). Scores come from the reward model the
    job trained against (its ``reward_model``). Any request that cannot be served raises GenerateError.
    """
    if step == "latest":
        step = None
    if step is not None and not isinstance(step, int):
        raise GenerateError(f"checkpoint must be a step number or 'latest', not {step!r}")
    if messages is not None:
        if prompts or not _is_conversation(messages):
            raise GenerateError("messages must be a non-empty list of {role, content} strings, with no prompts")
    elif not prompts or not all(isinstance(p, str) for p in prompts):
        raise GenerateError("prompts must be a non-empty list of strings")
    if not isinstance(n, int) or n < 1:
        raise GenerateError(f"n must be a positive integer, not {n!r}")
    stop = list(stop or [])
    if not all(isinstance(s, str) and s for s in stop):
        raise GenerateError("stop must be a list of non-empty strings")
    policies.resize(settings.inference_cache_size)
    reward_models.resize(settings.inference_cache_size)
    for attempt in range(1, LATEST_TRIES + 1):
        with session_scope(settings.resolved_database_url) as session:
            request = _lookup(session, job_id, step, score, settings)
        try:
            return _generate(request, prompts, max_new_tokens, temperature, top_p, seed, n, stop, messages)
        except GenerateError:
            raise
        except ValueError as e:  # a model that cannot be loaded; more tokens than the model's context
            if step is None and not request.policy_dir.exists() and attempt < LATEST_TRIES:
                # "latest" lost to checkpoint retention between the lookup and the load: a newer one replaced it
                log.info("job %s: checkpoint %d was removed while loading; asking for the latest again",
                         job_id, request.step)  # fmt: skip
                continue
            raise GenerateError(str(e)) from e
    raise AssertionError("unreachable")


def _is_conversation(messages: Any) -> bool:
    return (
        isinstance(messages, list)
        and len(messages) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def _generate(
    request: _Request,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    n: int = 1,
    stop: list[str] | None = None,
    messages: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    device = pick_device()
    policy = policies.get((request.job_id, request.step), lambda: _load_policy(request, device))
    batch: list[Text] = list(prompts)
    if messages is not None:  # sampled after the messages as training encodes a chat prompt
        rendered = chat_prompt(policy.tokenizer, messages, request.job_id, request.step)
        batch = [messages]
    out, usage = complete(policy.model, policy.tokenizer, batch, max_new_tokens, temperature, top_p, seed, n, stop)
    if request.reward_model is not None:
        ref = request.reward_model
        reward_model = reward_models.get((ref, request.seed), lambda: _load_reward_model(ref, request, device))
        texts = [row["text"] for row in out]
        stopped = [row["finish_reason"] == "stop" for row in out]
        rows_prompts = [prompt for prompt in batch for _ in range(n)]
        scores = score_texts(
            reward_model.model, reward_model.tokenizer, rows_prompts, texts, stopped, policy.tokenizer
        ).tolist()
        for row, value in zip(out, scores, strict=True):
            row["score"] = float(value)
    if messages is not None:
        for row in out:
            row["prompt"] = rendered
    return {"checkpoint": request.step, "completions": out, "usage": usage}


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], job_id: str, step: int) -> str:
    """The conversation as the tokenizer's chat template writes it, ending with the assistant's turn (what the
    policy is sampled after); a template that cannot render the messages is a GenerateError."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateMissing(
            f"model job:{job_id}@{step} has no chat template (its tokenizer defines none), so it cannot take chat "
            "messages; send a plain prompt to /v1/completions instead"
        )
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # a template that raises (e.g. on a role it does not know)
        raise GenerateError(f"the chat template of job:{job_id}@{step} failed on these messages: {e}") from e
    if not isinstance(text, str):
        raise GenerateError(f"the chat template of job:{job_id}@{step} did not produce text")
    return text


def complete(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Text],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    n: int = 1,
    stop: list[str] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """``n`` seeded samples per prompt (:func:`engine.core.generate.generate`), each ending at the model's stop tokens
    (:func:`engine.core.models.stop_token_ids`) and cut at ``stop`` strings, with token counts.

    A stop string that is one special token of the tokenizer (``"<|eot_id|>"``) ends sampling at that token, as
    the model's own stop tokens do; one that holds a special token among other text is looked for in the text
    with special tokens kept; the others in the text as returned (special tokens dropped)."""
    stop = stop or []
    specials = special_tokens(tokenizer)
    ends = [*stop_token_ids(model, tokenizer), *(specials[s] for s in stop if s in specials)]
    strings = [s for s in stop if s not in specials]
    completions = engine_generate.generate(
        model, tokenizer, prompts, max_new_tokens, temperature, top_p, seed, MAX_PROMPT_LENGTH, n, ends
    )
    rows: list[dict[str, Any]] = []
    completion_tokens = 0
    for c in completions:
        text, finish_reason, length = c.text, c.finish_reason, len(c.tokens)
        cut = _cut_at_stop(tokenizer, c.tokens, text, strings, list(specials))
        if cut is not None:
            (text, length), finish_reason = cut, "stop"
        completion_tokens += length
        rows.append({"prompt": c.prompt, "text": text, "finish_reason": finish_reason})
    prompt_tokens = sum(c.prompt_tokens for c in completions[::n])
    return rows, {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}


def special_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """The tokenizer's special tokens by their text: those a decode with ``skip_special_tokens`` drops."""
    found = {str(token): i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    found.update(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=True))
    return found


def _cut_at_stop(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], text: str, stop: list[str], specials: list[str]
) -> tuple[str, int] | None:
    """The text before the first stop string the response ``ids`` (decoded: ``text``) produce, and the fewest
    leading tokens that produce it; None without one. A stop string holding a special token is looked for in the
    text with special tokens kept (the text returned drops them), the others in ``text``."""
    marked = [s for s in stop if any(special in s for special in specials)]
    plain = [s for s in stop if s not in marked]
    found: list[tuple[int, str]] = []
    if (cut := _first_stop(text, plain)) is not None:
        found.append((_tokens_to_stop(tokenizer, ids, plain), text[:cut]))
    kept = str(tokenizer.decode(ids, skip_special_tokens=False)) if marked else ""
    if (cut := _first_stop(kept, marked)) is not None:
        head = kept[:cut]
        for special in sorted(specials, key=len, reverse=True):
            head = head.replace(special, "")
        found.append((_tokens_to_stop(tokenizer, ids, marked, skip_special_tokens=False), head))
    if not found:
        return None
    length, head = min(found, key=lambda f: f[0])
    return head, length


def _first_stop(text: str, stop: list[str]) -> int | None:
    """Where the first stop string found in ``text`` begins, or None."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


class _Prefixes:
    """Whether the text of the first ``k`` tokens contains a stop string, as a sequence over k (monotone)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: list[str], skip_special_tokens: bool
    ) -> None:
        self.tokenizer, self.ids, self.stop, self.skip_special_tokens = tokenizer, ids, stop, skip_special_tokens

    def __len__(self) -> int:
        return len(self.ids) + 1

    def __getitem__(self, k: int) -> bool:
        text = str(self.tokenizer.decode(self.ids[:k], skip_special_tokens=self.skip_special_tokens))
        return _first_stop(text, self.stop) is not None


def _tokens_to_stop(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: list[str], skip_special_tokens: bool = True
) -> int:
    """The fewest leading tokens whose text (special tokens dropped unless kept by ``skip_special_tokens``)
    contains a stop string (binary search: a few decodes)."""
    k = bisect_left(_Prefixes(tokenizer, ids, stop, skip_special_tokens), True)
    return min(k, len(ids))


def _lookup(session: Session, job_id: str, step: int | None, score: bool, settings: Settings) -> _Request:
    job = crud.get_job(session, job_id=job_id)
    if job is None:
        raise GenerateError(f"no job {job_id!r}")
    if not refs.generates(job.type):
        raise GenerateError(f"job {job_id} trains a reward model: it scores text but does not generate it")
    checkpoint = crud.get_checkpoint(session, job_id=job_id, step=step)
    if checkpoint is None:
        which = f"at step {step}" if step is not None else "yet"
        raise GenerateError(f"job {job_id} has no checkpoint {which}")
    reward_model = None
    if score:
        if not job.spec.get("reward_model") or not JOB_TYPES[job.type].reward_model:
            raise GenerateError(f"scores need a reward model, and job {job_id} ({job.type}) has none")
        try:
            reward_model = resolve_model_ref(refs.resolve_stored(session, job, settings)["reward_model"])
            if is_hub_id(reward_model):  # the copy the job trained with: loading it asks no hub
                reward_model = cached_snapshot(reward_model) or reward_model
        except (refs.SpecReferenceError, ModelNotFoundError) as e:
            raise GenerateError(f"the reward model of job {job_id} is not available: {e}") from e
    return _Request(
        job_id=job_id,
        job_type=job.type,
        step=checkpoint.step,
        policy_dir=settings.resolved_artifacts_dir / checkpoint.path / "policy",
        seed=int(job.spec.get("seed", 0)),
        dtype=str(job.spec.get("hyperparameters", {}).get("dtype", "float32")),
        reward_model=reward_model,
    )


def _load_policy(request: _Request, device: torch.device) -> Loaded:
    log.info("loading policy %s", request.policy_dir)
    tokenizer = load_tokenizer(str(request.policy_dir))
    model = prepare(load_causal_lm(str(request.policy_dir), tokenizer, request.seed), device, request.dtype, False)
    model.eval()
    return Loaded(model, tokenizer)


def _load_reward_model(ref: str, request: _Request, device: torch.device) -> Loaded:
    """The reward model with its own tokenizer (texts are scored as PPO scores them, :func:`score_texts`)."""
    log.info("loading reward model %s", ref)
    tokenizer = load_tokenizer(ref)
    model = prepare(load_scalar_model(ref, tokenizer, request.seed, trained_head=True), device, request.dtype, False)
    model.eval()
    return Loaded(model, tokenizer)
