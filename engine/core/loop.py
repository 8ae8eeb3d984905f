"""Plumbing shared by the training loops: seeding, data and tokenizer, optimizer and schedule with the resume
from the last checkpoint, and the end of a step (metrics, checkpoint, stop request). The loops themselves stay in
sft.py, rm.py and ppo_train.py.
"""

import logging
import math
import random
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.callbacks import Callbacks
from engine.core import sharded
from engine.core.checkpoint import (
    delete_checkpoint,
    latest_checkpoint,
    load_trainer_state,
    new_checkpoint_dir,
    save_checkpoint,
    write_job_file,
    write_spec_file,
)
from engine.core.data import (
    load_rows,
    prompt_ids,
    prompt_length_limit,
    require_chat_template,
    sequence_lengths,
    truncation_warning,
)
from engine.core.distributed import Ranks
from engine.core.models import (
    apply_lora,
    check_fits,
    context_length,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    prepare,
)
from engine.spec.config import JobSpec, SFTConfig, TrainConfig


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the job stops instead of corrupting its weights."""


@dataclass
class JobResult:
    status: Literal["succeeded", "paused", "cancelled"]
    step: int
    """Last completed optimizer step (of a halted job: the step it halted at, reported but not checkpointed; of a
    job stopped inside a reward call: its newest checkpoint's, 0 without one)."""
    checkpoint: Path | None
    """The checkpoint written last, if any (of a halted job: the newest one, from before the halt)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Metrics of the last completed step."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_datasets(spec: JobSpec, kind: str, ranks: Ranks) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of ``spec.dataset``, and of ``spec.eval_dataset`` on rank 0, which evaluates (none elsewhere, or
    without an eval dataset)."""
    rows = load_rows(spec.dataset, kind)
    eval_rows = load_rows(spec.eval_dataset, kind) if spec.eval_dataset and ranks.is_main else []
    return rows, eval_rows


def steps_for_epochs(cfg: SFTConfig, n_rows: int) -> int:
    """Optimizer steps of ``cfg.epochs`` passes over ``n_rows`` rows (at least 1), or ``cfg.max_steps``."""
    return cfg.max_steps or max(1, int(cfg.epochs * n_rows) // cfg.batch_size)


def make_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig, lr: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (frozen ones get no optimizer state), with the fused kernel
    (one pass over all parameters instead of a handful of ops per tensor) where the device has one."""
    trainable = [p for p in params if p.requires_grad]
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in trainable)
    return torch.optim.AdamW(
        trainable, lr=lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay, fused=fused
    )


def lr_factor(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Multiplier of the peak learning rate at 0-based ``step``: linear warm-up, then the decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    if cfg.lr_scheduler == "linear":
        return 1.0 - progress
    if cfg.lr_scheduler == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))


def clip_and_step(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_grad_norm: float | None
) -> float:
    """Clip the global gradient norm, step the optimizer, clear gradients; returns the norm before clipping. A NaN
    or infinite norm (a finite loss can still have a NaN gradient) steps nothing: the gradients are cleared and
    :class:`NonFiniteLossError` raised, as for a non-finite loss, so that the weights and optimizer state stay as
    they were."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm is not None else math.inf)
    norm = grad_norm.item()
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(f"grad_norm is {norm}: the update was refused, the weights are unchanged")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def check_finite(name: str, value: float, step: int) -> None:
    if not math.isfinite(value):
        raise NonFiniteLossError(f"{name} is {value} at step {step}")


log = logging.getLogger(__name__)


class Run:
    """One job's bookkeeping: where it resumes, when it checkpoints, how it ends.

    In a job of several processes every rank keeps one; rank 0's reports, checkpoints and stop decisions
    count (the other ranks are given callbacks that ignore everything).
    """

    def __init__(
        self, spec: JobSpec, out_dir: Path, callbacks: Callbacks, tokenizer: PreTrainedTokenizerBase, ranks: Ranks
    ) -> None:
        self.spec = spec
        self.out_dir = out_dir
        self.callbacks = callbacks
        self.tokenizer = tokenizer
        self.ranks = ranks
        self.total_steps = 0
        self.last_checkpoint: Path | None = None
        found = latest_checkpoint(out_dir)
        self.resume_from = found[1] if found else None
        """The checkpoint to resume from, or None for a fresh start."""
        self.trained_module: torch.nn.Module | None = None
        """What the optimizer's parameters are named by (the trained module), for a sharded optimizer state."""
        self._at_end: list[Callable[[], None]] = []

    def at_end(self, action: Callable[[], None]) -> None:
        """Call ``action`` when the job ends: once :meth:`end_step` or :meth:`halt` gives its result, or, when the
        job raises, as :func:`engine.run.run_job` returns (:func:`end_unfinished_runs`)."""
        if not self._at_end:
            _unfinished().append(self)
        self._at_end.append(action)

    def _end(self) -> None:
        while self._at_end:
            self._at_end.pop()()
        if self in _unfinished():
            _unfinished().remove(self)

    @classmethod
    def open(
        cls, spec: JobSpec, out_dir: Path, callbacks: Callbacks, ranks: Ranks, rows: dict[str, list[dict[str, Any]]]
    ) -> "Run":
        """The run of ``spec`` in ``out_dir``, with the tokenizer of ``spec.model``; ``rows`` by the spec field that
        names them (``dataset``, ``eval_dataset``, ...), which must not be chat rows unless it has a chat template."""
        tokenizer = load_tokenizer(spec.model)
        for field_name, field_rows in rows.items():
            require_chat_template(tokenizer, field_rows, field_name)
        return cls(spec, out_dir, callbacks, tokenizer, ranks)

    def prompt_length(
        self, max_prompt_length: int | None, response_length: int, model: PreTrainedModel, rows: list[dict[str, Any]]
    ) -> int:
        """The most prompt tokens the job keeps (:func:`prompt_length_limit` of the ``rows``' prompts, room left
        for ``response_length`` in ``model``'s context); a warning event counts the prompts cut to it."""
        lengths = [len(prompt_ids(self.tokenizer, row["prompt"])) for row in rows]
        context = context_length(model)
        limit = prompt_length_limit(lengths, max_prompt_length, None if context is None else context - response_length)
        if any(n > limit for n in lengths):
            self.callbacks.on_event("warning", *truncation_warning(lengths, limit, "prompts", "max_prompt_length"))
        return limit

    def warn_long_sequences(self, rows: list[dict[str, Any]], max_length: int, kind: str) -> None:
        """A warning event counting the ``rows`` (of dataset ``kind``: sft or preference) longer than
        ``max_length`` tokens, which training cuts: the prompt's start first, then the completion's end."""
        lengths = sequence_lengths(self.tokenizer, rows, kind)
        if any(n > max_length for n in lengths):
            kept = "are cut to {limit} tokens (the prompt's start first, then the completion's end)"
            event = truncation_warning(lengths, max_length, "examples", "max_length", kept)
            self.callbacks.on_event("warning", *event)

    def load_trained(
        self,
        name: str,
        fresh_ref: str,
        load: Callable[[str], PreTrainedModel],
        task: Literal["CAUSAL_LM", "SEQ_CLS"],
    ) -> PreTrainedModel:
        """The model a loop trains, ``name`` in the checkpoints: ``load(ref)`` whole, or with LoRA the
        frozen base plus adapters. When resuming, weights (or adapters) come from the checkpoint.
        """
        if self.spec.lora is None:
            return load(str(self.resume_from / name) if self.resume_from else fresh_ref)
        adapters = self.resume_from / "adapters" / name if self.resume_from else None
        return apply_lora(load(fresh_ref), self.spec.lora, task, adapters)

    def start_training(
        self, cfg: TrainConfig, total_steps: int, *param_groups: tuple[list[torch.nn.Parameter], float]
    ) -> "Start":
        """AdamW over ``param_groups`` ((parameters, peak learning rate) each: the first one's settings are the
        others' too) and the schedule of ``cfg`` over ``total_steps``, then :meth:`start`."""
        (params, lr), *more = param_groups
        optimizer = make_optimizer(params, cfg, lr)
        for group_params, group_lr in more:
            optimizer.add_param_group({"params": group_params, "lr": group_lr})
        scheduler = make_scheduler(optimizer, cfg, total_steps)
        step, state = self.start(total_steps, optimizer, scheduler)
        return Start(optimizer, scheduler, step, state, self.result_if_finished(step))

    def start(
        self, total_steps: int, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
    ) -> tuple[int, dict[str, Any] | None]:
        """Announce the job; when resuming, restore optimizer, schedule and RNG states; when starting afresh,
        record the spec in ``spec.json`` (what a later resume into this folder is checked against).

        Returns (start step, the checkpoint's trainer state for the loop's own parts, or None).
        """
        self.total_steps = total_steps
        self.optimizer, self.scheduler = optimizer, scheduler
        state = load_trainer_state(self.resume_from) if self.resume_from else None
        start_step = state["step"] if state else 0
        if state is None and self.ranks.is_main:
            write_spec_file(self.out_dir, self.spec)
        if state:
            if self.ranks.sharded:
                assert self.trained_module is not None, "a sharded job names its trained module before it starts"
                assert self.resume_from is not None
                sharded.load_optimizer(self.trained_module, optimizer, self.resume_from / sharded.OPTIMIZER_DIR)
            else:
                optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            self.callbacks.on_event("info", f"resumed from step {start_step}", {"step": start_step})
        self.callbacks.on_start(start_step, total_steps)
        return start_step, state

    def end_step(
        self,
        step: int,
        metrics: dict[str, float],
        models: dict[str, PreTrainedModel],
        extra_state: Callable[[], dict[str, Any]] = dict,
    ) -> JobResult | None:
        """Report ``step``; checkpoint when due; returns the job's result once it is over, else None.

        A checkpoint's trainer state holds optimizer and schedule, plus what ``extra_state()`` returns (called on
        every rank, so it may gather from all of them). With several processes, ``dist/weight_spread`` reports
        how far the ranks' trained weights are apart (0: identical), and rank 0's stop request is every rank's.
        """
        self._report(step, metrics, models)
        final = step >= self.total_steps
        stop = None if final else self.ranks.broadcast(self.callbacks.should_stop())
        if final or stop == "pause" or step % self.spec.checkpoint_every == 0:
            self._checkpoint(step, models, extra_state(), metrics)
        if final:
            if self.ranks.is_main:
                write_job_file(
                    self.out_dir,
                    {"status": "succeeded", "type": self.spec.type, "final_step": step, "spec": self.spec.model_dump()},
                )
            self._end()
            return JobResult("succeeded", step, self.last_checkpoint, metrics)
        if stop is not None:
            self._end()
            return JobResult("paused" if stop == "pause" else "cancelled", step, self.last_checkpoint, metrics)
        return None

    def halt(
        self,
        step: int,
        metrics: dict[str, float],
        models: dict[str, PreTrainedModel],
        reason: str,
        error: Exception | None = None,
    ) -> JobResult:
        """Report ``step`` and end the job there without checkpointing it, so that its newest checkpoint is one
        from before (a step judged anomalous must not become the one a resume or a deployment starts from).

        Raises ``error`` when given (the job fails); otherwise records an ``info`` event giving ``reason`` and
        returns a paused result naming the newest checkpoint, if any. Every rank must call this at the same
        step (no stop request is exchanged).
        """
        self._report(step, metrics, models)
        self._end()
        if error is not None:
            raise error
        newest = latest_checkpoint(self.out_dir)
        shown = f"step {newest[0]}" if newest else "none (a resume starts afresh)"
        self.callbacks.on_event(
            "info",
            f"paused at step {step} without checkpointing it: {reason}; newest checkpoint: {shown}",
            {"step": step, "checkpoint_step": newest[0] if newest else None},
        )
        return JobResult("paused", step, newest[1] if newest else None, metrics)

    def _checkpoint(
        self, step: int, models: dict[str, PreTrainedModel], extra: dict[str, Any], metrics: dict[str, float]
    ) -> None:
        """Write ``step-N`` (rank 0). Sharded, every rank takes part: each writes its optimizer shards into the
        folder rank 0 opened, and the models' weights are gathered to rank 0, which writes them as Hugging Face
        folders (within :meth:`Ranks.gathered`, so that LoRA's adapters are whole as they are merged)."""
        assert self.optimizer is not None and self.scheduler is not None
        ranks, keep = self.ranks, self.spec.keep_checkpoints
        state = {"scheduler": self.scheduler.state_dict(), **extra}
        if not ranks.sharded:
            if ranks.is_main:
                state["optimizer"] = self.optimizer.state_dict()
                self.last_checkpoint = save_checkpoint(self.out_dir, step, models, self.tokenizer, state, keep)
                self.callbacks.on_checkpoint(step, self.last_checkpoint, metrics)
            return
        assert self.trained_module is not None
        tmp = ranks.broadcast(new_checkpoint_dir(self.out_dir, step) if ranks.is_main else None)
        assert tmp is not None
        try:
            sharded.save_optimizer(self.trained_module, self.optimizer, tmp / sharded.OPTIMIZER_DIR)
            model_states = {name: sharded.full_state_dict(model) for name, model in models.items()}
            with ranks.gathered(*models.values()):
                if ranks.is_main:
                    path = save_checkpoint(self.out_dir, step, models, self.tokenizer, state, keep, tmp, model_states)
        except BaseException:
            if ranks.is_main:
                delete_checkpoint(tmp)
            raise
        if ranks.is_main:
            self.last_checkpoint = path
            self.callbacks.on_checkpoint(step, path, metrics)

    def _report(self, step: int, metrics: dict[str, float], models: dict[str, PreTrainedModel]) -> None:
        if self.ranks.world_size > 1 and not self.ranks.sharded:  # shards differ by design
            trained = (p for model in models.values() for p in model.parameters() if p.requires_grad)
            metrics["dist/weight_spread"] = self.ranks.weight_spread(trained)
        metrics["memory/state_bytes"] = self._state_bytes(models)
        self.callbacks.on_metrics(step, metrics)

    def _state_bytes(self, models: dict[str, PreTrainedModel]) -> float:
        """This rank's bytes of the models' parameters, of the trained ones' gradients (as large as they) and of
        the optimizer state: what sharding divides."""

        def local(tensor: torch.Tensor) -> int:
            held = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            return held.numel() * held.element_size()

        params = {id(p): p for model in models.values() for p in model.parameters()}.values()
        total = sum(local(p) * (2 if p.requires_grad else 1) for p in params)
        if self.optimizer is not None:
            state = self.optimizer.state.values()
            total += sum(local(v) for s in state for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return float(total)

    def result_if_finished(self, start_step: int) -> JobResult | None:
        """A job resumed from its final checkpoint has nothing left to do."""
        if start_step >= self.total_steps:
            return JobResult("succeeded", start_step, self.resume_from)
        return None

    def eval_due(self, step: int, every: int | None) -> bool:
        """Whether ``step`` evaluates: every ``every`` steps (None: only the last) and at the last."""
        return step == self.total_steps or bool(every and step % every == 0)


_runs = threading.local()


def _unfinished() -> list[Run]:
    """This thread's runs with actions still to call at their end."""
    if not hasattr(_runs, "unfinished"):
        _runs.unfinished = []
    runs: list[Run] = _runs.unfinished
    return runs


def end_unfinished_runs() -> None:
    """Call the end actions of this thread's runs that ended by an exception (a rollout engine's server stopped,
    a decoder's memory given back), newest first; an action that fails does not keep the others from running."""
    while _unfinished():
        run = _unfinished().pop()
        while run._at_end:
            try:
                run._at_end.pop()()
            except Exception:
                log.exception("an end action of a job that failed raised")


@dataclass
class Supervised:
    """An offline method's job (SFT, reward model, DPO) as :func:`open_supervised` opens it."""

    run: Run
    model: PreTrainedModel
    """The trained model, restored from the last checkpoint when there is one."""
    rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    """Rank 0's held-out rows (none elsewhere)."""
    total_steps: int


def open_supervised(
    spec: JobSpec,
    out_dir: Path,
    callbacks: Callbacks,
    device: torch.device,
    kind: Literal["sft", "preference"],
    task: Literal["CAUSAL_LM", "SEQ_CLS"] = "CAUSAL_LM",
) -> Supervised:
    """Seed, read the ``kind`` rows of ``dataset`` and ``eval_dataset``, size the job (``epochs`` or
    ``max_steps``), open its :class:`Run`, and load the trained model (a causal LM, or a scalar model for
    ``SEQ_CLS``) for sequences of ``max_length`` tokens, with a warning event counting the rows it cuts."""
    cfg = spec.config
    assert isinstance(cfg, SFTConfig)
    seed_everything(spec.seed)
    # several processes: each takes its share of every batch (and with FSDP holds a shard of each model)
    ranks = Ranks.current(spec.resources.sharding, spec.resources.cpu_offload)
    # the batch order is a function of (seed, step), so resuming needs only the step
    rows, eval_rows = load_datasets(spec, kind, ranks)
    run = Run.open(spec, out_dir, callbacks, ranks, {"dataset": rows, "eval_dataset": eval_rows})

    def load(ref: str) -> PreTrainedModel:
        loaded = (load_scalar_model if task == "SEQ_CLS" else load_causal_lm)(ref, run.tokenizer, spec.seed)
        return prepare(loaded, device, cfg.dtype, cfg.gradient_checkpointing)

    model = run.load_trained("policy", spec.model, load, task)
    check_fits(model, cfg.max_length, "hyperparameters.max_length")
    run.warn_long_sequences([*rows, *eval_rows], cfg.max_length, kind)
    return Supervised(run, model, rows, eval_rows, steps_for_epochs(cfg, len(rows)))


def encoded_batches(
    encode: Callable[[PreTrainedTokenizerBase, list[dict[str, Any]], int], dict[str, torch.Tensor]],
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    max_length: int,
    device: torch.device,
    size: int = 64,
) -> list[dict[str, torch.Tensor]]:
    """``rows`` in batches of ``size``, each ``encode``d and on ``device`` (held-out rows, encoded once)."""
    batches = [encode(tokenizer, rows[i : i + size], max_length) for i in range(0, len(rows), size)]
    return [{k: v.to(device) for k, v in batch.items()} for batch in batches]


@dataclass
class Start:
    """Where a loop starts (:meth:`Run.start_training`)."""

    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    """Both restored from the checkpoint when resuming."""
    step: int
    """The last step done: training goes on at the next one (0 for a fresh start)."""
    state: dict[str, Any] | None
    """The checkpoint's trainer state, for the loop's own parts (None for a fresh start)."""
    finished: JobResult | None
    """The result of a job resumed from its final checkpoint (nothing left to do), else None."""
