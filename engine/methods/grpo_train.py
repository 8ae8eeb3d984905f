"""Critic-free RL for language models: GRPO (Shao et al., arXiv:2402.03300) and its relatives, by
``advantage_estimator`` (engine/methods/grpo.py).

One step = sample ``batch_size`` prompts, ``group_size`` responses each (each prompt prefilled once for its
group), score them with the job's reward (engine/rewards/graders.py: rules, functions, HTTP services, reward models),
turn the scores into advantages against the other samples of each prompt, then ``num_iterations`` passes of
minibatch updates of the job's ``policy_loss``, with a KL pull to the starting policy as a loss term or in the
reward. No critic and no value model.

In several processes, each rolls out and scores its share of the prompts; the samples are gathered, so every rank
computes the advantages over the whole batch (as one process would), then trains on its share of every minibatch,
DDP averaging the gradients.
"""

import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engine.callbacks import Callbacks
from engine.core.learner import Objective, mean, run_updates
from engine.core.loop import JobResult
from engine.core.online import (
    RolloutRNG,
    evaluate,
    open_policy,
    open_prompts,
    policy_gradients,
    roll_out_rows,
    update_metrics,
)
from engine.core.ops import kl_per_token
from engine.core.rollout import Rollout, correction_metrics, gather_rollout, logged_samples, samples_due
from engine.methods.grpo import tied_groups, token_advantages
from engine.rewards.function import RewardFunction, gathered, grader_scorer
from engine.rewards.graders import RewardScores, reward_metrics
from engine.spec.config import K1_LOSS_TERM_WARNING, GRPOConfig, JobSpec


def train_grpo(spec: JobSpec, out_dir: Path, callbacks: Callbacks, device: torch.device) -> JobResult:
    cfg = spec.config
    assert isinstance(cfg, GRPOConfig) and spec.reward_grader is not None

    # Data: prompt rows (their other columns feed the graders); rank 0 evaluates
    run, rows, eval_rows = open_prompts(spec, out_dir, callbacks)
    tokenizer, ranks = run.tokenizer, run.ranks

    # Models: the trained policy, its frozen reference (none when kl_coef is 0). Rewards: the graders, their
    # reward models loaded once.
    G = cfg.group_size  # samples per prompt
    learner, prompt_length = open_policy(run, cfg, device, [*rows, *eval_rows], cfg.kl_coef > 0, cfg.batch_size * G)
    cfg = cfg.model_copy(update={"max_prompt_length": prompt_length})  # sized from the prompts where null
    if cfg.k1_loss_term:  # accepted, but it does not pull towards the reference
        callbacks.on_event("warning", K1_LOSS_TERM_WARNING, {"reason": "k1_loss_term"})
    reward = RewardFunction(spec.reward_grader, tokenizer, device, cfg.dtype, callbacks)
    eval_reward = RewardFunction.of(spec.eval_reward, tokenizer, device, cfg.dtype, callbacks) or reward
    stop_token_ids = learner.sampling.stop_token_ids
    scorer, eval_scorer = (grader_scorer(r, tokenizer, stop_token_ids) for r in (reward, eval_reward))
    kl_loss_coef = cfg.kl_coef if cfg.kl_coef > 0 and not cfg.kl_as_reward else 0.0
    objective = Objective(
        cfg.policy_loss,
        cfg.loss_settings,
        aggregation=cfg.aggregation,
        max_tokens=cfg.response_length,
        kl_coef=kl_loss_coef,
        kl_estimator=cfg.kl_term_estimator,
    )

    start, rng = RolloutRNG.start(learner, run, cfg, spec.seed, device)
    if start.finished:
        return start.finished

    for step, batch_rows in rng.prompt_batches(rows, cfg, start.step):
        t0 = time.perf_counter()
        # 1. rollout: each rank samples its share of the batch's prompts group_size times and scores the samples;
        #    the samples of every rank are then gathered, group by group
        ro, scored = roll_out_rows(learner, tokenizer, cfg.max_prompt_length, scorer, batch_rows, rng.sampling, G,
                                   share=ranks.share(cfg.batch_size),
                                   trainer_logprobs=cfg.trainer_logprobs)  # fmt: skip
        assert scored is not None
        ro, scored = gather_rollout(ro, ranks, tokenizer.pad_token_id), gathered(scored, ranks, device)
        t_rollout = time.perf_counter() - t0
        if samples_due(step, cfg.log_samples_every):  # what the policy says, kept every log_samples_every steps
            callbacks.on_samples(step, grpo_samples(tokenizer, ro, scored, cfg.log_samples, stop_token_ids))

        # 2. advantages from each group's scores; the KL to the reference in the reward or as a loss term
        mask = ro.mask.float()  # (N, T)
        kl = kl_per_token(ro.logprobs, ro.ref_logprobs, cfg.kl_term_estimator) * mask  # (N, T)
        in_reward = cfg.kl_coef > 0 and cfg.kl_as_reward
        advantages = token_advantages(ro.scores, mask, G, cfg.advantage_estimator,
                                      kl=kl if in_reward else None, kl_coef=cfg.kl_coef)  # fmt: skip

        # 3. num_iterations passes over the samples in shuffled minibatches, one optimizer step each
        learner.model.train()
        minibatch = partial(policy_gradients, learner, ro, advantages, mask, objective, cfg)
        stats, _ = run_updates(learner, len(mask), cfg.mini_batch_size, cfg.num_iterations, rng.shuffle, minibatch,
                               ("policy", "kl"), step)  # fmt: skip
        lr = learner.schedule()

        # 4. metrics, eval, step end
        elapsed = time.perf_counter() - t0
        metrics = reward_metrics(scored)
        metrics.update({
            "objective/kl": kl.sum(1).mean().item(),
            "groups/tied_fraction": tied_groups(ro.scores, G, cfg.advantage_estimator).item(),
            "loss/kl": mean(stats["kl"]),
            **update_metrics(ro, mask, stats, lr, t_rollout, elapsed),
            **correction_metrics(ro, cfg.rollout_correction),
        })  # fmt: skip
        metrics.update(learner.sampler_metrics())  # the compiled decoding's share, or the rollout engine's sync
        if run.eval_due(step, cfg.eval_every):
            with learner.gathered():  # rank 0 evaluates its held-out prompts (the others have none)
                if eval_rows:
                    roll = partial(roll_out_rows, learner, tokenizer, cfg.max_prompt_length, eval_scorer)
                    held = evaluate(roll, tokenizer, eval_rows, cfg.batch_size, spec.seed, device)
                    metrics.update({k: v for k, v in held.items() if k not in ("eval/scores", "eval/kl")})
        if result := run.end_step(step, metrics, {"policy": learner.model}, rng.state):
            return result
    raise AssertionError("unreachable: the last step ends the run")


def grpo_samples(
    tokenizer: PreTrainedTokenizerBase, ro: Rollout, scored: RewardScores, n: int, stop_token_ids: Sequence[int] = ()
) -> list[dict[str, Any]]:
    """The first ``n`` samples of the batch (group by group) for :meth:`Callbacks.on_samples`, with each reward
    component of ``scored`` (the whole batch's) and their ``total``."""
    return logged_samples(tokenizer, ro, {**scored.components, "total": scored.total}, n, stop_token_ids)
