"""Supervised fine-tuning: next-token loss on the completion tokens, the prompt masked out."""

import time
from pathlib import Path

import torch
from transformers import PreTrainedModel

from engine.callbacks import Callbacks
from engine.core.data import batch_indices, encode_sft_batch
from engine.core.learner import Learner, completion_loss_sum, count_labels, sft_gradients
from engine.core.loop import JobResult, check_finite, encoded_batches, open_supervised
from engine.spec.config import JobSpec, SFTConfig


@torch.no_grad()
def eval_loss(model: PreTrainedModel, batches: list[dict[str, torch.Tensor]]) -> float:
    """Mean completion-token loss over ``batches``."""
    model.eval()
    total = sum(completion_loss_sum(model, b).item() for b in batches)
    return total / sum(count_labels(b) for b in batches)


def train_sft(spec: JobSpec, out_dir: Path, callbacks: Callbacks, device: torch.device) -> JobResult:
    cfg = spec.config
    assert isinstance(cfg, SFTConfig)
    job = open_supervised(spec, out_dir, callbacks, device, "sft")  # seeded; rows, run, model, steps
    run, model, rows, eval_rows, total_steps = job.run, job.model, job.rows, job.eval_rows, job.total_steps
    tokenizer, ranks = run.tokenizer, run.ranks
    learner = Learner(model, ranks)
    start = learner.start_training(run, cfg, total_steps)
    if start.finished:
        return start.finished
    eval_batches = encoded_batches(encode_sft_batch, tokenizer, eval_rows, cfg.max_length, device)

    micro_size = cfg.micro_batch_size // ranks.world_size
    for step in range(start.step + 1, total_steps + 1):
        t0 = time.perf_counter()
        # 3. one optimizer step over `batch_size` examples in `gradient_accumulation_steps` micro-batches (per
        #    process: its share of the batch, in micro-batches as many)
        batch_rows = [rows[i] for i in batch_indices(len(rows), cfg.batch_size, spec.seed, step - 1)]
        batch = encode_sft_batch(tokenizer, batch_rows, cfg.max_length)
        n_tokens = count_labels(batch)  # the loss is a mean over the whole batch's completion tokens
        n_seen = int(batch["attention_mask"].sum())
        share = {k: v[ranks.share(cfg.batch_size)].to(device) for k, v in batch.items()}
        model.train()
        loss_sum = sft_gradients(learner, share, n_tokens, micro_size)
        check_finite("loss/sft", loss_sum, step)
        grad_norm = learner.optim_step()
        lr = learner.schedule()

        # 4. metrics, eval, checkpoint, stop request
        elapsed = time.perf_counter() - t0
        metrics = {
            "loss/sft": loss_sum / n_tokens,
            "lr": lr,
            "grad_norm": grad_norm,
            "time/step_s": elapsed,
            "throughput/tokens_per_s": n_seen / elapsed,
        }
        if run.eval_due(step, cfg.eval_every):
            with ranks.gathered(model):  # rank 0 evaluates its held-out rows (the others have none)
                if eval_batches:
                    metrics["eval/loss"] = eval_loss(model, eval_batches)
        if result := run.end_step(step, metrics, {"policy": model}):
            return result
    raise AssertionError("unreachable: the last step ends the run")
