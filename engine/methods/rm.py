"""The reward-model training method (job type ``rm``; scoring with a trained reward model is
engine/rewards/reward_model.py): a scalar head on a causal-LM backbone, read at the last valid token, trained on
preference pairs with -log σ(r_chosen - r_rejected - margin) (InstructGPT, arXiv:2203.02155),
plus an optional LM loss on the chosen text (MOSS-RLHF, arXiv:2307.04964).
"""

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.callbacks import Callbacks
from engine.core.data import batch_indices, encode_completion, labelled_batch, preference_parts
from engine.core.learner import Learner, accumulate
from engine.core.loop import JobResult, check_finite, encoded_batches, open_supervised
from engine.core.models import ScalarHead, lm_head_weight
from engine.core.ops import reward_index
from engine.spec.config import JobSpec, RMConfig


def encode_pairs(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]], max_length: int
) -> dict[str, torch.Tensor]:
    """Chosen rows then rejected rows in one right-padded batch (2B, L), with LM labels for the chosen."""
    parts = [preference_parts(row) for row in rows]
    chosen = [encode_completion(tokenizer, prompt, good) for prompt, good, _ in parts]
    rejected = [encode_completion(tokenizer, prompt, bad) for prompt, _, bad in parts]
    unlabelled = [(ids, [False] * len(ids)) for ids, _ in rejected]  # LM loss on the chosen completions only
    return labelled_batch(chosen + unlabelled, tokenizer.pad_token_id, max_length)


def pair_rewards(
    scalar: torch.nn.Module, batch: dict[str, torch.Tensor], pad_token_id: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards (2B,) where the model reads (:func:`reward_index`), and the backbone's hidden states (2B, L, H).
    ``scalar``: a :class:`ScalarHead`, or one wrapped in DistributedDataParallel; ``pad_token_id``: its model's."""
    scores, hidden = scalar(batch["input_ids"], batch["attention_mask"])  # (2B, L)
    index = reward_index(batch["input_ids"], batch["attention_mask"], pad_token_id)  # (2B,)
    return scores.gather(1, index.unsqueeze(1)).squeeze(1), hidden


def lm_loss_sum(lm_head: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of the hidden states read through ``lm_head`` (V, H) (see :func:`lm_head_weight`)."""
    logits = hidden[:, :-1] @ lm_head.T  # (2B, L-1, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")


@torch.no_grad()
def evaluate_pairs(model: PreTrainedModel, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """(accuracy, mean margin r_chosen - r_rejected) over ``batches``."""
    model.eval()
    margins = []
    for batch in batches:
        rewards, _ = pair_rewards(ScalarHead(model), batch, model.config.pad_token_id)
        chosen, rejected = rewards.chunk(2)
        margins.append(chosen - rejected)
    margin = torch.cat(margins)
    return (margin > 0).float().mean().item(), margin.mean().item()


def pair_gradients(
    learner: Learner,
    micro_batches: list[dict[str, torch.Tensor]],
    cfg: RMConfig,
    pad_token_id: int,
    lm_head: Callable[[], torch.Tensor] | None,
    n_lm_tokens: int,
) -> tuple[float, torch.Tensor]:
    """The pairwise loss over a batch (a mean over its pairs), with the LM loss on the chosen completions when
    ``lm_head`` is given, accumulated over this process's ``micro_batches``: the loss summed over every rank, and
    this process's margins (b,)."""
    margins = []

    def micro(part: slice, last: bool) -> dict[str, torch.Tensor]:
        batch = micro_batches[part.start]
        with learner.ranks.no_sync(learner.trained, last):
            rewards, hidden = pair_rewards(learner.trained, batch, pad_token_id)  # (2b,)
            chosen, rejected = rewards.chunk(2)  # (b,), (b,)
            loss = -F.logsigmoid(chosen - rejected - cfg.margin).sum() / cfg.batch_size
            if lm_head is not None:
                loss = loss + cfg.lm_loss_coef * lm_loss_sum(lm_head(), hidden, batch["labels"]) / n_lm_tokens
            (loss * learner.ranks.loss_scale).backward()
        margins.append((chosen - rejected).detach())
        return {"loss": loss.detach()}

    device = learner.model.device
    loss_sum = accumulate(len(micro_batches), 1, ("loss",), micro, learner.ranks, device)["loss"]
    return loss_sum, torch.cat(margins)


def train_rm(spec: JobSpec, out_dir: Path, callbacks: Callbacks, device: torch.device) -> JobResult:
    cfg = spec.config
    assert isinstance(cfg, RMConfig)
    # 1. data, and 2. the model (a scalar head on the starting model's backbone), restored when resuming
    job = open_supervised(spec, out_dir, callbacks, device, "preference", "SEQ_CLS")
    run, model, rows, eval_rows, total_steps = job.run, job.model, job.rows, job.eval_rows, job.total_steps
    tokenizer, ranks = run.tokenizer, run.ranks
    pad_token_id = model.config.pad_token_id  # where the reward is read, as plain transformers reads it
    lm_head = lm_head_weight(model, spec.model) if cfg.lm_loss_coef > 0 else None
    learner = Learner(model, ranks, head=ScalarHead(model))
    start = learner.start_training(run, cfg, total_steps)
    if start.finished:
        return start.finished
    eval_batches = encoded_batches(encode_pairs, tokenizer, eval_rows, cfg.max_length, device)

    for step in range(start.step + 1, total_steps + 1):
        t0 = time.perf_counter()
        # 3. pairwise loss over the batch, accumulated over micro-batches (per process: its share of the batch)
        batch_rows = [rows[i] for i in batch_indices(len(rows), cfg.batch_size, spec.seed, step - 1)]
        share_rows = batch_rows[ranks.share(cfg.batch_size)]
        mbs = cfg.micro_batch_size // ranks.world_size
        micro_batches = [
            {k: v.to(device) for k, v in encode_pairs(tokenizer, share_rows[i : i + mbs], cfg.max_length).items()}
            for i in range(0, len(share_rows), mbs)
        ]
        # token counts of the whole batch: LM tokens (the LM loss is their mean), and every token (throughput)
        counts = torch.tensor(
            [[int((b["labels"][:, 1:] != -100).sum()), int(b["attention_mask"].sum())] for b in micro_batches]
        ).sum(0)
        n_lm_tokens, n_seen = ranks.sum(counts).tolist()
        model.train()
        loss_sum, margins = pair_gradients(learner, micro_batches, cfg, pad_token_id, lm_head, n_lm_tokens)
        check_finite("loss/rm", loss_sum, step)
        grad_norm = learner.optim_step()
        lr = learner.schedule()

        # 4. metrics, eval, checkpoint, stop request
        margin = ranks.gather(margins)  # (B,)
        elapsed = time.perf_counter() - t0
        metrics = {
            "loss/rm": loss_sum,
            "rm/accuracy": (margin > 0).float().mean().item(),
            "rm/margin": margin.mean().item(),
            "lr": lr,
            "grad_norm": grad_norm,
            "time/step_s": elapsed,
            "throughput/tokens_per_s": n_seen / elapsed,
        }
        if run.eval_due(step, cfg.eval_every):
            with ranks.gathered(learner.trained):  # rank 0 evaluates its held-out rows (the others have none)
                if eval_batches:
                    metrics["eval/accuracy"], metrics["eval/margin"] = evaluate_pairs(model, eval_batches)
        if result := run.end_step(step, metrics, {"policy": model}):
            return result
    raise AssertionError("unreachable: the last step ends the run")
