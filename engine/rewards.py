"""A job's reward as a function of its samples: the graders of engine/graders.py, with the reward models that
``model`` graders name loaded once (frozen) and scoring the decoded text with their own tokenizers."""

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.graders import Grader, ModelGrader, RewardScores, Samples, iter_graders, score
from engine.models import load_scalar_model, load_tokenizer, prepare
from engine.reward import score_texts


class RewardFunction:
    """``reward(samples, stopped)`` → the grader's :class:`RewardScores` of ``samples`` (``stopped``: whether
    each completion ended with EOS, which a reward model sees as its training pairs did)."""

    def __init__(
        self, grader: Grader, policy_tokenizer: PreTrainedTokenizerBase, device: torch.device, dtype: str
    ) -> None:
        self.grader = grader
        self.policy_tokenizer = policy_tokenizer
        self.models: dict[str, tuple[PreTrainedModel, PreTrainedTokenizerBase]] = {}
        for _, leaf in iter_graders(grader):
            if isinstance(leaf, ModelGrader) and leaf.model not in self.models:
                tokenizer = load_tokenizer(leaf.model)
                model = prepare(load_scalar_model(leaf.model, tokenizer, 0), device, dtype, False)
                model.eval()
                model.requires_grad_(False)
                self.models[leaf.model] = (model, tokenizer)

    def __call__(self, samples: Samples, stopped: Sequence[bool]) -> RewardScores:
        def model_scores(grader: ModelGrader, batch: Samples) -> list[float]:
            model, tokenizer = self.models[grader.model]
            scores = score_texts(model, tokenizer, batch.prompts, batch.completions, list(stopped),
                                 self.policy_tokenizer)  # fmt: skip
            return [float(s) for s in scores.float().tolist()]

        return score(self.grader, samples, model_scores)
