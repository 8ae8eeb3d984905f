"""On-policy distillation: the trained policy (the student) learns a frozen teacher's behaviour on its own samples.

One step = sample ``batch_size`` prompts ``group_size`` times from the student (each prompt prefilled once for its
group), take the teacher's log-probs of the sampled tokens, and give each token the advantage of its own reverse-KL
term, -(log π_student(y_t) - log π_teacher(y_t)): the per-token reward of GKD (Agarwal et al., arXiv:2306.13649) and
of Thinking Machines' on-policy distillation (Lu et al., 2025), with discount 0 (no return), so that the policy
gradient lowers the sampled reverse KL(student ‖ teacher). With a reward and ``reward_coef``, each sample's GRPO
group advantage × ``reward_coef`` is added on its tokens. Then ``num_iterations`` passes of minibatch updates of the
job's ``policy_loss`` (default ``ppo_clip``, the clipped surrogate), no KL term beside: the teacher's pull is in
the advantages. The teacher is the
:class:`engine.core.learner.Learner`'s reference, so the rollout takes its log-probs as any reference's.

In several processes, as in GRPO: each rank samples (and scores) its share of the prompts; the samples are gathered,
so every rank computes the advantages over the whole batch, then trains on its share of every minibatch.
"""

import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engine.callbacks import Callbacks
from engine.core.learner import Learner, Objective, Tokens, run_updates
from engine.core.loop import JobResult
from engine.core.models import check_fits, frozen, load_causal_lm, load_tokenizer, prepare
from engine.core.online import (
    RolloutRNG,
    held_out,
    open_policy,
    open_prompts,
    policy_gradients,
    roll_out_rows,
    update_metrics,
)
from engine.core.rollout import Scorer, correction_metrics, gather_rollout, logged_samples, samples_due
from engine.methods.grpo import sequence_advantages
from engine.rewards.function import RewardFunction, eval_metrics, gathered, grader_scorer
from engine.rewards.graders import reward_metrics
from engine.rewards.reward_model import same_vocabulary
from engine.spec.config import DistillConfig, JobSpec, vocabulary_mismatch


def distill_advantages(
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    scores: torch.Tensor | None = None,
    group_size: int = 1,
    reward_coef: float = 0.0,
) -> torch.Tensor:
    """Advantages (N, T) of the sampled tokens: each kept token's own reverse-KL term, -(log π_student(y_t) -
    log π_teacher(y_t)) (``logprobs``, ``teacher_logprobs``: (N, T)), plus with ``scores`` (N,) ``reward_coef`` ×
    each sample's GRPO group advantage (engine/methods/grpo.py) on every one of its kept tokens. Detached: the sampling
    policy's log-probs are the old ones of the surrogate, not what it differentiates."""
    advantages = teacher_logprobs - logprobs  # (N, T)
    if scores is not None and reward_coef > 0:
        advantages = advantages + reward_coef * sequence_advantages(scores, group_size, "grpo").unsqueeze(1)
    return advantages.detach() * mask


def no_reward(rows: Any, tokens: Tokens) -> tuple[torch.Tensor, None]:
    """The scorer of a job without a reward: 0 for every sample."""
    return torch.zeros(len(tokens), device=tokens.query_responses.device), None


def train_distill(spec: JobSpec, out_dir: Path, callbacks: Callbacks, device: torch.device) -> JobResult:
    cfg = spec.config
    assert isinstance(cfg, DistillConfig) and spec.teacher is not None

    # Data: prompt rows (their other columns feed the graders); rank 0 evaluates. The teacher must read the
    # student's token ids as the same text.
    run, rows, eval_rows = open_prompts(spec, out_dir, callbacks)
    tokenizer, ranks = run.tokenizer, run.ranks
    if not same_vocabulary(tokenizer, load_tokenizer(spec.teacher)):
        raise ValueError(vocabulary_mismatch("teacher"))

    # Models: the trained student, and the frozen teacher as its reference (the rollout takes its log-probs).
    # Rewards, when given: the graders, their reward models loaded once.
    G = cfg.group_size  # samples per prompt
    learner, prompt_length = open_policy(run, cfg, device, [*rows, *eval_rows], False, cfg.batch_size * G)
    cfg = cfg.model_copy(update={"max_prompt_length": prompt_length})  # sized from the prompts where null
    teacher = frozen(prepare(load_causal_lm(spec.teacher, tokenizer, spec.seed), device, cfg.dtype, False))
    longest = prompt_length + cfg.response_length
    check_fits(teacher, longest, "max_prompt_length + response_length, in the teacher")
    ranks.shard(teacher)  # sharded (FSDP) like any frozen reference
    learner.reference = teacher
    stop_token_ids = learner.sampling.stop_token_ids
    reward = RewardFunction.of(spec.reward_grader, tokenizer, device, cfg.dtype, callbacks)
    eval_reward = RewardFunction.of(spec.eval_reward, tokenizer, device, cfg.dtype, callbacks) or reward
    scorer, eval_scorer = (
        no_reward if r is None else grader_scorer(r, tokenizer, stop_token_ids) for r in (reward, eval_reward)
    )
    objective = Objective(cfg.policy_loss, cfg.loss_settings, cfg.aggregation, max_tokens=cfg.response_length)

    start, rng = RolloutRNG.start(learner, run, cfg, spec.seed, device)
    if start.finished:
        return start.finished

    for step, batch_rows in rng.prompt_batches(rows, cfg, start.step):
        t0 = time.perf_counter()
        # 1. rollout: each rank samples its share of the batch's prompts group_size times, with the teacher's
        #    log-probs of the samples (and their scores, with a reward); every rank's samples are then gathered
        share = ranks.share(cfg.batch_size)
        ro, scored = roll_out_rows(learner, tokenizer, cfg.max_prompt_length, scorer, batch_rows, rng.sampling, G,
                                   share=share, trainer_logprobs=cfg.trainer_logprobs)  # fmt: skip
        ro = gather_rollout(ro, ranks, tokenizer.pad_token_id)
        scored = None if scored is None else gathered(scored, ranks, device)
        t_rollout = time.perf_counter() - t0
        if samples_due(step, cfg.log_samples_every):  # what the student says, kept every log_samples_every steps
            rewards = {} if scored is None else {**scored.components, "total": scored.total}
            callbacks.on_samples(step, logged_samples(tokenizer, ro, rewards, cfg.log_samples, stop_token_ids))

        # 2. advantages: each token's own reverse-KL term (ref_logprobs: the teacher's), plus reward_coef × its
        #    sample's group advantage
        mask = ro.mask.float()  # (N, T)
        advantages = distill_advantages(
            ro.logprobs,
            ro.ref_logprobs,
            mask,
            scores=None if scored is None else ro.scores,
            group_size=G,
            reward_coef=cfg.reward_coef,
        )  # (N, T)

        # 3. num_iterations passes over the samples in shuffled minibatches, one optimizer step each
        learner.model.train()
        minibatch = partial(policy_gradients, learner, ro, advantages, mask, objective, cfg)
        stats, _ = run_updates(
            learner,
            len(mask),
            cfg.mini_batch_size,
            cfg.num_iterations,
            rng.shuffle,
            minibatch,
            finite=("policy",),
            step=step,
        )
        lr = learner.schedule()

        # 4. metrics, eval, step end
        elapsed = time.perf_counter() - t0
        tokens = mask.sum().item()
        metrics = {} if scored is None else reward_metrics(scored)
        metrics.update({
            "distill/reverse_kl": ((ro.logprobs - ro.ref_logprobs) * mask).sum().item() / tokens,
            "distill/teacher_logprob": (ro.ref_logprobs * mask).sum().item() / tokens,
            "distill/student_logprob": (ro.logprobs * mask).sum().item() / tokens,
            **update_metrics(ro, mask, stats, lr, t_rollout, elapsed),
            **correction_metrics(ro, cfg.rollout_correction),
        })  # fmt: skip
        metrics.update(learner.sampler_metrics())  # the compiled decoding's share, or the rollout engine's sync
        if run.eval_due(step, cfg.eval_every):
            with learner.gathered():  # rank 0 evaluates its held-out prompts (the others have none)
                if eval_rows:
                    metrics.update(evaluate(learner, tokenizer, eval_scorer, eval_rows, cfg, spec.seed, device))
        if result := run.end_step(step, metrics, {"policy": learner.model}, rng.state):
            return result
    raise AssertionError("unreachable: the last step ends the run")


def evaluate(
    learner: Learner,
    tokenizer: PreTrainedTokenizerBase,
    scorer: Scorer,
    rows: list[dict[str, Any]],
    cfg: DistillConfig,
    seed: int,
    device: torch.device,
) -> dict[str, float]:
    """Each held-out prompt sampled once, from its own fixed seed (training RNG untouched): the student's reverse KL
    to the teacher per token (``eval/distill/reverse_kl``), ``eval/length_mean``, and with a reward of graders
    (``scorer``'s) ``eval/reward`` and ``eval/reward/<name>`` per component."""
    roll = partial(roll_out_rows, learner, tokenizer, cfg.max_prompt_length, scorer)
    per_sample, scored = held_out(roll, rows, cfg.batch_size, seed, device)
    metrics = {
        "eval/distill/reverse_kl": (per_sample["kl"].sum() / per_sample["length"].sum()).item(),
        "eval/length_mean": per_sample["length"].mean().item(),
    }
    return {**metrics, **(eval_metrics(scored) if scored else {})}
