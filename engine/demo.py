"""The built-in pipeline: SFT → reward model → PPO on the reviews task, then a before/after table.

Judged on held-out prompts by the task's ground-truth rule (never used in training): the share of
positive completions from the SFT model and from the PPO policy, their reward-model scores, and the
policy's KL to the SFT reference on its own samples.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.builtin import reviews
from engine.config import JobSpec
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


def demo_specs(out: Path) -> dict[str, dict[str, Any]]:
    """The three job specs; each later stage names the earlier stage's folder as its model."""
    return {
        "sft": {
            "type": "sft",
            "name": "demo-sft",
            "model": "builtin:tiny",
            "dataset": "builtin:reviews-sft",
            "eval_dataset": "builtin:reviews-sft-eval",
            "hyperparameters": {
                "epochs": 2,
                "batch_size": 32,
                "learning_rate": 3e-3,
                "warmup_steps": 10,
                "eval_every": 50,
            },
            "seed": SEED,
            "checkpoint_every": 1000,
        },
        "rm": {
            "type": "rm",
            "name": "demo-rm",
            "model": str(out / "sft"),
            "dataset": "builtin:reviews-prefs",
            "eval_dataset": "builtin:reviews-prefs-eval",
            "hyperparameters": {"epochs": 1, "batch_size": 32, "learning_rate": 1e-3, "eval_every": 25},
            "seed": SEED,
            "checkpoint_every": 1000,
        },
        "ppo": {
            "type": "ppo",
            "name": "demo-ppo",
            "model": str(out / "sft"),
            "reward_model": str(out / "rm"),
            "dataset": "builtin:reviews-prompts",
            "hyperparameters": {
                "total_steps": 40,
                "batch_size": 64,
                "mini_batch_size": 32,
                "ppo_epochs": 2,
                "learning_rate": 3e-5,
                "temperature": TEMPERATURE,
                "response_length": 24,
                "kl_coef": 0.05,
            },
            "seed": SEED,
            "checkpoint_every": 10,
        },
    }


@dataclass
class PolicyReport:
    positive_share: float
    """Share of samples the ground-truth rule judges positive."""
    score: float
    """Mean reward-model score."""
    kl: float
    """Mean summed per-token log-ratio to the SFT reference on the policy's own samples."""
    length: float
    """Mean response length in tokens."""


@torch.inference_mode()
def evaluate_policy(policy_dir: str, reference_dir: str, reward_dir: str, prompts: list[str]) -> PolicyReport:
    tokenizer = load_tokenizer(policy_dir)
    policy = load_causal_lm(policy_dir, tokenizer, SEED).eval()
    reference = load_causal_lm(reference_dir, tokenizer, SEED).eval()
    reward_model = load_scalar_model(reward_dir, tokenizer, SEED).eval()
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
        score=sequence_scores(reward_model, query_responses, attention_mask).mean().item(),
        kl=((logprobs - ref_logprobs) * mask).sum(1).mean().item(),
        length=mask.sum(1).float().mean().item(),
    )


def rm_accuracy(reward_dir: str) -> float:
    tokenizer = load_tokenizer(reward_dir)
    model = load_scalar_model(reward_dir, tokenizer, SEED)
    rows = load_rows("builtin:reviews-prefs-eval", "rm")
    batches = [encode_pairs(tokenizer, rows[i : i + 64], 128) for i in range(0, len(rows), 64)]
    return evaluate_pairs(model, batches)[0]


@dataclass
class DemoReport:
    prompts: int
    """Held-out prompts sampled once by each policy."""
    rm_eval_accuracy: float
    """Reward model's accuracy on the held-out preference pairs."""
    sft: PolicyReport
    ppo: PolicyReport

    def table(self) -> str:
        lines = [
            f"Held-out evaluation: {self.prompts} prompts, temperature {TEMPERATURE}; "
            f"reward model eval accuracy {self.rm_eval_accuracy:.3f}",
            f"{'':<24}{'SFT':>10}{'PPO':>10}",
        ]
        for label, field in (
            ("positive share (truth)", "positive_share"),
            ("reward model score", "score"),
            ("KL to SFT reference", "kl"),
            ("response length", "length"),
        ):
            lines.append(f"{label:<24}{getattr(self.sft, field):>10.3f}{getattr(self.ppo, field):>10.3f}")
        return "\n".join(lines)


def run_demo(out: Path, train: Callable[[JobSpec, Path, str], None]) -> DemoReport:
    """Train the three stages with ``train(spec, folder, label)``, then compare SFT and PPO policies."""
    for stage, data in demo_specs(out).items():
        train(JobSpec.model_validate(data), out / stage, stage)
    sft_dir, rm_dir = resolve_model_ref(str(out / "sft")), resolve_model_ref(str(out / "rm"))
    ppo_dir = resolve_model_ref(str(out / "ppo"))
    prompts = [r["prompt"] for r in load_rows("builtin:reviews-prompts-eval", "ppo")[:EVAL_PROMPTS]]
    return DemoReport(
        prompts=len(prompts),
        rm_eval_accuracy=rm_accuracy(rm_dir),
        sft=evaluate_policy(sft_dir, sft_dir, rm_dir, prompts),
        ppo=evaluate_policy(ppo_dir, sft_dir, rm_dir, prompts),
    )
