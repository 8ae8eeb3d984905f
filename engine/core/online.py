"""What the online methods (PPO, GRPO and its relatives, distillation) share around the :class:`Learner`: opening
the policy, rolling out a batch's prompt rows, the sampling and shuffling generators, held-out evaluation, and
PPO's critic with the scorer of its reward.
"""

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.callbacks import Callbacks
from engine.core.data import batch_indices, encode_prompts
from engine.core.distributed import Ranks
from engine.core.generate import decode_warning, job_decoder
from engine.core.learner import Learner, LossInputs, Objective, Reference, Sampling, accumulate, mean
from engine.core.loop import Run, Start, load_datasets, seed_everything
from engine.core.models import (
    check_fits,
    frozen,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    merged_state_dict,
    prepare,
    resolve_stop_token,
)
from engine.core.rollout import Rollout, Scorer, decode_responses, merged, roll_out, text_scorer, token_scorer
from engine.core.vllm import RolloutEngineError, VllmSampler, start_sampler
from engine.rewards.function import RewardFunction, eval_metrics, grader_scorer, samples_of
from engine.rewards.graders import ModelGrader, RewardScores, Samples
from engine.rewards.reward_model import same_vocabulary
from engine.spec.config import GroupSamplingConfig, JobSpec, PPOConfig, SamplingConfig

Reward = Callable[[Samples, Sequence[bool]], RewardScores]
"""A reward of graders (:class:`engine.rewards.function.RewardFunction`)."""


OnlineConfig = PPOConfig | GroupSamplingConfig
"""The configs of the online methods (PPO; GRPO and its relatives, distillation): what :func:`open_policy` reads."""


def open_policy(
    run: Run,
    cfg: OnlineConfig,
    device: torch.device,
    prompt_rows: list[dict[str, Any]],
    reference: bool,
    rows_per_rollout: int,
) -> tuple[Learner, int]:
    """The :class:`Learner` of an online method's policy: the trained policy (restored when resuming), its
    reference when ``reference`` (a frozen copy of the starting policy; with LoRA the policy with its adapters off),
    its stop tokens, and the job's compiled decoder for ``rows_per_rollout`` samples at a time (CUDA only); and the
    prompt length the job keeps: ``max_prompt_length``, sized from ``prompt_rows`` and the model's context where it
    is null."""
    spec, tokenizer = run.spec, run.tokenizer

    def causal_lm(ref: str) -> PreTrainedModel:
        return prepare(load_causal_lm(ref, tokenizer, spec.seed), device, cfg.dtype, cfg.gradient_checkpointing)

    policy = run.load_trained("policy", spec.model, causal_lm, "CAUSAL_LM")
    ref_policy: Reference = None
    if reference:
        ref_policy = frozen(causal_lm(spec.model)) if spec.lora is None else "base"
    limit = run.prompt_length(cfg.max_prompt_length, cfg.response_length, policy, prompt_rows)
    check_fits(policy, limit + cfg.response_length, "max_prompt_length + response_length")
    stop_token_ids = resolve_stop_token(cfg.stop_token, policy, tokenizer)  # (): responses run to response_length
    sampling = Sampling(cfg.response_length, cfg.temperature, cfg.top_k, stop_token_ids)
    vllm = cfg.rollout_engine == "vllm"
    decoder = None if vllm else job_decoder(policy, cfg.cuda_graphs, limit, rows_per_rollout, device,
                                            warn=decode_warning(run.callbacks))  # fmt: skip
    if decoder is not None:
        run.at_end(decoder.close)
    learner = Learner(policy, run.ranks, sampling, cfg.mini_batch_size, ref_policy, cfg.torch_compile, decoder)
    if vllm:
        learner.rollout = open_rollout_engine(run, cfg, policy, limit + cfg.response_length)
    return learner, limit


def open_rollout_engine(run: Run, cfg: OnlineConfig, policy: PreTrainedModel, max_model_len: int) -> VllmSampler:
    """The job's vLLM sampler (``rollout_engine: vllm``), on the server the worker's settings name, closed when the
    job ends; its folders (the weights it reloads, the adapters it loads, the server's log) under ``rollout/``."""
    settings = run.callbacks.vllm()
    if settings is None:
        raise RolloutEngineError(
            "hyperparameters.rollout_engine is vllm, and this worker has no vLLM: set RLHF_VLLM_PYTHON (the python "
            "of an environment with vLLM installed) or RLHF_VLLM_URL (a running vLLM server) on the worker"
        )
    lora_rank = run.spec.lora.r if run.spec.lora is not None else None
    base_state = merged_state_dict(policy, adapters=False) if lora_rank is not None else None
    started = time.monotonic()
    if settings.url is None:  # a minute or so: vLLM loads the model, profiles it and warms up
        run.callbacks.on_event(
            "info",
            f"starting vLLM ({settings.python}); it may take a minute or two",
            {"python": settings.python, "start_timeout": settings.start_timeout},
        )
    sampler = start_sampler(settings, policy, run.tokenizer, run.out_dir / "rollout", max_model_len,
                            cfg.sync_max_gap, lora_rank, base_state)  # fmt: skip
    run.at_end(sampler.close)
    if settings.url is None:
        seconds = round(time.monotonic() - started, 1)
        run.callbacks.on_event("info", f"vLLM answered after {seconds:g} s", {"seconds": seconds})
    return sampler


@torch.inference_mode()
def roll_out_rows(
    learner: Learner,
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int | None,
    scorer: Scorer,
    rows: Sequence[dict[str, Any]],
    generator: torch.Generator,
    group_size: int = 1,
    critic: PreTrainedModel | None = None,
    share: slice = slice(None),
    trainer_logprobs: bool = False,
) -> tuple[Rollout, RewardScores | None]:
    """:func:`roll_out` of the prompts of ``rows[share]`` (a process's share of a batch). The whole batch's prompts
    are encoded together, so that every process's rollout has the same prompt width. ``trainer_logprobs``: the
    trainer's log-probs taken again, the sampler's kept (for ``rollout_correction``)."""
    queries, query_mask = encode_prompts(tokenizer, [row["prompt"] for row in rows], max_prompt_length)
    device = learner.model.device
    queries, query_mask = queries[share].to(device), query_mask[share].to(device)
    return roll_out(learner, rows[share], queries, query_mask, generator, scorer, tokenizer.pad_token_id,
                    group_size, critic, trainer_logprobs)  # fmt: skip


class RolloutRNG:
    """An online method's generators: ``sampling`` (one per rank) and ``shuffle`` (the minibatch order, the same
    on every rank), restored from a checkpoint's trainer state; and the prompt order, a function of the seed."""

    def __init__(self, seed: int, ranks: Ranks, device: torch.device, state: dict[str, Any] | None) -> None:
        self.seed, self.ranks = seed, ranks
        self.sampling = torch.Generator(device).manual_seed(seed + 1_000_003 * ranks.rank)
        self.shuffle = torch.Generator().manual_seed(seed + 1)
        if state:
            sampling = state["rank_generators"][ranks.rank] if ranks.world_size > 1 else state["generator"]
            self.sampling.set_state(sampling)
            self.shuffle.set_state(state["shuffle"])

    @classmethod
    def start(
        cls,
        learner: Learner,
        run: Run,
        cfg: OnlineConfig,
        seed: int,
        device: torch.device,
        *more: tuple[list[torch.nn.Parameter], float],
    ) -> tuple[Start, "RolloutRNG"]:
        """Where an online job's loop starts: :meth:`Learner.start_training` over ``cfg.total_steps`` (``more``: other
        parameter groups, e.g. a critic's), and the generators, both restored when resuming."""
        start = learner.start_training(run, cfg, cfg.total_steps, *more)
        return start, cls(seed, run.ranks, device, start.state)

    def prompt_batches(
        self, rows: list[dict[str, Any]], cfg: OnlineConfig, done: int
    ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """Each step after the ``done`` ones, to ``cfg.total_steps``, with its ``cfg.batch_size`` prompt rows: a
        function of (seed, step) alone (:func:`engine.core.data.batch_indices`), so a resumed job goes on in the same
        order."""
        for step in range(done + 1, cfg.total_steps + 1):
            yield step, [rows[i] for i in batch_indices(len(rows), cfg.batch_size, self.seed, step - 1)]

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of them (called on every rank: it gathers the ranks' sampling states)."""
        state: dict[str, Any] = {"generator": self.sampling.get_state(), "shuffle": self.shuffle.get_state()}
        if self.ranks.world_size > 1:
            state["rank_generators"] = self.ranks.gather_objects(self.sampling.get_state())
        return state


HeldOutRoll = Callable[[Sequence[dict[str, Any]], torch.Generator], tuple[Rollout, RewardScores | None]]
"""Rolls out held-out prompt rows once each: (the rows, the generator) -> their rollout and reward scores."""


@torch.no_grad()
def held_out(
    roll: HeldOutRoll, rows: Sequence[dict[str, Any]], batch_size: int, seed: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], RewardScores | None]:
    """Held-out prompts, ``batch_size`` at a time, sampled as in training but from their own fixed seed (training
    RNG untouched): each sample's ``scores``, ``kl`` (summed log-ratio to the reference) and ``length``, and
    their reward scores (None when ``roll`` gives none)."""
    generator = torch.Generator(device).manual_seed(seed)
    scores, kls, lengths, graded = [], [], [], []
    for i in range(0, len(rows), batch_size):
        ro, scored = roll(rows[i : i + batch_size], generator)
        scores.append(ro.scores)
        kls.append(((ro.logprobs - ro.ref_logprobs) * ro.mask).sum(1))
        lengths.append(ro.mask.sum(1).float())
        if scored is not None:
            graded.append(scored)
    per_sample = {"scores": torch.cat(scores), "kl": torch.cat(kls), "length": torch.cat(lengths)}
    return per_sample, merged(graded) if graded else None


def evaluate(
    roll: HeldOutRoll,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict[str, Any]],
    batch_size: int,
    seed: int,
    device: torch.device,
    eval_reward: Reward | None = None,
    stop_token_ids: Sequence[int] = (),
) -> dict[str, float]:
    """Held-out prompts, ``batch_size`` at a time, sampled as in training but from their own fixed seed (training
    RNG untouched): the mean score of the rollout's scorer ``eval/scores``, ``eval/kl`` (to the reference),
    ``eval/length_mean``; with ``eval_reward``, their samples scored by it too (``eval/reward`` and its
    components), or else by the rollout's scorer when that is a reward of graders."""

    def judged(chunk: Sequence[dict[str, Any]], generator: torch.Generator) -> tuple[Rollout, RewardScores | None]:
        ro, graded = roll(chunk, generator)
        if eval_reward is None:
            return ro, graded
        texts, stopped = decode_responses(tokenizer, ro.tokens, stop_token_ids)
        return ro, eval_reward(samples_of(tokenizer, chunk, texts), stopped)

    per_sample, scored = held_out(judged, rows, batch_size, seed, device)
    return {
        "eval/scores": per_sample["scores"].mean().item(),
        "eval/kl": per_sample["kl"].mean().item(),
        "eval/length_mean": per_sample["length"].mean().item(),
        **(eval_metrics(scored) if scored else {}),
    }


def critic_and_scorer(
    run: Run, cfg: PPOConfig, device: torch.device, stop_token_ids: Sequence[int]
) -> tuple[PreTrainedModel, Scorer]:
    """The trained critic (restored when resuming) and the scorer of the job's reward.

    A reward model of the policy's vocabulary scores the sampled tokens, and the critic starts as that reward
    model (PPO-max); with LoRA the reward model is the critic's own base with its adapters disabled. A reward
    model of another vocabulary scores the decoded text with its own tokenizer, and the critic then starts from
    the policy's backbone; so does it for a reward of graders (rules, functions, services), which score the text.
    """
    spec, tokenizer, callbacks = run.spec, run.tokenizer, run.callbacks
    # a reward model (reward_model, or a reward of one model grader) scores tokens; other rewards score text
    reward_ref = spec.reward_model or (spec.reward.model if isinstance(spec.reward, ModelGrader) else None)
    reward_tokenizer = load_tokenizer(reward_ref) if reward_ref else None

    def scalar_model(ref: str, tokenizer: PreTrainedTokenizerBase = tokenizer, trained_head: bool = True) -> (
        PreTrainedModel
    ):  # fmt: skip
        model = load_scalar_model(ref, tokenizer, spec.seed, trained_head)
        return prepare(model, device, cfg.dtype, cfg.gradient_checkpointing)

    if reward_ref is not None and reward_tokenizer is not None and same_vocabulary(tokenizer, reward_tokenizer):
        value_model = run.load_trained("value", reward_ref, scalar_model, "SEQ_CLS")
        reward_model = frozen(scalar_model(reward_ref)) if spec.lora is None else None
        return value_model, token_scorer(reward_model, value_model, cfg.mini_batch_size)
    value_model = run.load_trained("value", spec.model, lambda ref: scalar_model(ref, trained_head=False), "SEQ_CLS")
    if reward_ref is None:
        assert spec.reward_grader is not None
        grader = RewardFunction(spec.reward_grader, tokenizer, device, cfg.dtype, callbacks)
        return value_model, grader_scorer(grader, tokenizer, stop_token_ids)
    assert reward_tokenizer is not None
    reward_model = frozen(scalar_model(reward_ref, reward_tokenizer))
    callbacks.on_event(
        "info",
        "the reward model's tokenizer differs from the policy's: responses are scored as text, re-encoded by "
        "the reward model's tokenizer, and the critic starts from the policy",
        {"reward_model": spec.reward_model},
    )
    return value_model, text_scorer(reward_model, reward_tokenizer, tokenizer, stop_token_ids, cfg.mini_batch_size)


def open_prompts(
    spec: JobSpec,
    out_dir: Path,
    callbacks: Callbacks,
    more: dict[str, list[dict[str, Any]]] | None = None,
) -> tuple[Run, list[dict[str, Any]], list[dict[str, Any]]]:
    """Seed, and open the run of an online job and its prompt rows: ``dataset``'s, and rank 0's first
    ``eval_max_prompts`` of ``eval_dataset`` (none elsewhere). ``more``: other rows the run checks, by the spec
    field that names them."""
    assert isinstance(spec.config, SamplingConfig)
    seed_everything(spec.seed)
    # several processes: each rolls out and trains on its share of every batch (with FSDP: holding a shard)
    ranks = Ranks.current(spec.resources.sharding, spec.resources.cpu_offload)
    rows, eval_rows = load_datasets(spec, "prompts", ranks)
    eval_rows = eval_rows[: spec.config.eval_max_prompts]
    run = Run.open(spec, out_dir, callbacks, ranks, {"dataset": rows, "eval_dataset": eval_rows, **(more or {})})
    return run, rows, eval_rows


POLICY_STATS = ("policy", "kl", "clipfrac", "approx_kl")
"""Per-minibatch statistics of a policy update: policy loss, KL loss term, clip fraction, approx-KL."""


def policy_gradients(
    learner: Learner,
    ro: Rollout,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    objective: Objective,
    cfg: GroupSamplingConfig,
    mb_inds: torch.Tensor,
    update: int,
) -> dict[str, float]:
    """Forward and backward of the minibatch of samples ``mb_inds`` (per process: its share of them; ``update``,
    its number in the step, plays no part), in micro-batches accumulating gradients: ``objective`` aggregated over
    the whole minibatch. Returns :data:`POLICY_STATS` summed over the micro-batches and the ranks; the optimizer
    step is the caller's."""
    ranks = learner.ranks
    n_tokens, n_sequences = mask[mb_inds].sum(), len(mb_inds)
    own = mb_inds[ranks.share(cfg.mini_batch_size)]

    def micro(part: slice, last: bool) -> dict[str, torch.Tensor]:
        inds = own[part]
        sampler = None if ro.sampler_logprobs is None else ro.sampler_logprobs[inds]
        inputs = LossInputs(ro.logprobs[inds], advantages[inds], mask[inds], n_sequences, n_tokens,
                            ro.ref_logprobs[inds], sampler)  # fmt: skip
        return learner.forward_backward(ro.tokens.rows(inds), objective, inputs, last)

    return accumulate(len(own), cfg.micro_batch_size // ranks.world_size, POLICY_STATS, micro, ranks, mask.device)


def update_metrics(
    ro: Rollout, mask: torch.Tensor, stats: dict[str, list[float]], lr: float, t_rollout: float, elapsed: float
) -> dict[str, float]:
    """The metrics every group-sampling step reports of its update, responses and timings."""
    return {
        "loss/policy": mean(stats["policy"]),
        "policy/clipfrac": mean(stats["clipfrac"]),
        "policy/approxkl": mean(stats["approx_kl"]),
        "response/length_mean": mask.sum(1).mean().item(),
        "response/eos_fraction": ro.stopped.float().mean().item(),
        "time/rollout_s": t_rollout,
        "time/train_s": elapsed - t_rollout,
        "time/step_s": elapsed,
        "throughput/tokens_per_s": mask.sum().item() / elapsed,
        "lr": lr,
        "grad_norm": mean(stats["grad_norm"]),
    }
