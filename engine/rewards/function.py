"""A job's reward as a function of its samples: the graders of engine/rewards/graders.py, with the reward models that
``model`` graders name loaded once (frozen) and scoring the decoded text with their own tokenizers."""

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.callbacks import Callbacks
from engine.core.data import render
from engine.core.distributed import Ranks
from engine.core.learner import Tokens
from engine.core.models import frozen, load_scalar_model, load_tokenizer, prepare
from engine.core.rollout import Scorer, decode_responses
from engine.rewards.graders import (
    Grader,
    ModelGrader,
    RewardScores,
    Samples,
    iter_graders,
    reward_metrics,
    score,
)
from engine.rewards.reward_model import score_texts


class RewardFunction:
    """``reward(samples, stopped)`` → the grader's :class:`RewardScores` of ``samples`` (``stopped``: whether
    each completion ended with EOS, which a reward model sees as its training pairs did). ``callbacks``: the job's,
    asked whether to stop while an http grader or a judge is waited for (RewardStopped when they answer), and for
    the judges of model graders."""

    def __init__(
        self,
        grader: Grader,
        policy_tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        dtype: str,
        callbacks: Callbacks | None = None,
    ) -> None:
        self.grader = grader
        self.policy_tokenizer = policy_tokenizer
        self.callbacks = callbacks or Callbacks()
        self.warned: set[str] = set()
        """The graders whose first sample error was reported (a warning event, once per grader)."""
        self.models: dict[str, tuple[PreTrainedModel, PreTrainedTokenizerBase]] = {}
        for _, leaf in iter_graders(grader):
            if isinstance(leaf, ModelGrader) and leaf.model not in self.models:
                tokenizer = load_tokenizer(leaf.model)
                model = frozen(prepare(load_scalar_model(leaf.model, tokenizer, 0), device, dtype, False))
                self.models[leaf.model] = (model, tokenizer)

    @classmethod
    def of(
        cls,
        grader: Grader | None,
        policy_tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        dtype: str,
        callbacks: Callbacks | None = None,
    ) -> "RewardFunction | None":
        """The reward of an optional grader (e.g. a spec's ``eval_reward``): None without one."""
        return None if grader is None else cls(grader, policy_tokenizer, device, dtype, callbacks)

    def __call__(self, samples: Samples, stopped: Sequence[bool]) -> RewardScores:
        def model_scores(grader: ModelGrader, batch: Samples) -> list[float]:
            model, tokenizer = self.models[grader.model]
            scores = score_texts(model, tokenizer, batch.prompts, batch.completions, list(stopped),
                                 self.policy_tokenizer)  # fmt: skip
            return [float(s) for s in scores.float().tolist()]

        scored = score(self.grader, samples, model_scores, self.callbacks.should_stop, self.callbacks.judge)
        for name, error in scored.errors.items():
            if name not in self.warned:  # it scored 0 there, counted in reward/<name>/invalid or /errors
                self.warned.add(name)
                message = f"grader {name!r} scored 0 where it could not grade a sample (further ones are only counted)"
                self.callbacks.on_event("warning", f"{message}: {error}", {"grader": name})
        return scored


def samples_of(tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict[str, Any]], completions: list[str]) -> Samples:
    """Completions of the dataset ``rows`` (one each) as graders take them, the prompt texts rendered as the policy
    saw them (the chat template applied)."""
    prompts = [row["prompt"] for row in rows]
    seen = [p if isinstance(p, str) else render(tokenizer, p, add_generation_prompt=True) for p in prompts]
    return Samples(prompts=prompts, prompt_texts=seen, completions=completions, rows=list(rows))


def grader_scorer(
    reward: RewardFunction,
    tokenizer: PreTrainedTokenizerBase,
    stop_token_ids: Sequence[int],
) -> Scorer:
    """The scorer of a reward of graders: the decoded responses scored by ``reward``, with each component's
    scores."""

    def score(rows: Sequence[dict[str, Any]], tokens: Tokens) -> tuple[torch.Tensor, RewardScores]:
        texts, stopped = decode_responses(tokenizer, tokens, stop_token_ids)
        scored = reward(samples_of(tokenizer, rows, texts), stopped)
        return torch.tensor(scored.total, dtype=torch.float32, device=tokens.query_responses.device), scored

    return score


def gathered(scored: RewardScores, ranks: Ranks, device: torch.device) -> RewardScores:
    """Every rank's scores of one batch, in rank order (each rank holding its share's)."""
    if ranks.world_size == 1:
        return scored
    table = ranks.gather(torch.tensor([scored.total, *scored.components.values()], device=device).T)  # (N, 1 + C)
    columns = table.T.tolist()
    return RewardScores(columns[0], dict(zip(scored.components, columns[1:], strict=True)))


def eval_metrics(scored: RewardScores) -> dict[str, float]:
    """``eval/reward`` (the mean reward of the held-out samples) and ``eval/reward/<name>`` per component."""
    if not scored.total:
        return {}
    metrics = reward_metrics(scored, prefix="eval/reward")
    del metrics["eval/reward/std"]
    metrics["eval/reward"] = metrics.pop("eval/reward/mean")
    return metrics
