"""PPO for language models as a token-level MDP (Ziegler et al., arXiv:1909.08593;
"The N implementation details of RLHF with PPO", summarize_from_feedback_details/ppo.py).

One step = sample a batch of prompts, roll out, shape rewards, GAE, then ``ppo_epochs`` passes of
minibatch updates of policy and critic.

In several processes, each rolls out its share of the prompts; the rollouts are gathered, so every rank
shapes rewards and computes advantages over the whole batch (as one process would), then trains on its share
of every minibatch, DDP averaging the gradients.
"""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.callbacks import Callbacks
from engine.config import JobSpec, PPOConfig
from engine.data import batch_indices, encode_prompts, encode_sft_batch, load_rows
from engine.distributed import Ranks
from engine.generate import decode_warning, job_decoder
from engine.graders import ModelGrader, RewardScores, reward_metrics
from engine.health import CollapseMonitor, TrainingCollapseError
from engine.loop import JobResult, Run, check_finite, clip_and_step, load_datasets, seed_everything
from engine.models import (
    ScalarHead,
    check_fits,
    frozen,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    prepare,
    resolve_stop_token,
    token_logprobs,
)
from engine.ops import masked_mean, masked_whiten
from engine.ppo import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    compute_gae,
    compute_rewards,
    explained_variance,
    kl_per_token,
    policy_loss,
    value_loss,
)
from engine.reward import same_vocabulary
from engine.rewards import RewardFunction, eval_metrics, gathered, grader_scorer, merged, samples_of
from engine.rollout import (
    Rollout,
    decode_responses,
    gather_rollout,
    logged_samples,
    make_rollout,
    response_values,
    samples_due,
    text_scorer,
    token_scorer,
)
from engine.sft import completion_loss_sum, count_labels

MB_STATS = ("pg", "vf", "clip", "vclip", "akl", "ent", "ptx")
"""Per-minibatch statistics: policy and value loss, their clip fractions, approx-KL, entropy, ptx loss."""

Sampler = Callable[[Sequence[dict[str, Any]], torch.Tensor, torch.Tensor, torch.Generator], Rollout]
"""Rolls out prompts: (their dataset rows, their queries (b, P) and query mask on the device, the generator
sampling them) -> their :class:`Rollout` (see :func:`engine.rollout.make_rollout`)."""


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
    # a reward model (reward_model, or a reward of one model grader) scores tokens; other rewards score text
    reward_ref = spec.reward_model or (spec.reward.model if isinstance(spec.reward, ModelGrader) else None)
    seed_everything(spec.seed)
    ranks = Ranks.current()  # several processes: each rolls out and trains on its share of every batch

    # Data: prompts, and SFT rows for the optional pretraining (ptx) loss; rank 0 evaluates
    prompt_rows, eval_rows = load_datasets(spec, "ppo", ranks)
    ptx_rows = load_rows(cfg.ptx_dataset, "sft") if cfg.ptx_dataset and cfg.ptx_coef > 0 else []
    eval_rows = eval_rows[: cfg.eval_max_prompts]

    # Models: trained policy and critic, frozen reference (the starting policy) and frozen reward model.
    # The critic starts as the reward model (PPO-max); with LoRA the reference and the reward model are the
    # policy's and critic's own bases with the adapters disabled. A reward model of another vocabulary
    # scores the decoded text with its own tokenizer, and the critic then starts from the policy's backbone;
    # so does it for a reward of graders (rules, functions, services), which score the decoded text.
    run = Run.open(
        spec,
        out_dir,
        callbacks,
        ranks,
        {"dataset": prompt_rows, "eval_dataset": eval_rows, "hyperparameters.ptx_dataset": ptx_rows},
    )
    tokenizer = run.tokenizer
    reward_tokenizer = load_tokenizer(reward_ref) if reward_ref else None
    shared_vocabulary = reward_tokenizer is not None and same_vocabulary(tokenizer, reward_tokenizer)

    def causal_lm(ref: str) -> PreTrainedModel:
        return prepare(load_causal_lm(ref, tokenizer, spec.seed), device, cfg.dtype, cfg.gradient_checkpointing)

    def scalar_model(
        ref: str, tokenizer: PreTrainedTokenizerBase = tokenizer, trained_head: bool = True
    ) -> PreTrainedModel:
        model = load_scalar_model(ref, tokenizer, spec.seed, trained_head)
        return prepare(model, device, cfg.dtype, cfg.gradient_checkpointing)

    policy = run.load_trained("policy", spec.model, causal_lm, "CAUSAL_LM")
    ref_policy = frozen(causal_lm(spec.model)) if spec.lora is None else None
    stop_token_ids = resolve_stop_token(cfg.stop_token, policy, tokenizer)  # (): responses run to response_length
    recorded: list[RewardScores] = []  # a reward of graders: each rollout chunk's component scores
    if shared_vocabulary:
        assert reward_ref is not None
        value_model = run.load_trained("value", reward_ref, scalar_model, "SEQ_CLS")
        reward_model = frozen(scalar_model(reward_ref)) if spec.lora is None else None
        scorer = token_scorer(reward_model, value_model)
    else:
        value_model = run.load_trained(
            "value", spec.model, lambda ref: scalar_model(ref, trained_head=False), "SEQ_CLS"
        )
    stop = callbacks.should_stop  # asked while an http grader waits for its service
    eval_reward = RewardFunction(spec.eval_reward, tokenizer, device, cfg.dtype, stop) if spec.eval_reward else None
    if reward_ref is None:
        grader = RewardFunction(spec.reward_grader, tokenizer, device, cfg.dtype, stop)
        scorer = grader_scorer(grader, tokenizer, stop_token_ids, recorded)
    elif not shared_vocabulary:
        assert reward_tokenizer is not None
        reward_model = frozen(scalar_model(reward_ref, reward_tokenizer))
        scorer = text_scorer(reward_model, reward_tokenizer, tokenizer, stop_token_ids)
        callbacks.on_event(
            "info",
            "the reward model's tokenizer differs from the policy's: responses are scored as text, re-encoded by "
            "the reward model's tokenizer, and the critic starts from the policy",
            {"reward_model": spec.reward_model},
        )
    limit = run.prompt_length(cfg.max_prompt_length, cfg.response_length, policy, [*prompt_rows, *eval_rows])
    cfg = cfg.model_copy(update={"max_prompt_length": limit})  # null: sized from the prompts and the context
    check_fits(policy, limit + cfg.response_length, "max_prompt_length + response_length")
    if ptx_rows:
        check_fits(policy, cfg.max_length, "hyperparameters.max_length")
    policy_params = [p for p in policy.parameters() if p.requires_grad]
    value_params = [p for p in value_model.parameters() if p.requires_grad]
    # trained through these (DistributedDataParallel with several processes); rollouts use the models themselves
    trained_policy = ranks.wrap(policy, compile=cfg.torch_compile)
    critic = ranks.wrap(ScalarHead(value_model), compile=cfg.torch_compile)
    saved = {"policy": policy, "value": value_model}  # the checkpoints' models
    decoder = job_decoder(policy, cfg.cuda_graphs, limit, cfg.batch_size, device, warn=decode_warning(callbacks))
    if decoder is not None:
        run.at_end(decoder.close)

    def sample(
        rows: Sequence[dict[str, Any]], queries: torch.Tensor, query_mask: torch.Tensor, generator: torch.Generator
    ) -> Rollout:
        return make_rollout(
            policy, ref_policy, value_model, scorer, rows, queries, query_mask, cfg.response_length,
            cfg.temperature, cfg.top_k, stop_token_ids, tokenizer.pad_token_id, generator,
            chunk_size=cfg.mini_batch_size, decoder=decoder,
        )  # fmt: skip

    # Optimizer (policy and critic, each at its learning rate), schedule, KL controller, running score moments,
    # collapse monitor and RNGs, restored from the last checkpoint when there is one
    start = run.start_training(
        cfg,
        cfg.total_steps,
        (policy_params, cfg.learning_rate),
        (value_params, cfg.value_learning_rate or cfg.learning_rate),
    )
    if start.finished:
        return start.finished
    optimizer, scheduler = start.optimizer, start.scheduler
    kl_ctl = (
        AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
        if cfg.adaptive_kl
        else FixedKLController(cfg.kl_coef)
    )
    score_moments = RunningMoments()
    monitor = CollapseMonitor(**cfg.collapse.model_dump(exclude={"action"}), max_length=cfg.response_length)
    generator = torch.Generator(device).manual_seed(spec.seed + 1_000_003 * ranks.rank)  # sampling, per rank
    shuffle = torch.Generator().manual_seed(spec.seed + 1)  # minibatch order, the same on every rank
    if state := start.state:
        kl_ctl.load_state_dict(state["kl_ctl"])
        score_moments.load_state_dict(state["score_moments"])
        if "collapse_monitor" in state:  # absent from checkpoints written before the monitor existed
            monitor.load_state_dict(state["collapse_monitor"])
        generator.set_state(state["rank_generators"][ranks.rank] if ranks.world_size > 1 else state["generator"])
        shuffle.set_state(state["shuffle"])

    def trainer_state() -> dict[str, object]:
        """What a checkpoint keeps of the parts above besides optimizer and schedule."""
        state = {
            "kl_ctl": kl_ctl.state_dict(),
            "score_moments": score_moments.state_dict(),
            "collapse_monitor": monitor.state_dict(),
            "generator": generator.get_state(),
            "shuffle": shuffle.get_state(),
        }
        if ranks.world_size > 1:  # each rank samples from its own generator
            state["rank_generators"] = ranks.gather_objects(generator.get_state())
        return state

    B = cfg.batch_size
    minibatch_share = ranks.share(cfg.mini_batch_size)  # a rank's rows of each minibatch
    for step in range(start.step + 1, cfg.total_steps + 1):
        t0 = time.perf_counter()
        # 1. rollout: a batch of prompts (left-padded), each rank sampling responses to its share, truncated
        #    after the stop token, with logprobs, ref_logprobs, values and scores. Every rank's rows are then
        #    gathered: the stages up to the PPO epochs see the whole batch.
        batch_rows = [prompt_rows[i] for i in batch_indices(len(prompt_rows), B, spec.seed, step - 1)]
        queries, query_mask = encode_prompts(tokenizer, [r["prompt"] for r in batch_rows], cfg.max_prompt_length)
        own = ranks.share(B)
        ro = sample(batch_rows[own], queries[own].to(device), query_mask[own].to(device), generator)
        ro = gather_rollout(ro, ranks, tokenizer.pad_token_id)
        mask = ro.mask.float()  # (B, T)
        t_rollout = time.perf_counter() - t0

        # 2. rewards: the shaped score on the last kept token, -β·KL on every token
        raw_scores, scores = shape_scores(ro, cfg, score_moments, stop_token_ids)  # (B,), (B,)
        kl = kl_per_token(ro.logprobs, ro.ref_logprobs, cfg.kl_estimator) * mask  # (B, T)
        rewards, non_score_reward = compute_rewards(scores, kl, mask, kl_ctl.value)
        graded = gathered(merged(recorded), ranks, device) if recorded else None  # graders: every rank's components
        recorded.clear()
        if samples_due(step, cfg.log_samples_every):
            samples = ppo_samples(tokenizer, ro, raw_scores, graded, cfg.log_samples, stop_token_ids)
            callbacks.on_samples(step, samples)

        # 3. advantages and returns (GAE), advantages whitened over valid tokens
        advantages, returns = compute_gae(rewards, ro.values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        exp = Experience(ro, mask, advantages, returns)

        # 4. PPO epochs: the batch in shuffled minibatches, one optimizer step each (the policy's losses only
        #    after the critic's warm-up); approx-KL above its target cuts the epochs short
        train_policy = step > cfg.critic_warmup_steps
        policy.train()
        value_model.train()
        stats: dict[str, list[float]] = {k: [] for k in (*MB_STATS, "gn")}
        early_stopped = False
        for epoch in range(cfg.ppo_epochs):
            order = torch.randperm(B, generator=shuffle)
            for m, first in enumerate(range(0, B, cfg.mini_batch_size)):
                mb_inds = order[first : first + cfg.mini_batch_size].to(device)
                ptx = None
                if ptx_rows:
                    update = ((step - 1) * cfg.ppo_epochs + epoch) * cfg.num_mini_batches + m
                    ptx = ptx_minibatch(ptx_rows, tokenizer, cfg, spec.seed, update, minibatch_share, device)
                mb = minibatch_gradients(trained_policy, critic, exp, mb_inds, ptx, cfg, ranks, train_policy)
                check_finite("loss", mb["pg"] + mb["vf"], step)
                mb["gn"] = clip_and_step(policy_params + value_params, optimizer, cfg.max_grad_norm)
                for key, total in mb.items():
                    stats[key].append(total)
                if cfg.target_approxkl is not None and mb["akl"] > cfg.target_approxkl:
                    early_stopped = True
                    break
            if early_stopped:
                callbacks.on_event("warning", f"step {step}: approx-KL above {cfg.target_approxkl}, epochs cut short")
                break
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()

        # 5. KL controller and metrics
        mean_kl = kl.sum(1).mean().item()
        kl_coef = kl_ctl.value  # the β of this step's rewards, before the controller moves it for the next step
        kl_ctl.update(mean_kl, B)
        elapsed = time.perf_counter() - t0
        metrics = ppo_metrics(exp, raw_scores, non_score_reward, mean_kl, kl_coef, stats, lr, t_rollout, elapsed)
        if ptx_rows:
            metrics["loss/ptx"] = _mean(stats["ptx"])
        if decoder is not None:  # the share of this step's decoding steps that ran compiled
            metrics["rollout/compiled_fraction"] = decoder.compiled_fraction()
        if graded is not None:  # the reward's components, over every rank's rows
            metrics.update(reward_metrics(graded))
        if eval_rows and run.eval_due(step, cfg.eval_every):
            metrics.update(evaluate(sample, tokenizer, eval_rows, cfg, spec.seed, device, eval_reward, stop_token_ids))
            if eval_reward is None and recorded:  # a reward of graders: its scores of the held-out samples
                metrics.update(eval_metrics(merged(recorded)))
            recorded.clear()

        # 6. collapse signals (MOSS-RLHF §2.1, engine/health.py), from metrics every rank computed alike: each
        #    takes the same decision
        if halted := check_collapse(cfg.collapse.action, monitor, run, step, metrics, saved):
            return halted

        # 7. step end: report, checkpoint when due, stop request
        if result := run.end_step(step, metrics, saved, trainer_state):
            return result
    raise AssertionError("unreachable: the last step ends the run")


def shape_scores(
    ro: Rollout, cfg: PPOConfig, moments: RunningMoments, stop_token_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, shaped) scores (B,): the reward model's less the missing-stop penalty, then normalised by the running
    ``moments`` (updated here) and clipped, where configured (PPO-max)."""
    raw_scores = ro.scores.clone()  # (B,)
    if stop_token_ids:
        raw_scores -= cfg.missing_eos_penalty * (~ro.stopped).float()
    scores = raw_scores
    if cfg.normalize_scores:
        moments.update(scores)
        scores = (scores - moments.mean) / max(moments.std, 1e-8)
    if cfg.score_clip is not None:
        scores = scores.clamp(-cfg.score_clip, cfg.score_clip)
    return raw_scores, scores


def ppo_samples(
    tokenizer: PreTrainedTokenizerBase,
    ro: Rollout,
    raw_scores: torch.Tensor,
    graded: RewardScores | None,
    n: int,
    stop_token_ids: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """The first ``n`` rollouts of the batch for :meth:`Callbacks.on_samples`: rewarded by a reward model with their
    ``score`` (``raw_scores``, as ``objective/scores``), by graders with each component and their ``total``."""
    if graded is None:
        rewards: dict[str, Sequence[float]] = {"score": raw_scores.tolist()}
    else:
        rewards = {**graded.components, "total": graded.total}
    return logged_samples(
        tokenizer,
        ro.query_responses,
        ro.attention_mask,
        ro.context_length,
        ro.logprobs,
        ro.ref_logprobs,
        rewards,
        n,
        stop_token_ids,
    )


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


def minibatch_gradients(
    trained_policy: torch.nn.Module,
    critic: torch.nn.Module,
    exp: Experience,
    mb_inds: torch.Tensor,
    ptx: tuple[dict[str, torch.Tensor], int] | None,
    cfg: PPOConfig,
    ranks: Ranks,
    train_policy: bool,
) -> dict[str, float]:
    """Forward and backward of the minibatch of rows ``mb_inds`` of ``exp`` (per process: its share of them), in
    micro-batches accumulating gradients: the clipped policy loss less the entropy bonus and the ptx loss on
    ``ptx`` (this process's share of a pretraining batch, and the label count of the whole), both only when
    ``train_policy``, then the clipped value loss. Each is normalised by the token count of the whole minibatch
    (the ptx loss: of the whole pretraining batch). Returns :data:`MB_STATS` summed over the micro-batches and
    the ranks; the optimizer step is the caller's.

    Policy, ptx and critic losses are backpropagated one after the other (they share no parameters), so only one
    model's activations are held at a time. The entropy's graph (a softmax over the vocabulary) is built only
    when the loss uses it.
    """
    ro, mask, device = exp.ro, exp.mask, exp.mask.device
    n_tokens = mask[mb_inds].sum()
    own_inds = mb_inds[ranks.share(cfg.mini_batch_size)]
    mbs = cfg.micro_batch_size // ranks.world_size  # a rank's micro-batch
    entropy_in_loss = train_policy and cfg.entropy_coef > 0
    scale = ranks.loss_scale  # DDP averages the ranks' gradients; each holds a share of the sum
    mb_stats = torch.zeros(len(MB_STATS), device=device)  # summed over micro-batches
    for u in range(0, len(own_inds), mbs):
        inds = own_inds[u : u + mbs]
        last = u + mbs >= len(own_inds)  # DDP averages the accumulated gradients after this one
        qr, am, mk = ro.query_responses[inds], ro.attention_mask[inds], mask[inds]
        with ranks.no_sync(trained_policy, last), torch.set_grad_enabled(train_policy):
            new_logprobs, token_entropy = token_logprobs(
                trained_policy, qr, am, ro.context_length, cfg.temperature, entropy=True, entropy_grad=entropy_in_loss
            )
            assert token_entropy is not None
            pl = policy_loss(new_logprobs, ro.logprobs[inds], exp.advantages[inds], mk, cfg.cliprange, n_tokens)
            entropy = (token_entropy * mk).sum() / n_tokens
            if train_policy:
                objective = pl.pg_loss - cfg.entropy_coef * entropy if entropy_in_loss else pl.pg_loss
                (scale * objective).backward()
        del token_entropy, new_logprobs
        ptx_loss = torch.zeros((), device=device)
        if ptx is not None and train_policy:
            ptx_batch, n_ptx_tokens = ptx
            ptx_micro = {k: v[u : u + mbs] for k, v in ptx_batch.items()}
            with ranks.no_sync(trained_policy, last):
                ptx_loss = completion_loss_sum(trained_policy, ptx_micro) / n_ptx_tokens
                (scale * cfg.ptx_coef * ptx_loss).backward()
        with ranks.no_sync(critic, last):
            vpreds = response_values(critic, qr, am, ro.context_length)  # (b, T)
            vf_loss, vf_clipfrac = value_loss(
                vpreds, ro.values[inds], exp.returns[inds], mk, cfg.cliprange_value, n_tokens
            )
            (scale * cfg.vf_coef * vf_loss).backward()
        parts = (pl.pg_loss, vf_loss, pl.clipfrac, vf_clipfrac, pl.approxkl, entropy, ptx_loss)
        mb_stats += torch.stack([p.detach().float() for p in parts])
    return dict(zip(MB_STATS, ranks.sum(mb_stats).tolist(), strict=True))  # one sync per minibatch


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
    n_generated = mask.sum().item()
    non_score = non_score_reward.sum(1).mean().item()
    return {
        "objective/scores": raw_scores.mean().item(),
        "objective/kl": mean_kl,
        "objective/kl_coef": kl_coef,
        "objective/non_score_reward": non_score,
        "objective/rlhf_reward": raw_scores.mean().item() + non_score,
        "objective/entropy": (-ro.logprobs * mask).sum(1).mean().item(),
        "policy/approxkl": _mean(stats["akl"]),
        "policy/clipfrac": _mean(stats["clip"]),
        "policy/entropy": _mean(stats["ent"]),
        "loss/policy": _mean(stats["pg"]),
        "loss/value": _mean(stats["vf"]),
        "val/clipfrac": _mean(stats["vclip"]),
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
        "grad_norm": _mean(stats["gn"]),
    }


def evaluate(
    sample: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, Any]],
    cfg: PPOConfig,
    seed: int,
    device: torch.device,
    eval_reward: RewardFunction | None = None,
    stop_token_ids: Sequence[int] = (),
) -> dict[str, float]:
    """Held-out prompts, sampled as in training but from their own fixed seed (training RNG untouched); with
    ``eval_reward``, their samples scored by it too (``eval/reward`` and its components)."""
    eval_generator = torch.Generator(device).manual_seed(seed)
    scores, kls, lengths, judged = [], [], [], []
    for i in range(0, len(rows), cfg.batch_size):
        chunk = rows[i : i + cfg.batch_size]
        prompts = [row["prompt"] for row in chunk]
        queries, query_mask = (t.to(device) for t in encode_prompts(tokenizer, prompts, cfg.max_prompt_length))
        ro = sample(chunk, queries, query_mask, eval_generator)
        scores.append(ro.scores)
        kls.append(((ro.logprobs - ro.ref_logprobs) * ro.mask).sum(1))
        lengths.append(ro.mask.sum(1).float())
        if eval_reward is not None:
            P = ro.context_length
            texts, stopped = decode_responses(tokenizer, ro.query_responses, ro.attention_mask, P, stop_token_ids)
            judged.append(eval_reward(samples_of(tokenizer, chunk, texts), stopped))
    return {
        "eval/scores": torch.cat(scores).mean().item(),
        "eval/kl": torch.cat(kls).mean().item(),
        "eval/length_mean": torch.cat(lengths).mean().item(),
        **(eval_metrics(merged(judged)) if judged else {}),
    }


def check_collapse(
    action: str,
    monitor: CollapseMonitor,
    run: Run,
    step: int,
    metrics: dict[str, float],
    models: dict[str, PreTrainedModel],
) -> JobResult | None:
    """Judge ``step``'s metrics for collapse signals (unless ``action`` is "off"): a ``warning`` event for each;
    then with ``action`` "pause" the job ends paused at this step without checkpointing it (the returned result),
    with "stop" it fails (:class:`TrainingCollapseError`, also without that checkpoint). None: train on."""
    if action == "off" or not (alerts := monitor.update(step, metrics)):
        return None
    for alert in alerts:
        run.callbacks.on_event("warning", alert.message, alert.data())
    if action not in ("pause", "stop"):
        return None
    names = ", ".join(alert.signal for alert in alerts)
    reason = f"training collapse at step {step} ({names})"
    error = TrainingCollapseError(f"{reason}; collapse.action is stop") if action == "stop" else None
    return run.halt(step, metrics, models, reason, error)  # raises the error when given: the job fails


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
