"""The built-in pipeline on the reviews task: SFT → reward model → PPO, or SFT → another method (``--method
dpo``), then a before/after table.

Judged on held-out prompts by the task's ground-truth rule (never used in training): the share of positive
completions from the SFT model and from the trained policy, their reward-model scores (when a reward model was
trained), and the policy's KL to the SFT reference on its own samples.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engine.builtin import reviews
from engine.config import JOB_TYPES, JobSpec
from engine.data import encode_prompts, load_rows
from engine.generate import sample
from engine.models import load_causal_lm, load_scalar_model, load_tokenizer, resolve_model_ref
from engine.ops import truncate_after_stop
from engine.reward import sequence_scores
from engine.rm import encode_pairs, evaluate_pairs
from engine.rollout import response_logprobs

SEED = 0
TEMPERATURE = 1.0
EVAL_PROMPTS = 256


def demo_specs(out: Path, method: str = "ppo") -> dict[str, dict[str, Any]]:
    """The job specs of the pipeline, each type's stage as its :data:`JOB_TYPES` entry gives it: SFT, a reward
    model when ``method`` needs one, then ``method``; each later stage starts from the SFT folder."""
    stages = ["sft", *(["rm"] if JOB_TYPES[method].reward_model else []), method]
    specs = {}
    for stage in stages:
        spec = {"type": stage, "name": f"demo-{stage}", "seed": SEED, **JOB_TYPES[stage].demo}
        spec["model"] = "builtin:tiny" if stage == "sft" else str(out / "sft")
        if JOB_TYPES[stage].reward_model:
            spec["reward_model"] = str(out / "rm")
        specs[stage] = spec
    return specs


@dataclass
class PolicyReport:
    positive_share: float
    """Share of samples the ground-truth rule judges positive."""
    score: float | None
    """Mean reward-model score (None when the pipeline trained no reward model)."""
    kl: float
    """Mean summed per-token log-ratio to the SFT reference on the policy's own samples."""
    length: float
    """Mean response length in tokens."""


@torch.inference_mode()
def evaluate_policy(policy_dir: str, reference_dir: str, reward_dir: str | None, prompts: list[str]) -> PolicyReport:
    tokenizer = load_tokenizer(policy_dir)
    policy = load_causal_lm(policy_dir, tokenizer, SEED).eval()
    reference = load_causal_lm(reference_dir, tokenizer, SEED).eval()
    queries, query_mask = encode_prompts(tokenizer, prompts, 64)
    generator = torch.Generator().manual_seed(SEED)
    raw, _ = sample(
        policy, queries, query_mask, 24, TEMPERATURE, eos_token_id=tokenizer.eos_token_id, generator=generator
    )
    responses, mask, _ = truncate_after_stop(raw, tokenizer.eos_token_id, tokenizer.pad_token_id)
    query_responses = torch.cat([queries, responses], 1)
    attention_mask = torch.cat([query_mask, mask], 1)
    P = queries.shape[1]
    logprobs, _ = response_logprobs(policy, query_responses, attention_mask, P, TEMPERATURE)
    ref_logprobs, _ = response_logprobs(reference, query_responses, attention_mask, P, TEMPERATURE)
    texts = tokenizer.batch_decode(responses.masked_fill(mask == 0, tokenizer.pad_token_id), skip_special_tokens=True)
    return PolicyReport(
        positive_share=sum(map(reviews.is_positive, texts)) / len(texts),
        score=_score(reward_dir, tokenizer, query_responses, attention_mask),
        kl=((logprobs - ref_logprobs) * mask).sum(1).mean().item(),
        length=mask.sum(1).float().mean().item(),
    )


def _score(
    reward_dir: str | None, tokenizer: PreTrainedTokenizerBase, query_responses: torch.Tensor, mask: torch.Tensor
) -> float | None:
    if reward_dir is None:
        return None
    reward_model = load_scalar_model(reward_dir, tokenizer, SEED).eval()
    return sequence_scores(reward_model, query_responses, mask).mean().item()


def rm_accuracy(reward_dir: str) -> float:
    tokenizer = load_tokenizer(reward_dir)
    model = load_scalar_model(reward_dir, tokenizer, SEED)
    rows = load_rows("builtin:reviews-prefs-eval", "preference")
    batches = [encode_pairs(tokenizer, rows[i : i + 64], 128) for i in range(0, len(rows), 64)]
    return evaluate_pairs(model, batches)[0]


@dataclass
class DemoReport:
    method: str
    """The job type trained after SFT."""
    prompts: int
    """Held-out prompts sampled once by each policy."""
    rm_eval_accuracy: float | None
    """Reward model's accuracy on the held-out preference pairs (None: the method trained none)."""
    sft: PolicyReport
    trained: PolicyReport
    """The policy ``method`` trained."""

    def table(self) -> str:
        accuracy = "" if self.rm_eval_accuracy is None else f"; reward model eval accuracy {self.rm_eval_accuracy:.3f}"
        lines = [
            f"Held-out evaluation: {self.prompts} prompts, temperature {TEMPERATURE}{accuracy}",
            f"{'':<24}{'SFT':>10}{self.method.upper():>10}",
        ]
        for label, field in (
            ("positive share (truth)", "positive_share"),
            ("reward model score", "score"),
            ("KL to SFT reference", "kl"),
            ("response length", "length"),
        ):
            sft, trained = getattr(self.sft, field), getattr(self.trained, field)
            if sft is not None:
                lines.append(f"{label:<24}{sft:>10.3f}{trained:>10.3f}")
        return "\n".join(lines)


def run_demo(out: Path, train: Callable[[JobSpec, Path, str], None], method: str = "ppo") -> DemoReport:
    """Train the stages with ``train(spec, folder, label)``, then compare the SFT policy with ``method``'s."""
    for stage, data in demo_specs(out, method).items():
        train(JobSpec.model_validate(data), out / stage, stage)
    sft_dir, trained_dir = resolve_model_ref(str(out / "sft")), resolve_model_ref(str(out / method))
    rm_dir = resolve_model_ref(str(out / "rm")) if JOB_TYPES[method].reward_model else None
    prompts = [r["prompt"] for r in load_rows("builtin:reviews-prompts-eval", "prompts")[:EVAL_PROMPTS]]
    return DemoReport(
        method=method,
        prompts=len(prompts),
        rm_eval_accuracy=rm_accuracy(rm_dir) if rm_dir else None,
        sft=evaluate_policy(sft_dir, sft_dir, rm_dir, prompts),
        trained=evaluate_policy(trained_dir, sft_dir, rm_dir, prompts),
    )
