"""Supervised fine-tuning: next-token loss on the completion tokens, the prompt masked out."""

import time
from pathlib import Path

import torch
from transformers import PreTrainedModel

from engine.callbacks import Callbacks
from engine.config import JobSpec, SFTConfig
from engine.data import batch_indices, encode_sft_batch
from engine.distributed import Ranks
from engine.learner import Learner, completion_loss_sum, count_labels, sft_gradients
from engine.loop import JobResult, Run, check_finite, load_datasets, seed_everything, steps_for_epochs
from engine.models import check_fits, load_causal_lm, prepare


@torch.no_grad()
def eval_loss(model: PreTrainedModel, batches: list[dict[str, torch.Tensor]]) -> float:
    """Mean completion-token loss over ``batches``."""
    model.eval()
    total = sum(completion_loss_sum(model, b).item() for b in batches)
    return total / sum(count_labels(b) for b in batches)


def train_sft(spec: JobSpec, out_dir: Path, callbacks: Callbacks, device: torch.device) -> JobResult:
    cfg = spec.config
    assert isinstance(cfg, SFTConfig)
    seed_everything(spec.seed)
    ranks = Ranks.current()  # several processes: each takes its share of every batch

    # 1. data: the batch order is a function of (seed, step), so resuming needs only the step
    rows, eval_rows = load_datasets(spec, "sft", ranks)
    total_steps = steps_for_epochs(cfg, len(rows))

    # 2. model, optimizer and schedule, restored from the last checkpoint when there is one
    run = Run.open(spec, out_dir, callbacks, ranks, {"dataset": rows, "eval_dataset": eval_rows})
    tokenizer = run.tokenizer

    def causal_lm(ref: str) -> PreTrainedModel:
        return prepare(load_causal_lm(ref, tokenizer, spec.seed), device, cfg.dtype, cfg.gradient_checkpointing)

    model = run.load_trained("policy", spec.model, causal_lm, "CAUSAL_LM")
    check_fits(model, cfg.max_length, "hyperparameters.max_length")
    run.warn_long_sequences([*rows, *eval_rows], cfg.max_length, "sft")
    learner = Learner(model, ranks)
    start = learner.start_training(run, cfg, total_steps)
    if start.finished:
        return start.finished
    eval_batches = [
        {k: v.to(device) for k, v in encode_sft_batch(tokenizer, eval_rows[i : i + 64], cfg.max_length).items()}
        for i in range(0, len(eval_rows), 64)
    ]

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
        if eval_batches and run.eval_due(step, cfg.eval_every):
            metrics["eval/loss"] = eval_loss(model, eval_batches)
        if result := run.end_step(step, metrics, {"policy": model}):
            return result
    raise AssertionError("unreachable: the last step ends the run")
