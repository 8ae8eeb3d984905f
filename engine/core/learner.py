"""The engine's training operations on one object, the :class:`Learner`: ``forward`` (log-probs of given tokens),
``forward_backward`` (a named policy loss and its inputs, one micro-batch), ``optim_step``, ``sample``,
``save_state`` / ``load_state``. Every training loop uses them, and so does the Tinker-compatible API.

Beside it, the two drivers every loop shares: :func:`accumulate` (a minibatch as micro-batches, gradients
accumulated, statistics summed over micro-batches and ranks) and :func:`run_updates` (passes over a batch in
shuffled minibatches, one optimizer step each, cut short when a statistic passes its limit).
"""

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import PreTrainedModel

from engine.core.distributed import Ranks
from engine.core.generate import Decoder, sample
from engine.core.loop import Run, Start, check_finite, clip_and_step
from engine.core.models import folded_adapters, rounds_when_folded, token_logprobs
from engine.core.ops import aggregate, kl_per_token
from engine.core.vllm import VllmSampler
from engine.spec.config import TrainConfig
from engine.spec.policy_losses import POLICY_LOSSES, Aggregation, LossBatch, LossSettings, rollout_correction

Reference = PreTrainedModel | Literal["base"] | None
"""A policy's reference: a frozen model, ``"base"`` (a LoRA policy with its adapters disabled), or none."""


@dataclass
class Tokens:
    """Sequences whose tokens from ``context_length`` on are the ones scored and trained: prompts left-padded,
    responses right-padded."""

    query_responses: torch.Tensor
    """(N, P + T)."""
    attention_mask: torch.Tensor
    """1 on prompt and kept response tokens: (N, P + T)."""
    context_length: int
    """P, where the responses start."""

    def __len__(self) -> int:
        return self.query_responses.shape[0]

    def rows(self, index: torch.Tensor | slice) -> "Tokens":
        return Tokens(self.query_responses[index], self.attention_mask[index], self.context_length)


@dataclass(frozen=True)
class Objective:
    """A named policy loss (:data:`engine.spec.policy_losses.POLICY_LOSSES`) and how a minibatch reduces it."""

    loss: str
    settings: LossSettings
    aggregation: Aggregation = "token_mean"
    max_tokens: int | None = None
    """Response length, for the ``constant`` aggregation."""
    kl_coef: float = 0.0
    """β of a KL-to-the-reference loss term (0: none)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy: bool = False
    """Whether to measure the entropy of the policy (``entropy``)."""
    entropy_coef: float = 0.0
    """The entropy bonus's weight in the loss (0: measured only)."""


@dataclass
class LossInputs(LossBatch):
    """A micro-batch's inputs to an :class:`Objective`: the policy loss's (``old_logprobs``, ``advantages``,
    ``mask``, each (n, T)) and the aggregation's."""

    n_sequences: int
    """Sequences of the whole minibatch (every rank's): the aggregation's divisor."""
    n_tokens: torch.Tensor
    """Kept tokens of the whole minibatch."""
    ref_logprobs: torch.Tensor | None = None
    """The reference's log-probs, for the KL loss term."""
    sampler_logprobs: torch.Tensor | None = None
    """The sampler's log-probs, when ``old_logprobs`` are the trainer's: for the objective's ``rollout_correction``,
    which weights each token's policy loss by min(π_old/π_sampler, cap)."""


def base_of(model: PreTrainedModel) -> AbstractContextManager[None]:
    """Within this block a LoRA model computes as its frozen base model."""
    return model.disable_adapter()  # type: ignore[operator]


def chunks(n: int, size: int) -> list[slice]:
    return [slice(i, i + size) for i in range(0, n, size)]


@torch.inference_mode()
def sequence_logprobs(model: torch.nn.Module, batch: Tokens, temperature: float, chunk_size: int) -> torch.Tensor:
    """Log-probs (N, T) of ``batch``'s response tokens under ``model``, ``chunk_size`` rows per forward."""
    ids, attention, P = batch.query_responses, batch.attention_mask, batch.context_length
    return torch.cat(
        [token_logprobs(model, ids[c], attention[c], P, temperature)[0] for c in chunks(len(batch), chunk_size)]
    )


def completion_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed cross-entropy of every labelled (completion) token; divide by the token count yourself. ``model``:
    a causal LM, or one wrapped in DistributedDataParallel. The logits are made in chunks
    (:func:`engine.core.models.token_logprobs`)."""
    logprobs, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], start=1)  # (B, L-1)
    return -torch.where(batch["labels"][:, 1:] != -100, logprobs, 0.0).sum()


def count_labels(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


@dataclass(frozen=True)
class Sampling:
    """How a policy samples: response length, temperature, top-k, the stop tokens (none: run to the length)."""

    response_length: int
    temperature: float
    top_k: int = 0
    stop_token_ids: Sequence[int] = ()


class Learner:
    """A trained causal LM and its operations. ``trained`` is what gradients flow through (DistributedDataParallel
    with several processes, compiled with ``compile``); sampling, evaluation and checkpoints use ``model``."""

    def __init__(
        self,
        model: PreTrainedModel,
        ranks: Ranks,
        sampling: Sampling | None = None,
        chunk_size: int = 64,
        reference: Reference = None,
        compile: bool = False,
        decoder: Decoder | None = None,
        head: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.ranks = ranks
        self.sampling = sampling or Sampling(response_length=1, temperature=1.0)
        """How :meth:`sample` samples (and the temperature of the log-probs)."""
        self.temperature = self.sampling.temperature
        self.chunk_size = chunk_size
        """Rows per no-grad forward."""
        self.reference = reference
        if isinstance(reference, torch.nn.Module):
            ranks.shard(reference)  # with FSDP a frozen reference is sharded too
        self.decoder = decoder
        self.trained = ranks.wrap(head or model, compile=compile)
        """What training passes run through: ``model`` or its ``head`` (a scalar model's
        :class:`engine.core.models.ScalarHead`), in DistributedDataParallel with several processes."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.also_trained: dict[str, torch.nn.Module] = {}
        """Other modules the optimizer trains, by name (PPO's critic): a sharded checkpoint names their optimizer
        state too."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.max_grad_norm: float | None = None
        self._clipped: list[torch.nn.Parameter] = self.params
        self.updates = 0
        """Optimizer steps taken in this process (a rollout engine syncs the weights when it changed)."""
        self.rollout: VllmSampler | None = None
        """The rollout engine :meth:`sample` samples on instead of the trainer's own sampler (``rollout_engine:
        vllm``): it gets the weights pushed before it samples a changed policy."""

    def gathered(self) -> AbstractContextManager[None]:
        """:meth:`Ranks.gathered` of the policy and its frozen reference: within it one rank may compute alone."""
        frozen = (self.reference,) if isinstance(self.reference, torch.nn.Module) else ()
        return self.ranks.gathered(self.trained, *frozen)

    def start_training(
        self, run: Run, cfg: TrainConfig, total_steps: int, *more: tuple[list[torch.nn.Parameter], float]
    ) -> Start:
        """AdamW over the policy's parameters at ``cfg.learning_rate`` and ``more`` groups (e.g. a critic's), the
        schedule, both restored when resuming (:meth:`engine.core.loop.Run.start_training`); :meth:`optim_step` clips
        the norm of all of them together."""
        also = self.also_trained
        run.trained_module = torch.nn.ModuleDict({"policy": self.trained, **also}) if also else self.trained
        start = run.start_training(cfg, total_steps, (self.params, cfg.learning_rate), *more)
        self.use_optimizer(start.optimizer, start.scheduler, cfg.max_grad_norm)
        return start

    def use_optimizer(
        self, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
        max_grad_norm: float | None = None,
    ) -> None:  # fmt: skip
        """Train with an optimizer made by the caller (a training session's AdamW, whose hyperparameters each step
        sets) rather than :meth:`start_training`'s."""
        self.optimizer, self.scheduler, self.max_grad_norm = optimizer, scheduler, max_grad_norm
        self._clipped = [p for group in optimizer.param_groups for p in group["params"]]

    def schedule(self) -> float:
        """At a step's end: the learning rate it trained at; the schedule then moves on."""
        assert self.scheduler is not None
        lr = self.lr
        self.scheduler.step()
        return lr

    @property
    def lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])

    # -- operations ---------------------------------------------------------------------------------------------

    def forward(self, batch: Tokens, reference: bool = False) -> torch.Tensor:
        """Log-probs (N, T) of ``batch``'s response tokens under the policy, or its reference, without a graph."""
        if not reference:
            return sequence_logprobs(self.model, batch, self.temperature, self.chunk_size)
        if self.reference is None:
            raise ValueError("this policy has no reference")
        with base_of(self.model) if self.reference == "base" else nullcontext():
            model = self.model if self.reference == "base" else self.reference
            return sequence_logprobs(model, batch, self.temperature, self.chunk_size)

    def forward_backward(
        self, batch: Tokens, objective: Objective, inputs: LossInputs, last: bool = True, grad: bool = True
    ) -> dict[str, torch.Tensor]:
        """One micro-batch: the policy's log-probs of ``batch`` through the trained module, ``objective``'s loss
        (plus β·KL, less the entropy bonus) backpropagated when ``grad`` (gradients accumulate; with several
        processes they are averaged after the ``last`` micro-batch). Returns the detached statistics: ``policy`` (the
        policy loss), ``kl`` (the KL term, with one), ``entropy`` (the entropy, when measured), ``clipfrac`` (clip
        fraction), ``approx_kl`` (approx-KL to the sampling policy, ½ E[log ratio²]), each this micro-batch's share of
        the minibatch's. With the settings' ``rollout_correction``, each token's policy loss is weighted by its
        truncated importance weight (:func:`engine.spec.policy_losses.rollout_correction`) before the aggregation."""
        mask, n_tokens = inputs.mask, inputs.n_tokens
        entropy_in_loss = grad and objective.entropy_coef > 0
        ids, attention, P = batch.query_responses, batch.attention_mask, batch.context_length
        with self.ranks.no_sync(self.trained, last), torch.set_grad_enabled(grad):
            logprobs, token_entropy = token_logprobs(
                self.trained,
                ids,
                attention,
                P,
                self.temperature,
                entropy=objective.entropy,
                entropy_grad=entropy_in_loss,
            )
            out = POLICY_LOSSES[objective.loss](logprobs, inputs, objective.settings)
            per_token, cap = out.per_token, objective.settings.rollout_correction
            if cap is not None:  # truncated importance sampling of the sampler's mismatch, for every loss
                if inputs.sampler_logprobs is None:
                    raise ValueError("rollout_correction needs the sampler's log-probs (LossInputs.sampler_logprobs)")
                per_token, _ = rollout_correction(per_token, inputs.old_logprobs, inputs.sampler_logprobs, cap)
            pg_loss = aggregate(per_token, mask, objective.aggregation, inputs.n_sequences, n_tokens,
                                objective.max_tokens)  # fmt: skip
            loss, stats = pg_loss, {"policy": pg_loss}
            if objective.kl_coef > 0:
                assert inputs.ref_logprobs is not None
                kl_terms = kl_per_token(logprobs, inputs.ref_logprobs, objective.kl_estimator)
                stats["kl"] = aggregate(kl_terms, mask, objective.aggregation, inputs.n_sequences, n_tokens,
                                        objective.max_tokens)  # fmt: skip
                loss = loss + objective.kl_coef * stats["kl"]
            if token_entropy is not None:
                stats["entropy"] = (token_entropy * mask).sum() / n_tokens
                if entropy_in_loss:
                    loss = loss - objective.entropy_coef * stats["entropy"]
            if grad:
                (loss * self.ranks.loss_scale).backward()
        with torch.no_grad():
            log_ratio = logprobs.detach() - inputs.old_logprobs
            stats["clipfrac"] = (out.clipped * mask).sum() / n_tokens
            stats["approx_kl"] = (0.5 * log_ratio**2 * mask).sum() / n_tokens
        return {name: value.detach() for name, value in stats.items()}

    def sft_backward(self, batch: dict[str, torch.Tensor], n_tokens: int, coef: float = 1.0, last: bool = True) -> (
        torch.Tensor
    ):  # fmt: skip
        """One micro-batch of next-token loss on ``batch``'s labelled tokens (``input_ids``, ``attention_mask``,
        ``labels``), divided by ``n_tokens`` (the whole batch's label count) and weighted by ``coef``,
        backpropagated. Returns the detached sum of the token losses."""
        with self.ranks.no_sync(self.trained, last):
            loss_sum = completion_loss_sum(self.trained, batch)
            (self.ranks.loss_scale * coef * (loss_sum / n_tokens)).backward()
        return loss_sum.detach()

    def optim_step(self) -> float:
        """Clip the global gradient norm (of every parameter the optimizer holds), step, clear the gradients;
        returns the norm before clipping."""
        assert self.optimizer is not None, "start_training first"
        norm = clip_and_step(self._clipped, self.optimizer, self.max_grad_norm)
        self.updates += 1
        return norm

    @torch.inference_mode()
    def sample(
        self,
        queries: torch.Tensor,
        query_mask: torch.Tensor,
        generator: torch.Generator,
        group_size: int = 1,
        retake: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``group_size`` responses to each query (B, P) with their log-probs: raw tokens and log-probs (B·G, T),
        as :func:`engine.core.generate.sample` gives them (tokens after a stop are junk for the caller to truncate).

        LoRA adapters are folded into the weights for the sampling (the full model's speed). Where folding rounds
        them (half-precision weights, :func:`engine.core.models.rounds_when_folded`), the log-probs of the sampled
        tokens are taken again by the training pass itself (adapters unfused): PPO's old log-probs, ratio,
        approx-KL and KL then agree with the update's. That is one forward over the sampled tokens, where decoding
        unfused pays the adapters' kernels at every token. Not ``retake``: the sampler's own log-probs always (a
        caller that takes the training pass's itself, for ``rollout_correction``).

        With a rollout engine (:attr:`rollout`) the samples and their log-probs are the engine's, the policy's
        weights pushed to it first if they changed since its last sync; the caller takes the training pass's."""
        s = self.sampling
        if self.rollout is not None:
            return self.rollout.sample(self.updates, queries, query_mask, generator, group_size, s.response_length,
                                       s.temperature, s.top_k, s.stop_token_ids)  # fmt: skip
        self.model.eval()
        # sharded (FSDP): every rank gathers the weights, then decodes its share alone, as long as it takes
        with self.ranks.gathered(self.model), folded_adapters(self.model, rounded=True):
            raw, logprobs = sample(self.model, queries, query_mask, s.response_length, s.temperature, top_k=s.top_k,
                                   eos_token_id=s.stop_token_ids, generator=generator, group_size=group_size,
                                   decoder=self.decoder)  # fmt: skip
        if retake and rounds_when_folded(self.model):
            query_responses = torch.cat([queries.repeat_interleave(group_size, 0), raw], dim=1)  # (B·G, P + T)
            attention_mask = torch.cat([query_mask.repeat_interleave(group_size, 0), torch.ones_like(raw)], dim=1)
            # over every sampled token: those after a row's stop are junk, as the sampler's are (the caller masks)
            logprobs = self.forward(Tokens(query_responses, attention_mask, queries.shape[1]))
        return raw, logprobs

    def sampler_metrics(self) -> dict[str, float]:
        """The sampler's metrics of the last rollout: ``rollout/compiled_fraction`` of the compiled decoder, the
        rollout engine's ``rollout/sync_gap`` and ``rollout/sync_seconds`` of its last sync."""
        metrics = self.rollout.metrics() if self.rollout is not None else {}
        if self.decoder is not None:
            metrics["rollout/compiled_fraction"] = self.decoder.compiled_fraction()
        return metrics

    def save_state(self) -> dict[str, Any]:
        """The trained weights (the parameters that train, by name: LoRA's adapters, or every weight), the
        optimizer's state and the schedule's, copied: training on from :meth:`load_state` of it takes the steps
        an uninterrupted run takes (a job's checkpoints keep the weights as a model folder beside the rest)."""
        assert self.optimizer is not None and self.scheduler is not None
        weights = {name: p.detach().clone() for name, p in self.model.named_parameters() if p.requires_grad}
        optimizer = copy.deepcopy(self.optimizer.state_dict())
        scheduler = copy.deepcopy(self.scheduler.state_dict())
        return {"weights": weights, "optimizer": optimizer, "scheduler": scheduler}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`save_state` returned (its ``weights`` into the model's parameters in place, so an
        optimizer, a wrapper or a compiled graph over them stays valid). A state of weights alone leaves the
        optimizer and the schedule as they are."""
        assert self.optimizer is not None and self.scheduler is not None
        if "weights" in state:
            parameters = dict(self.model.named_parameters())
            missing = sorted(set(state["weights"]) ^ {n for n, p in parameters.items() if p.requires_grad})
            if missing:
                raise ValueError(f"the state's weights and the model's trained parameters differ: {missing[:5]}")
            with torch.no_grad():
                for name, weight in state["weights"].items():
                    parameters[name].copy_(weight)
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])


def micro_batches(n: int, size: int) -> Iterator[tuple[slice, bool]]:
    """The micro-batches of ``n`` rows, ``size`` each: (their slice, whether it is the last)."""
    for first in range(0, n, size):
        yield slice(first, first + size), first + size >= n


MicroStep = Callable[[slice, bool], dict[str, torch.Tensor]]
"""Forward and backward of one micro-batch: (its slice of the minibatch's rows, whether it is the last) -> its
statistics, by name."""


def accumulate(
    n: int, size: int, keys: Sequence[str], step: MicroStep, ranks: Ranks, device: torch.device
) -> dict[str, float]:
    """Run ``step`` over the micro-batches of ``n`` rows (gradients accumulate), and return its ``keys``
    statistics summed over the micro-batches and the ranks (one sync). A key a step does not report counts 0."""
    totals = torch.zeros(len(keys), device=device)
    for part, last in micro_batches(n, size):
        stats = step(part, last)
        zero = torch.zeros((), device=device)
        totals += torch.stack([stats.get(key, zero).float() for key in keys])
    return dict(zip(keys, ranks.sum(totals).tolist(), strict=True))


def sft_gradients(learner: Learner, batch: dict[str, torch.Tensor], n_tokens: int, micro_size: int) -> float:
    """Next-token loss on ``batch``'s labelled tokens (this process's share of a batch of ``n_tokens`` labels), in
    micro-batches of ``micro_size`` rows accumulating gradients; returns the summed token loss of every rank."""

    def micro(part: slice, last: bool) -> dict[str, torch.Tensor]:
        return {"loss": learner.sft_backward({k: v[part] for k, v in batch.items()}, n_tokens, last=last)}

    device = batch["input_ids"].device
    return accumulate(len(batch["input_ids"]), micro_size, ("loss",), micro, learner.ranks, device)["loss"]


Minibatch = Callable[[torch.Tensor, int], dict[str, float]]
"""Gradients of one minibatch: (its rows' indices on the device, the update's number within the step) -> its
statistics (:func:`accumulate`)."""


def run_updates(
    learner: Learner,
    n_rows: int,
    mini_batch_size: int,
    epochs: int,
    shuffle: torch.Generator,
    minibatch: Minibatch,
    finite: Sequence[str],
    step: int,
    limit: tuple[str, float] | None = None,
) -> tuple[dict[str, list[float]], bool]:
    """``epochs`` passes over ``n_rows`` rows in minibatches of a fresh shuffled order each (the same on every
    rank), one :meth:`Learner.optim_step` per minibatch. The ``finite`` statistics' sum must stay finite
    (NonFiniteLossError). With ``limit`` (a statistic and its bound), a minibatch above it ends the passes.

    Returns every minibatch's statistics (``grad_norm``: the gradient norm) and whether the limit cut the passes
    short."""
    stats: dict[str, list[float]] = {}
    device = learner.model.device
    update = 0
    for _ in range(epochs):
        order = torch.randperm(n_rows, generator=shuffle)
        for first in range(0, n_rows, mini_batch_size):
            update_stats = minibatch(order[first : first + mini_batch_size].to(device), update)
            check_finite("loss", sum(update_stats[key] for key in finite), step)
            update_stats["grad_norm"] = learner.optim_step()
            update += 1
            for key, value in update_stats.items():
                stats.setdefault(key, []).append(value)
            if limit is not None and update_stats[limit[0]] > limit[1]:
                return stats, True
    return stats, False


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
