"""PPO for language models as a token-level MDP (Ziegler et al., arXiv:1909.08593;
"The N implementation details of RLHF with PPO", summarize_from_feedback_details/ppo.py).

One step = sample a batch of prompts, roll out, shape rewards, GAE, then ``ppo_epochs`` passes of
minibatch updates of policy and critic.

In several processes, each rolls out its share of the prompts; the rollouts are gathered, so every rank
shapes rewards and computes advantages over the whole batch (as one process would), then trains on its share
of every minibatch, DDP averaging the gradients. Sharded (FSDP), the policy, its reference and the critic are
each FSDP units: a rank gathers the critic's weights for its share's values, as it does the policy's to sample.
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engine.callbacks import Callbacks
from engine.core.data import batch_indices, encode_sft_batch, load_rows
from engine.core.health import CollapseMonitor, check_collapse
from engine.core.learner import Learner, LossInputs, Objective, accumulate, count_labels, mean, run_updates
from engine.core.loop import JobResult
from engine.core.models import ScalarHead, check_fits
from engine.core.online import RolloutRNG, critic_and_scorer, evaluate, open_policy, open_prompts, roll_out_rows
from engine.core.ops import kl_per_token, masked_mean, masked_whiten
from engine.core.rollout import (
    Rollout,
    correction_metrics,
    gather_rollout,
    logged_samples,
    response_values,
    samples_due,
)
from engine.methods.ppo import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    compute_gae,
    compute_rewards,
    explained_variance,
    shape_scores,
    value_loss,
)
from engine.rewards.function import RewardFunction, gathered
from engine.rewards.graders import reward_metrics
from engine.spec.config import JobSpec, PPOConfig

MINIBATCH_STATS = ("policy", "value", "clipfrac", "value_clipfrac", "approx_kl", "entropy", "ptx")
"""Per-minibatch statistics: policy and value loss, their clip fractions, approx-KL, entropy, ptx loss."""


@dataclass
class Experience:
    """A step's rollout and what the PPO epochs train on, of the whole batch (every rank's rows)."""

    ro: Rollout
    mask: torch.Tensor
    """1.0 on the kept response tokens: (B, T)."""
    advantages: torch.Tensor
    """GAE advantages, whitened over the valid tokens with ``whiten_advantages``: (B, T)."""
    returns: torch.Tensor
    """The critic's targets: (B, T)."""


def train_ppo(spec: JobSpec, out_dir: Path, callbacks: Callbacks, device: torch.device) -> JobResult:
    cfg = spec.config
    assert isinstance(cfg, PPOConfig) and spec.reward_grader is not None

    # Data: prompts, and SFT rows for the optional pretraining (ptx) loss; rank 0 evaluates
    ptx_rows = load_rows(cfg.ptx_dataset, "sft") if cfg.ptx_dataset and cfg.ptx_coef > 0 else []
    more = {"hyperparameters.ptx_dataset": ptx_rows}
    run, prompt_rows, eval_rows = open_prompts(spec, out_dir, callbacks, more)
    tokenizer, ranks = run.tokenizer, run.ranks  # several processes: each rolls out and trains on its share

    # Models: the trained policy and its frozen reference (the starting policy), the critic and the reward
    # (:func:`open_critic`)
    learner, prompt_length = open_policy(run, cfg, device, [*prompt_rows, *eval_rows], True, cfg.batch_size)
    cfg = cfg.model_copy(update={"max_prompt_length": prompt_length})  # sized from the prompts where null
    value_model, scorer = critic_and_scorer(run, cfg, device, learner.sampling.stop_token_ids)
    stop_token_ids = learner.sampling.stop_token_ids
    eval_reward = RewardFunction.of(spec.eval_reward, tokenizer, device, cfg.dtype, callbacks)
    if ptx_rows:
        check_fits(learner.model, cfg.max_length, "hyperparameters.max_length")
    critic = ranks.wrap(ScalarHead(value_model), compile=cfg.torch_compile)  # trained through; rollouts use the model
    learner.also_trained["value"] = critic
    saved = {"policy": learner.model, "value": value_model}  # the checkpoints' models
    objective = Objective(cfg.policy_loss, cfg.loss_settings, aggregation=cfg.aggregation,
                          max_tokens=cfg.response_length, entropy=True, entropy_coef=cfg.entropy_coef)  # fmt: skip

    # Optimizer (policy and critic, each at its learning rate), schedule, RNGs, KL controller, running score
    # moments and collapse monitor, restored from the last checkpoint when there is one
    value_params = [p for p in value_model.parameters() if p.requires_grad]
    value_lr = cfg.value_learning_rate or cfg.learning_rate
    start, rng = RolloutRNG.start(learner, run, cfg, spec.seed, device, (value_params, value_lr))
    if start.finished:
        return start.finished
    control = Controllers(cfg, start.state)
    kl_ctl, score_moments, monitor = control.kl_ctl, control.score_moments, control.monitor

    def trainer_state() -> dict[str, object]:
        """What a checkpoint keeps besides optimizer and schedule."""
        return {**control.state(), **rng.state()}

    roll = partial(roll_out_rows, learner, tokenizer, cfg.max_prompt_length, scorer, critic=value_model)
    correction = cfg.rollout_correction  # the rollout takes the trainer's log-probs too

    B = cfg.batch_size
    ptx = None
    if ptx_rows:  # the pretraining rows of an update, in the order SFT would take them: a rank's share
        ptx = partial(ptx_minibatch, ptx_rows, tokenizer, cfg, spec.seed, share=ranks.share(cfg.mini_batch_size),
                      device=device)  # fmt: skip
    for step, batch_rows in rng.prompt_batches(prompt_rows, cfg, start.step):
        t0 = time.perf_counter()
        # 1. rollout: a batch of prompts (left-padded), each rank sampling responses to its share, truncated
        #    after the stop token, with logprobs, ref_logprobs, values and scores. Every rank's rows are then
        #    gathered: the stages up to the PPO epochs see the whole batch.
        with ranks.gathered(critic):  # sharded: the critic's values (and scores) of a rank's share, by it alone
            ro, graded = roll(batch_rows, rng.sampling, share=ranks.share(B), trainer_logprobs=cfg.trainer_logprobs)
        ro = gather_rollout(ro, ranks, tokenizer.pad_token_id)
        graded = gathered(graded, ranks, device) if graded else None  # graders: every rank's components
        mask = ro.mask.float()  # (B, T)
        t_rollout = time.perf_counter() - t0

        # 2. rewards: the shaped score on the last kept token, -β·KL on every token
        stopped = ro.stopped if stop_token_ids else None
        raw_scores, scores = shape_scores(ro.scores, stopped, cfg, score_moments)  # (B,), (B,)
        kl = kl_per_token(ro.logprobs, ro.ref_logprobs, cfg.kl_estimator) * mask  # (B, T)
        rewards, non_score_reward = compute_rewards(scores, kl, mask, kl_ctl.value)
        if samples_due(step, cfg.log_samples_every):
            # a reward model's score (objective/scores), or each grader's and their total
            shown = {"score": raw_scores.tolist()} if graded is None else {**graded.components, "total": graded.total}
            callbacks.on_samples(step, logged_samples(tokenizer, ro, shown, cfg.log_samples, stop_token_ids))

        # 3. advantages and returns (GAE), advantages whitened over valid tokens
        assert ro.values is not None
        advantages, returns = compute_gae(rewards, ro.values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        exp = Experience(ro, mask, advantages, returns)

        # 4. PPO epochs: the batch in shuffled minibatches, one optimizer step each (the policy's losses only
        #    after the critic's warm-up); approx-KL above its target cuts the epochs short
        train_policy = step > cfg.critic_warmup_steps
        learner.model.train()
        value_model.train()

        first_update = (step - 1) * cfg.ppo_epochs * cfg.num_mini_batches  # counts the ptx batches
        minibatch = partial(ppo_gradients, learner, critic, exp, ptx, first_update, objective, cfg, train_policy)
        limit = None if cfg.target_approxkl is None else ("approx_kl", cfg.target_approxkl)
        stats, early_stopped = run_updates(learner, B, cfg.mini_batch_size, cfg.ppo_epochs, rng.shuffle, minibatch,
                                           ("policy", "value"), step, limit)  # fmt: skip
        if early_stopped:
            callbacks.on_event("warning", f"step {step}: approx-KL above {cfg.target_approxkl}, epochs cut short")
        lr = learner.schedule()

        # 5. KL controller and metrics
        mean_kl = kl.sum(1).mean().item()
        kl_coef = kl_ctl.value  # the β of this step's rewards, before the controller moves it for the next step
        kl_ctl.update(mean_kl, B)
        elapsed = time.perf_counter() - t0
        metrics = ppo_metrics(exp, raw_scores, non_score_reward, mean_kl, kl_coef, stats, lr, t_rollout, elapsed)
        metrics.update(correction_metrics(ro, correction))  # the sync check, with rollout_correction
        if ptx_rows:
            metrics["loss/ptx"] = mean(stats["ptx"])
        metrics.update(learner.sampler_metrics())  # the compiled decoding's share, or the rollout engine's sync
        if graded is not None:  # the reward's components, over every rank's rows
            metrics.update(reward_metrics(graded))
        if run.eval_due(step, cfg.eval_every):
            with learner.gathered(), ranks.gathered(critic):  # rank 0 evaluates its held-out prompts (the others
                if eval_rows:  # have none)
                    metrics.update(evaluate(roll, tokenizer, eval_rows, B, spec.seed, device, eval_reward,
                                            stop_token_ids))  # fmt: skip

        # 6. collapse signals (MOSS-RLHF §2.1, engine/core/health.py), from metrics every rank computed alike: each
        #    takes the same decision
        if halted := check_collapse(cfg.collapse.action, monitor, run, step, metrics, saved):
            return halted

        # 7. step end: report, checkpoint when due, stop request
        if result := run.end_step(step, metrics, saved, trainer_state):
            return result
    raise AssertionError("unreachable: the last step ends the run")


def ptx_minibatch(
    rows: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    cfg: PPOConfig,
    seed: int,
    update: int,
    share: slice,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], int]:
    """The pretraining rows of the ``update``-th minibatch update (0-based, in the seeded order of SFT's batches):
    this process's ``share`` of them encoded on ``device``, and the label count of them all."""
    batch_rows = [rows[i] for i in batch_indices(len(rows), cfg.mini_batch_size, seed, update)]
    encoded = encode_sft_batch(tokenizer, batch_rows, cfg.max_length)
    n_tokens = count_labels(encoded)
    return {k: v[share].to(device) for k, v in encoded.items()}, n_tokens


PtxBatches = Callable[[int], tuple[dict[str, torch.Tensor], int]]
"""The pretraining rows of an update (its number in the job): this process's share encoded, their label count."""


class Controllers:
    """The KL controller, the running score moments and the collapse monitor, restored from a checkpoint's
    trainer ``state`` when there is one."""

    def __init__(self, cfg: PPOConfig, state: dict[str, Any] | None) -> None:
        self.kl_ctl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.adaptive_kl \
            else FixedKLController(cfg.kl_coef)  # fmt: skip
        self.score_moments = RunningMoments()
        self.monitor = CollapseMonitor(**cfg.collapse.model_dump(exclude={"action"}), max_length=cfg.response_length)
        if state:
            self.kl_ctl.load_state_dict(state["kl_ctl"])
            self.score_moments.load_state_dict(state["score_moments"])
            if "collapse_monitor" in state:  # absent from checkpoints written before the monitor existed
                self.monitor.load_state_dict(state["collapse_monitor"])

    def state(self) -> dict[str, Any]:
        return {"kl_ctl": self.kl_ctl.state_dict(), "score_moments": self.score_moments.state_dict(),
                "collapse_monitor": self.monitor.state_dict()}  # fmt: skip


def ppo_gradients(
    learner: Learner,
    critic: torch.nn.Module,
    exp: Experience,
    ptx_batches: PtxBatches | None,
    first_update: int,
    objective: Objective,
    cfg: PPOConfig,
    train_policy: bool,
    mb_inds: torch.Tensor,
    update: int,
) -> dict[str, float]:
    """Forward and backward of the minibatch of rows ``mb_inds`` of ``exp`` (per process: its share of them), the
    step's ``update``-th, in micro-batches accumulating gradients: the policy's ``objective`` (the clipped loss
    less the entropy bonus) and the ptx loss on the pretraining rows of update ``first_update + update`` (the
    label count of their whole batch normalising it), both only when ``train_policy``, then the clipped value
    loss. Each is normalised by the token count of the whole
    minibatch (the ptx loss: of the whole pretraining batch). Returns :data:`MINIBATCH_STATS` summed over the
    micro-batches and the ranks; the optimizer step is the caller's.

    Policy, ptx and critic losses are backpropagated one after the other (they share no parameters), so only one
    model's activations are held at a time.
    """
    ro, mask, ranks = exp.ro, exp.mask, learner.ranks
    ptx = ptx_batches(first_update + update) if ptx_batches is not None and train_policy else None
    n_tokens = mask[mb_inds].sum()
    own = mb_inds[ranks.share(cfg.mini_batch_size)]

    def micro(part: slice, last: bool) -> dict[str, torch.Tensor]:
        inds = own[part]
        batch, kept = ro.tokens.rows(inds), mask[inds]
        sampler = None if ro.sampler_logprobs is None else ro.sampler_logprobs[inds]
        inputs = LossInputs(ro.logprobs[inds], exp.advantages[inds], kept, len(mb_inds), n_tokens,
                            sampler_logprobs=sampler)  # fmt: skip
        stats = learner.forward_backward(batch, objective, inputs, last, grad=train_policy)
        if ptx is not None:
            ptx_batch, n_ptx_tokens = ptx
            ptx_micro = {k: v[part] for k, v in ptx_batch.items()}
            stats["ptx"] = learner.sft_backward(ptx_micro, n_ptx_tokens, cfg.ptx_coef, last) / n_ptx_tokens
        with ranks.no_sync(critic, last):
            assert ro.values is not None
            vpreds = response_values(critic, batch.query_responses, batch.attention_mask, batch.context_length)
            vf_loss, vf_clipfrac = value_loss(vpreds, ro.values[inds], exp.returns[inds], kept, cfg.cliprange_value,
                                              n_tokens)  # fmt: skip
            (ranks.loss_scale * cfg.vf_coef * vf_loss).backward()
        return {**stats, "value": vf_loss.detach(), "value_clipfrac": vf_clipfrac}

    return accumulate(len(own), cfg.micro_batch_size // ranks.world_size, MINIBATCH_STATS, micro, ranks, mask.device)


def ppo_metrics(
    exp: Experience,
    raw_scores: torch.Tensor,
    non_score_reward: torch.Tensor,
    mean_kl: float,
    kl_coef: float,
    stats: dict[str, list[float]],
    lr: float,
    t_rollout: float,
    elapsed: float,
) -> dict[str, float]:
    """A step's metrics (the README's list) from its experience, the minibatches' ``stats`` and its timings."""
    ro, mask = exp.ro, exp.mask
    assert ro.values is not None
    n_generated = mask.sum().item()
    non_score = non_score_reward.sum(1).mean().item()
    return {
        "objective/scores": raw_scores.mean().item(),
        "objective/kl": mean_kl,
        "objective/kl_coef": kl_coef,
        "objective/non_score_reward": non_score,
        "objective/rlhf_reward": raw_scores.mean().item() + non_score,
        "objective/entropy": (-ro.logprobs * mask).sum(1).mean().item(),
        "policy/approxkl": mean(stats["approx_kl"]),
        "policy/clipfrac": mean(stats["clipfrac"]),
        "policy/entropy": mean(stats["entropy"]),
        "loss/policy": mean(stats["policy"]),
        "loss/value": mean(stats["value"]),
        "val/clipfrac": mean(stats["value_clipfrac"]),
        "val/mean": masked_mean(ro.values, mask).item(),
        "val/var_explained": explained_variance(ro.values, exp.returns, mask).item(),
        "returns/mean": masked_mean(exp.returns, mask).item(),
        "response/length_mean": mask.sum(1).mean().item(),
        "response/eos_fraction": ro.stopped.float().mean().item(),
        "response/perplexity": math.exp(-masked_mean(ro.logprobs, mask).item()),
        "time/rollout_s": t_rollout,
        "time/train_s": elapsed - t_rollout,
        "time/step_s": elapsed,
        "throughput/tokens_per_s": n_generated / elapsed,
        "lr": lr,
        "grad_norm": mean(stats["grad_norm"]),
    }
