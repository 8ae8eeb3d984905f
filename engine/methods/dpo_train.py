"""Direct preference optimisation (Rafailov et al., arXiv:2305.18290): the policy is trained on preference pairs
to raise the log-ratio of the chosen completion over the rejected one, each measured against a frozen reference,
the starting policy. No reward model and no sampling: one forward of the policy and one of the reference per pair.

The reference is a frozen copy of the starting model, or with LoRA the trained model itself with its adapters
switched off (one copy of the weights in memory). Its log-probabilities are computed once per batch without a
graph. The losses (``sigmoid``, ``ipo``, ``hinge``) are in engine/methods/dpo.py; the metrics take TRL's names.
"""

import time
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.callbacks import Callbacks
from engine.core.data import (
    batch_indices,
    encode_completion,
    labelled_batch,
    preference_parts,
)
from engine.core.learner import Learner, accumulate
from engine.core.loop import JobResult, check_finite, open_supervised
from engine.core.models import load_causal_lm, prepare, token_logprobs
from engine.methods.dpo import IGNORE_INDEX, DPOLossOut, dpo_loss, sequence_logps
from engine.spec.config import DPOConfig, JobSpec

EVAL_BATCH = 32
"""Pairs per forward when evaluating."""


def encode_preference_batch(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]], max_length: int
) -> dict[str, torch.Tensor]:
    """The chosen completions of ``rows``, then their rejected ones, in one right-padded batch (2B, L); labels
    mark each completion's tokens (prompt and padding -100)."""
    parts = [preference_parts(row) for row in rows]
    chosen = [encode_completion(tokenizer, prompt, good) for prompt, good, _ in parts]
    rejected = [encode_completion(tokenizer, prompt, bad) for prompt, _, bad in parts]
    return labelled_batch(chosen + rejected, tokenizer.pad_token_id, max_length)


def completion_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Log-probability (2B,) of each sequence's completion under ``model``, summed over its tokens."""
    logps, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], start=1)  # (2B, L-1)
    return sequence_logps(logps, batch["labels"])


def compared(logps: torch.Tensor, batch: dict[str, torch.Tensor], mean: bool) -> torch.Tensor:
    """What the loss compares of :func:`completion_logps`: the sums, or (``mean``, for ipo) per-token averages."""
    return logps / (batch["labels"][:, 1:] != IGNORE_INDEX).sum(-1).clamp(min=1) if mean else logps


@torch.no_grad()
def reference_logps(
    reference: PreTrainedModel | None, policy: PreTrainedModel, batch: dict[str, torch.Tensor], mean: bool
) -> torch.Tensor:
    """:func:`completion_logps` under the reference: ``reference``, or with LoRA (None) ``policy`` with its
    adapters disabled."""
    if reference is not None:
        return compared(completion_logps(reference, batch), batch, mean)
    assert isinstance(policy, PeftModel)
    with policy.disable_adapter():
        return compared(completion_logps(policy, batch), batch, mean)


def pair_metrics(out: DPOLossOut, chosen: torch.Tensor, rejected: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """TRL's DPO metrics over the pairs: loss, implicit rewards, their accuracy and margin, policy log-probs."""
    return {
        f"{prefix}loss/dpo": out.losses.mean().item(),
        f"{prefix}rewards/chosen": out.chosen_rewards.mean().item(),
        f"{prefix}rewards/rejected": out.rejected_rewards.mean().item(),
        f"{prefix}rewards/accuracies": (out.chosen_rewards > out.rejected_rewards).float().mean().item(),
        f"{prefix}rewards/margins": (out.chosen_rewards - out.rejected_rewards).mean().item(),
        f"{prefix}logps/chosen": chosen.mean().item(),
        f"{prefix}logps/rejected": rejected.mean().item(),
    }


@torch.no_grad()
def evaluate(
    policy: PreTrainedModel, reference: PreTrainedModel | None, batches: list[dict[str, torch.Tensor]], cfg: DPOConfig
) -> dict[str, float]:
    """The ``eval/`` metrics over held-out pairs."""
    policy.eval()
    mean = cfg.loss_type == "ipo"
    logps, ref_logps = [], []
    for batch in batches:
        logps.append(compared(completion_logps(policy, batch), batch, mean).chunk(2))
        ref_logps.append(reference_logps(reference, policy, batch, mean).chunk(2))
    chosen, rejected = (torch.cat(parts) for parts in zip(*logps, strict=True))
    ref_chosen, ref_rejected = (torch.cat(parts) for parts in zip(*ref_logps, strict=True))
    out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=cfg.beta, loss_type=cfg.loss_type,
                   label_smoothing=cfg.label_smoothing)  # fmt: skip
    return pair_metrics(out, chosen, rejected, prefix="eval/")


def pair_gradients(
    learner: Learner,
    micro_batches: list[dict[str, torch.Tensor]],
    ref_logps: list[tuple[torch.Tensor, ...]],
    cfg: DPOConfig,
    n_chosen_tokens: int,
) -> tuple[float, list[DPOLossOut], list[torch.Tensor], list[torch.Tensor]]:
    """The preference loss over a batch (a mean over its pairs; with ``sft_loss_coef``, less RPO's next-token term
    on the chosen completions, per token of the batch's ``n_chosen_tokens``), accumulated over this process's
    ``micro_batches`` (the reference's log-probs of each in ``ref_logps``): the loss summed over every rank, and
    each micro-batch's loss outputs and the policy's compared log-probs of its chosen and rejected completions."""
    mean_logps = cfg.loss_type == "ipo"  # IPO compares per-token averages
    outs, policy_chosen, policy_rejected = [], [], []

    def micro(part: slice, last: bool) -> dict[str, torch.Tensor]:
        i = part.start
        batch = micro_batches[i]
        with learner.ranks.no_sync(learner.trained, last):
            sums = completion_logps(learner.trained, batch)  # (2b,): the chosen completions, then the rejected
            chosen, rejected = compared(sums, batch, mean_logps).chunk(2)
            out = dpo_loss(chosen, rejected, *ref_logps[i], beta=cfg.beta, loss_type=cfg.loss_type,
                           label_smoothing=cfg.label_smoothing)  # fmt: skip
            loss = out.losses.sum() / cfg.batch_size
            if cfg.sft_loss_coef > 0:  # RPO: the chosen completions' next-token loss, from the same forward
                loss = loss - cfg.sft_loss_coef * sums.chunk(2)[0].sum() / n_chosen_tokens
            (loss * learner.ranks.loss_scale).backward()
        outs.append(out)
        policy_chosen.append(chosen.detach())
        policy_rejected.append(rejected.detach())
        return {"loss": loss.detach()}

    device = learner.model.device
    loss_sum = accumulate(len(micro_batches), 1, ("loss",), micro, learner.ranks, device)["loss"]
    return loss_sum, outs, policy_chosen, policy_rejected


def train_dpo(spec: JobSpec, out_dir: Path, callbacks: Callbacks, device: torch.device) -> JobResult:
    cfg = spec.config
    assert isinstance(cfg, DPOConfig)
    mean_logps = cfg.loss_type == "ipo"  # IPO compares per-token averages
    # 1. data and the policy (restored from the last checkpoint when there is one); 2. the frozen reference
    #    (always the starting model), optimizer and schedule
    job = open_supervised(spec, out_dir, callbacks, device, "preference")
    run, model, rows, eval_rows, total_steps = job.run, job.model, job.rows, job.eval_rows, job.total_steps
    tokenizer, ranks = run.tokenizer, run.ranks
    reference = None  # with LoRA: the policy with its adapters off
    if spec.lora is None:
        reference = prepare(load_causal_lm(spec.model, tokenizer, spec.seed), device, cfg.dtype, False).eval()
        reference.requires_grad_(False)
        ranks.shard(reference)  # with FSDP a frozen model is sharded too
    learner = Learner(model, ranks)
    start = learner.start_training(run, cfg, total_steps)
    if start.finished:
        return start.finished

    def encoded(pairs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in encode_preference_batch(tokenizer, pairs, cfg.max_length).items()}

    eval_batches = [encoded(eval_rows[i : i + EVAL_BATCH]) for i in range(0, len(eval_rows), EVAL_BATCH)]

    pairs_per_micro = cfg.micro_batch_size // ranks.world_size
    for step in range(start.step + 1, total_steps + 1):
        t0 = time.perf_counter()
        # 3. this process's share of the batch's pairs, in micro-batches of chosen-then-rejected sequences
        batch_rows = [rows[i] for i in batch_indices(len(rows), cfg.batch_size, spec.seed, step - 1)]
        share_rows = batch_rows[ranks.share(cfg.batch_size)]
        micro_batches = [
            encoded(share_rows[i : i + pairs_per_micro]) for i in range(0, len(share_rows), pairs_per_micro)
        ]
        counts = torch.tensor([[int(b["attention_mask"].sum()), int((b["labels"][: len(b["labels"]) // 2, 1:]
                                != IGNORE_INDEX).sum())] for b in micro_batches]).sum(0)  # fmt: skip
        n_seen, n_chosen_tokens = ranks.sum(counts).tolist()  # every token (throughput); RPO's token count

        # 4. the reference's log-probs, once per batch and without a graph
        model.eval()
        ref_logps = [reference_logps(reference, model, b, mean_logps).chunk(2) for b in micro_batches]

        # 5. the preference loss (a mean over the batch's pairs), accumulated over the micro-batches
        model.train()
        loss_sum, outs, policy_chosen, policy_rejected = pair_gradients(learner, micro_batches, ref_logps, cfg,
                                                                        n_chosen_tokens)  # fmt: skip
        check_finite("loss/dpo", loss_sum, step)
        grad_norm = learner.optim_step()
        lr = learner.schedule()

        # 6. metrics over the whole batch, eval, checkpoint, stop request
        def gathered(parts: list[torch.Tensor]) -> torch.Tensor:
            return ranks.gather(torch.cat(parts))

        batch_out = DPOLossOut(
            losses=gathered([o.losses.detach() for o in outs]),
            chosen_rewards=gathered([o.chosen_rewards for o in outs]),
            rejected_rewards=gathered([o.rejected_rewards for o in outs]),
        )
        elapsed = time.perf_counter() - t0
        metrics = pair_metrics(batch_out, gathered(policy_chosen), gathered(policy_rejected))
        metrics["loss/dpo"] = loss_sum  # the optimised loss, RPO's term included
        metrics.update({"lr": lr, "grad_norm": grad_norm, "time/step_s": elapsed,
                        "throughput/tokens_per_s": n_seen / elapsed})  # fmt: skip
        if run.eval_due(step, cfg.eval_every):
            frozen = () if reference is None else (reference,)
            with ranks.gathered(model, *frozen):  # rank 0 evaluates its held-out pairs (the others have none)
                if eval_batches:
                    metrics.update(evaluate(model, reference, eval_batches, cfg))
        if result := run.end_step(step, metrics, {"policy": model}):
            return result
    raise AssertionError("unreachable: the last step ends the run")
