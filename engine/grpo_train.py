"""Critic-free RL for language models: GRPO (Shao et al., arXiv:2402.03300) and its relatives, by
``advantage_estimator`` (engine/grpo.py).

One step = sample ``batch_size`` prompts, ``group_size`` responses each (each prompt prefilled once for its
group), score them with the job's reward (engine/graders.py: rules, functions, HTTP services, reward models),
turn the scores into advantages against the other samples of each prompt, then ``num_iterations`` passes of
minibatch updates of the clipped surrogate, with a KL pull to the starting policy as a loss term or in the reward.
No critic and no value model.

In several processes, each rolls out and scores its share of the prompts; the samples are gathered, so every rank
computes the advantages over the whole batch (as one process would), then trains on its share of every minibatch,
DDP averaging the gradients.
"""

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.callbacks import Callbacks
from engine.config import GRPOConfig, JobSpec
from engine.data import batch_indices, encode_prompts
from engine.distributed import Ranks
from engine.generate import Decoder, decode_warning, job_decoder, response_texts
from engine.graders import RewardScores, reward_metrics
from engine.grpo import aggregate, clipped_surrogate, tied_groups, token_advantages
from engine.loop import JobResult, Run, check_finite, clip_and_step, load_datasets, seed_everything
from engine.models import (
    check_fits,
    frozen,
    load_causal_lm,
    prepare,
    resolve_stop_token,
    token_logprobs,
)
from engine.ops import truncate_after_stop
from engine.ppo import kl_per_token
from engine.rewards import RewardFunction, eval_metrics, samples_of
from engine.rollout import base_of, logged_samples, sample_responses, samples_due

MB_STATS = ("pg", "kl", "clip", "akl")
"""Per-minibatch statistics: policy loss, KL loss term, clip fraction, approx-KL."""


@dataclass
class GroupRollout:
    """A step's samples, of the whole batch (every rank's rows), group by group."""

    query_responses: torch.Tensor
    """Prompt (left-padded) followed by response (right-padded): (N, P + T)."""
    attention_mask: torch.Tensor
    """1 on prompt and kept response tokens: (N, P + T)."""
    mask: torch.Tensor
    """1.0 on kept response tokens: (N, T)."""
    stopped: torch.Tensor
    """Whether each response produced the stop token: (N,)."""
    logprobs: torch.Tensor
    """The sampling policy's log-probs of the response tokens, 0 after the stop: (N, T)."""
    ref_logprobs: torch.Tensor
    """The reference's, the same where there is no reference (``kl_coef`` 0): (N, T)."""
    scores: torch.Tensor
    """The reward of each sample: (N,)."""
    components: torch.Tensor
    """Every named grader's score of each sample: (N, C), C in the order of the reward's components."""


def train_grpo(spec: JobSpec, out_dir: Path, callbacks: Callbacks, device: torch.device) -> JobResult:
    cfg = spec.config
    grader = spec.reward_grader
    assert isinstance(cfg, GRPOConfig) and grader is not None
    seed_everything(spec.seed)
    ranks = Ranks.current()
    G = cfg.group_size

    # Data: prompt rows (their other columns feed the graders); rank 0 evaluates
    rows, eval_rows = load_datasets(spec, "prompts", ranks)
    eval_rows = eval_rows[: cfg.eval_max_prompts]
    run = Run.open(spec, out_dir, callbacks, ranks, {"dataset": rows, "eval_dataset": eval_rows})
    tokenizer = run.tokenizer

    # Models: the trained policy, and the frozen reference (the starting policy; with LoRA the policy with its
    # adapters off; none when kl_coef is 0). Rewards: the graders, their reward models loaded once.
    def causal_lm(ref: str) -> PreTrainedModel:
        return prepare(load_causal_lm(ref, tokenizer, spec.seed), device, cfg.dtype, cfg.gradient_checkpointing)

    policy = run.load_trained("policy", spec.model, causal_lm, "CAUSAL_LM")
    ref_policy = frozen(causal_lm(spec.model)) if spec.lora is None and cfg.kl_coef > 0 else None
    limit = run.prompt_length(cfg.max_prompt_length, cfg.response_length, policy, [*rows, *eval_rows])
    cfg = cfg.model_copy(update={"max_prompt_length": limit})  # null: sized from the prompts and the context
    check_fits(policy, limit + cfg.response_length, "max_prompt_length + response_length")
    stop = callbacks.should_stop
    reward = RewardFunction(grader, tokenizer, device, cfg.dtype, stop)
    eval_reward = RewardFunction(spec.eval_reward, tokenizer, device, cfg.dtype, stop) if spec.eval_reward else reward
    stop_token_ids = resolve_stop_token(cfg.stop_token, policy, tokenizer)  # (): responses run to response_length
    params = [p for p in policy.parameters() if p.requires_grad]
    trained_policy = ranks.wrap(policy, compile=cfg.torch_compile)
    decoder = job_decoder(policy, cfg.cuda_graphs, limit, cfg.batch_size * G, device, warn=decode_warning(callbacks))
    if decoder is not None:
        run.at_end(decoder.close)

    start = run.start_training(cfg, cfg.total_steps, (params, cfg.learning_rate))
    if start.finished:
        return start.finished
    optimizer, scheduler = start.optimizer, start.scheduler
    generator = torch.Generator(device).manual_seed(spec.seed + 1_000_003 * ranks.rank)  # sampling, per rank
    shuffle = torch.Generator().manual_seed(spec.seed + 1)  # minibatch order, the same on every rank
    if state := start.state:
        generator.set_state(state["rank_generators"][ranks.rank] if ranks.world_size > 1 else state["generator"])
        shuffle.set_state(state["shuffle"])

    def trainer_state() -> dict[str, object]:
        state: dict[str, object] = {"generator": generator.get_state(), "shuffle": shuffle.get_state()}
        if ranks.world_size > 1:  # each rank samples from its own generator
            state["rank_generators"] = ranks.gather_objects(generator.get_state())
        return state

    def roll_out(batch_rows: list[dict[str, Any]], group: int, scorer: RewardFunction, gen: torch.Generator,
                 share: slice = slice(None)) -> tuple[GroupRollout, RewardScores]:  # fmt: skip
        return rollout(policy, ref_policy, tokenizer, batch_rows, share, group, scorer, cfg, stop_token_ids, gen,
                       device, decoder)  # fmt: skip

    N = cfg.batch_size * G  # samples per step
    for step in range(start.step + 1, cfg.total_steps + 1):
        t0 = time.perf_counter()
        # 1. rollout: each rank samples its share of the batch's prompts group_size times and scores the samples;
        #    the samples of every rank are then gathered, group by group
        batch_rows = [rows[i] for i in batch_indices(len(rows), cfg.batch_size, spec.seed, step - 1)]
        own, scored = roll_out(batch_rows, G, reward, generator, ranks.share(cfg.batch_size))
        ex = gather_samples(own, ranks, tokenizer.pad_token_id)
        components = RewardScores(ex.scores.tolist(), dict(zip(scored.components, ex.components.T.tolist(),
                                                                 strict=True)))  # fmt: skip
        t_rollout = time.perf_counter() - t0
        if samples_due(step, cfg.log_samples_every):  # what the policy says, kept every log_samples_every steps
            callbacks.on_samples(step, grpo_samples(tokenizer, ex, components, cfg.log_samples, stop_token_ids))

        # 2. advantages from each group's scores; the KL to the reference in the reward or as a loss term
        kl = kl_per_token(ex.logprobs, ex.ref_logprobs, cfg.kl_estimator) * ex.mask  # (N, T)
        in_reward = cfg.kl_coef > 0 and cfg.kl_as_reward
        advantages = token_advantages(ex.scores, ex.mask, G, cfg.advantage_estimator,
                                      kl=kl if in_reward else None, kl_coef=cfg.kl_coef)  # fmt: skip

        # 3. num_iterations passes over the samples in shuffled minibatches, one optimizer step each
        policy.train()
        stats: dict[str, list[float]] = {k: [] for k in (*MB_STATS, "gn")}
        for _ in range(cfg.num_iterations):
            order = torch.randperm(N, generator=shuffle)
            for first in range(0, N, cfg.mini_batch_size):
                mb_inds = order[first : first + cfg.mini_batch_size].to(device)
                mb = minibatch_gradients(trained_policy, ex, advantages, mb_inds, cfg, ranks)
                check_finite("loss", mb["pg"] + mb["kl"], step)
                mb["gn"] = clip_and_step(params, optimizer, cfg.max_grad_norm)
                for key, value in mb.items():
                    stats[key].append(value)
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()

        # 4. metrics, eval, step end
        elapsed = time.perf_counter() - t0
        metrics = reward_metrics(components)
        metrics.update({
            "objective/kl": kl.sum(1).mean().item(),
            "groups/tied_fraction": tied_groups(ex.scores, G).item(),
            "loss/policy": _mean(stats["pg"]),
            "loss/kl": _mean(stats["kl"]),
            "policy/clipfrac": _mean(stats["clip"]),
            "policy/approxkl": _mean(stats["akl"]),
            "response/length_mean": ex.mask.sum(1).mean().item(),
            "response/eos_fraction": ex.stopped.float().mean().item(),
            "time/rollout_s": t_rollout,
            "time/train_s": elapsed - t_rollout,
            "time/step_s": elapsed,
            "throughput/tokens_per_s": ex.mask.sum().item() / elapsed,
            "lr": lr,
            "grad_norm": _mean(stats["gn"]),
        })  # fmt: skip
        if decoder is not None:  # the share of this step's decoding steps that ran compiled
            metrics["rollout/compiled_fraction"] = decoder.compiled_fraction()
        if eval_rows and run.eval_due(step, cfg.eval_every):
            metrics.update(evaluate(roll_out, eval_rows, eval_reward, cfg, spec.seed, device))
        if result := run.end_step(step, metrics, {"policy": policy}, trainer_state):
            return result
    raise AssertionError("unreachable: the last step ends the run")


@torch.inference_mode()
def rollout(
    policy: PreTrainedModel,
    ref_policy: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    share: slice,
    group_size: int,
    reward: RewardFunction,
    cfg: GRPOConfig,
    stop_token_ids: Sequence[int],
    generator: torch.Generator,
    device: torch.device,
    decoder: Decoder | None = None,
) -> tuple[GroupRollout, RewardScores]:
    """``group_size`` samples of the prompts of ``rows[share]`` (this process's share of a batch), their log-probs
    under the policy (from sampling) and the reference, and their rewards. The whole batch's prompts are
    encoded together, so that every process's samples have the same width."""
    queries, query_mask = encode_prompts(tokenizer, [row["prompt"] for row in rows], cfg.max_prompt_length)
    queries, query_mask, rows = queries[share].to(device), query_mask[share].to(device), rows[share]
    policy.eval()
    raw, raw_logprobs = sample_responses(policy, queries, query_mask, cfg.response_length, cfg.temperature,
                                         cfg.top_k, stop_token_ids, generator, cfg.mini_batch_size, group_size,
                                         decoder)  # fmt: skip
    responses, mask, stopped = truncate_after_stop(raw, stop_token_ids, tokenizer.pad_token_id)
    P = queries.shape[1]
    query_responses = torch.cat([queries.repeat_interleave(group_size, 0), responses], dim=1)  # (N, P + T)
    attention_mask = torch.cat([query_mask.repeat_interleave(group_size, 0), mask], dim=1)
    logprobs = raw_logprobs * mask
    ref_logprobs = logprobs
    if cfg.kl_coef > 0:
        chunks = []
        for i in range(0, query_responses.shape[0], cfg.mini_batch_size):
            qr, am = query_responses[i : i + cfg.mini_batch_size], attention_mask[i : i + cfg.mini_batch_size]
            with base_of(policy) if ref_policy is None else nullcontext():
                chunks.append(token_logprobs(ref_policy or policy, qr, am, P, cfg.temperature)[0])
        ref_logprobs = torch.cat(chunks) * mask

    texts = response_texts(tokenizer, responses, mask, stop_token_ids)
    samples = samples_of(tokenizer, [row for row in rows for _ in range(group_size)], texts)
    scored = reward(samples, stopped.tolist())
    return (
        GroupRollout(
            query_responses=query_responses,
            attention_mask=attention_mask,
            mask=mask.float(),
            stopped=stopped,
            logprobs=logprobs,
            ref_logprobs=ref_logprobs,
            scores=torch.tensor(scored.total, dtype=torch.float32, device=device),
            components=torch.tensor(list(scored.components.values()), dtype=torch.float32, device=device).T,
        ),
        scored,
    )


def grpo_samples(
    tokenizer: PreTrainedTokenizerBase,
    ex: GroupRollout,
    scored: RewardScores,
    n: int,
    stop_token_ids: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """The first ``n`` samples of the batch (group by group) for :meth:`Callbacks.on_samples`, with each reward
    component of ``scored`` (the whole batch's) and their ``total``."""
    rewards = {**scored.components, "total": scored.total}
    P = ex.query_responses.shape[1] - ex.mask.shape[1]
    return logged_samples(
        tokenizer, ex.query_responses, ex.attention_mask, P, ex.logprobs, ex.ref_logprobs, rewards, n, stop_token_ids
    )


def gather_samples(ex: GroupRollout, ranks: Ranks, pad_token_id: int) -> GroupRollout:
    """Every rank's samples in rank order (prompt groups stay whole): the whole batch, on every rank. Responses are
    first padded to the longest of any rank."""
    if ranks.world_size == 1:
        return ex
    extra = ranks.max(ex.mask.shape[1]) - ex.mask.shape[1]
    if extra:
        padding = {"query_responses": pad_token_id, "attention_mask": 0, "mask": 0, "logprobs": 0, "ref_logprobs": 0}
        ex = replace(ex, **{k: F.pad(getattr(ex, k), (0, extra), value=v) for k, v in padding.items()})
    return GroupRollout(**{f.name: ranks.gather(getattr(ex, f.name)) for f in fields(ex)})


def minibatch_gradients(
    trained_policy: torch.nn.Module,
    ex: GroupRollout,
    advantages: torch.Tensor,
    mb_inds: torch.Tensor,
    cfg: GRPOConfig,
    ranks: Ranks,
) -> dict[str, float]:
    """Forward and backward of the minibatch of samples ``mb_inds`` (per process: its share of them), in
    micro-batches accumulating gradients: the clipped surrogate, plus β·KL to the reference when the KL is a loss
    term, aggregated over the whole minibatch by ``cfg.aggregation``. Returns :data:`MB_STATS` summed over the
    micro-batches and the ranks; the optimizer step is the caller's."""
    mask, device = ex.mask, ex.mask.device
    P = ex.query_responses.shape[1] - mask.shape[1]
    n_tokens, n_seqs = mask[mb_inds].sum(), len(mb_inds)
    own_inds = mb_inds[ranks.share(cfg.mini_batch_size)]
    mbs = cfg.micro_batch_size // ranks.world_size
    kl_loss_coef = cfg.kl_coef if cfg.kl_coef > 0 and not cfg.kl_as_reward else 0.0

    def total(per_token: torch.Tensor, mk: torch.Tensor) -> torch.Tensor:
        return aggregate(per_token, mk, cfg.aggregation, n_seqs, n_tokens, cfg.response_length)

    mb_stats = torch.zeros(len(MB_STATS), device=device)
    for u in range(0, len(own_inds), mbs):
        inds = own_inds[u : u + mbs]
        last = u + mbs >= len(own_inds)
        mk = mask[inds]
        with ranks.no_sync(trained_policy, last):
            logprobs, _ = token_logprobs(trained_policy, ex.query_responses[inds], ex.attention_mask[inds],
                                            P, cfg.temperature)  # fmt: skip
            per_token, clipped = clipped_surrogate(logprobs, ex.logprobs[inds], advantages[inds],
                                                   cfg.cliprange_low, cfg.cliprange_high)  # fmt: skip
            pg_loss = total(per_token, mk)
            kl_loss = torch.zeros((), device=device)
            if kl_loss_coef:
                kl_loss = total(kl_per_token(logprobs, ex.ref_logprobs[inds], cfg.kl_estimator), mk)
            ((pg_loss + kl_loss_coef * kl_loss) * ranks.loss_scale).backward()
        with torch.no_grad():
            log_ratio = logprobs.detach() - ex.logprobs[inds]
            clipfrac = (clipped * mk).sum() / n_tokens
            approxkl = (0.5 * log_ratio**2 * mk).sum() / n_tokens
        mb_stats += torch.stack([pg_loss.detach(), kl_loss.detach(), clipfrac, approxkl]).float()
    return dict(zip(MB_STATS, ranks.sum(mb_stats).tolist(), strict=True))


@torch.no_grad()
def evaluate(
    roll_out: Any, rows: list[dict[str, Any]], reward: RewardFunction, cfg: GRPOConfig, seed: int, device: torch.device
) -> dict[str, float]:
    """Each held-out prompt sampled once, from its own fixed seed (training RNG untouched), scored by ``reward``:
    ``eval/reward`` (the mean), ``eval/reward/<name>`` per component, ``eval/length_mean``."""
    generator = torch.Generator(device).manual_seed(seed)
    totals: list[float] = []
    components: dict[str, list[float]] = {}
    lengths = []
    for i in range(0, len(rows), cfg.batch_size):
        ex, scored = roll_out(rows[i : i + cfg.batch_size], 1, reward, generator)
        totals += scored.total
        for name, values in scored.components.items():
            components.setdefault(name, []).extend(values)
        lengths.append(ex.mask.sum(1))
    metrics = eval_metrics(RewardScores(totals, components))
    metrics["eval/length_mean"] = torch.cat(lengths).mean().item()
    return metrics


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
