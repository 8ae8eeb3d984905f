"""Generating from any checkpoint of a job, optionally scored by the job's reward model (the
``rlhf.generate`` task). Loaded models stay in small LRU caches, so repeated requests for the same
checkpoint do not reload it.
"""

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from sqlalchemy.orm import Session
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine import generate as engine_generate
from engine.data import encode_prompts, pad_right
from engine.models import (
    ModelNotFoundError,
    context_length,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    pick_device,
    prepare,
    resolve_model_ref,
)
from engine.rollout import sequence_scores
from jobs.store import crud, refs
from jobs.store.db import session_scope
from jobs.store.settings import Settings

log = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class GenerateError(ValueError):
    """A generate request that cannot be served: unknown job or checkpoint, a job type that does not
    generate, or scores asked of a job without a reward model."""


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
reward_models: LRUCache[tuple[str, int], PreTrainedModel] = LRUCache(2)
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
    settings: Settings,
) -> dict[str, Any]:
    """Complete each prompt once from checkpoint ``step`` (None or ``"latest"``: the newest) of an sft or
    ppo job. Same arguments, same texts (seeded sampling).

    Returns ``{"checkpoint": step, "completions": [{"prompt", "text", "finish_reason"[, "score"]}]}``;
    scores come from a ppo job's reward model. Any request that cannot be served raises GenerateError.
    """
    if step == "latest":
        step = None
    if step is not None and not isinstance(step, int):
        raise GenerateError(f"checkpoint must be a step number or 'latest', not {step!r}")
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise GenerateError("prompts must be a non-empty list of strings")
    with session_scope(settings.resolved_database_url) as session:
        request = _lookup(session, job_id, step, score, settings)
    policies.resize(settings.inference_cache_size)
    reward_models.resize(settings.inference_cache_size)
    try:
        return _generate(request, prompts, max_new_tokens, temperature, top_p, seed)
    except GenerateError:
        raise
    except ValueError as e:  # a model that cannot be loaded; more tokens than the model's context
        raise GenerateError(str(e)) from e


def _generate(
    request: _Request, prompts: list[str], max_new_tokens: int, temperature: float, top_p: float, seed: int
) -> dict[str, Any]:
    device = pick_device()
    policy = policies.get((request.job_id, request.step), lambda: _load_policy(request, device))
    completions = engine_generate.generate(
        policy.model, policy.tokenizer, prompts, max_new_tokens, temperature, top_p=top_p, seed=seed
    )
    out: list[dict[str, Any]] = [
        {"prompt": c.prompt, "text": c.text, "finish_reason": c.finish_reason} for c in completions
    ]
    if request.reward_model is not None:
        ref = request.reward_model
        reward_model = reward_models.get(
            (ref, request.seed), lambda: _load_reward_model(ref, policy.tokenizer, request, device)
        )
        texts = [c.text for c in completions]
        for row, value in zip(out, score_texts(reward_model, policy.tokenizer, prompts, texts), strict=True):
            row["score"] = value
    return {"checkpoint": request.step, "completions": out}


def _lookup(session: Session, job_id: str, step: int | None, score: bool, settings: Settings) -> _Request:
    job = crud.get_job(session, job_id=job_id)
    if job is None:
        raise GenerateError(f"no job {job_id!r}")
    if job.type == "rm":
        raise GenerateError(f"job {job_id} trains a reward model: it scores text but does not generate it")
    checkpoint = crud.get_checkpoint(session, job_id=job_id, step=step)
    if checkpoint is None:
        which = f"at step {step}" if step is not None else "yet"
        raise GenerateError(f"job {job_id} has no checkpoint {which}")
    reward_model = None
    if score:
        if job.type != "ppo" or not job.spec.get("reward_model"):
            raise GenerateError(f"scores need a reward model, and job {job_id} ({job.type}) has none; only ppo jobs do")
        try:
            resolved = refs.resolve_spec(
                session,
                project_id=job.project_id,
                spec=job.spec,
                artifacts=settings.resolved_artifacts_dir,
                model_root=settings.model_root,
            )
            reward_model = resolve_model_ref(resolved["reward_model"])
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


def _load_reward_model(
    ref: str, tokenizer: PreTrainedTokenizerBase, request: _Request, device: torch.device
) -> PreTrainedModel:
    """The reward model as PPO loads it: through the policy's tokenizer and the job's seed."""
    log.info("loading reward model %s", ref)
    model = prepare(load_scalar_model(ref, tokenizer, request.seed), device, request.dtype, False)
    model.eval()
    return model


@torch.inference_mode()
def score_texts(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], completions: list[str]
) -> list[float]:
    """Reward of each prompt + completion + EOS, read at the EOS as in PPO rollouts (left-padded prompts
    followed by right-padded completions). Over-long texts lose the start of the prompt."""
    limit = context_length(model) or 1_000_000
    completion_ids = [
        [*tokenizer(text, add_special_tokens=False)["input_ids"][: limit - 2], tokenizer.eos_token_id]
        for text in completions
    ]
    responses, response_mask = pad_right(completion_ids, tokenizer.pad_token_id)  # (B, T)
    queries, query_mask = encode_prompts(tokenizer, prompts, limit - responses.shape[1])  # (B, P)
    device = next(model.parameters()).device
    input_ids = torch.cat([queries, responses], dim=1).to(device)  # (B, P + T)
    attention_mask = torch.cat([query_mask, response_mask], dim=1).to(device)  # (B, P + T)
    return [float(s) for s in sequence_scores(model, input_ids, attention_mask).tolist()]
