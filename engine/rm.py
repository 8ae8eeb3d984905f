"""Reward model: a scalar head on a causal-LM backbone, read at the last valid token, trained on
preference pairs with -log σ(r_chosen - r_rejected - margin) (InstructGPT, arXiv:2203.02155),
plus an optional LM loss on the chosen text (MOSS-RLHF, arXiv:2307.04964).
"""

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.callbacks import Callbacks
from engine.config import JobSpec, RMConfig
from engine.data import batch_indices, encode_pair, load_rows, pad_right
from engine.distributed import Ranks
from engine.loop import JobResult, Run, check_finite, clip_and_step, make_optimizer, make_scheduler, seed_everything
from engine.models import ScalarHead, check_fits, load_scalar_model, load_tokenizer, prepare
from engine.ops import last_valid_index


def encode_pairs(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, str]], max_length: int
) -> dict[str, torch.Tensor]:
    """Chosen rows then rejected rows in one right-padded batch (2B, L), with LM labels for the chosen."""
    chosen = [encode_pair(tokenizer, r["prompt"], r["chosen"], max_length) for r in rows]
    rejected = [encode_pair(tokenizer, r["prompt"], r["rejected"], max_length) for r in rows]
    input_ids, attention_mask = pad_right([ids for ids, _ in chosen + rejected], tokenizer.pad_token_id)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    for i, (_, n_prompt) in enumerate(chosen):
        labels[i, :n_prompt] = -100
    labels[len(rows) :] = -100  # LM loss on the chosen completions only
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def pair_rewards(scalar: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards at the last valid token (2B,), and the backbone's hidden states (2B, L, H). ``scalar``: a
    :class:`ScalarHead`, or one wrapped in DistributedDataParallel."""
    scores, hidden = scalar(batch["input_ids"], batch["attention_mask"])  # (2B, L)
    last = last_valid_index(batch["attention_mask"])  # (2B,)
    return scores.gather(1, last.unsqueeze(1)).squeeze(1), hidden


def lm_loss_sum(model: PreTrainedModel, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss through the tied input embeddings (the classifier has no LM head)."""
    embeddings = model.get_input_embeddings().weight  # (V, H)
    assert isinstance(embeddings, torch.Tensor)
    logits = hidden[:, :-1] @ embeddings.T  # (2B, L-1, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")


@torch.no_grad()
def evaluate_pairs(model: PreTrainedModel, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """(accuracy, mean margin r_chosen - r_rejected) over ``batches``."""
    model.eval()
    margins = []
    for batch in batches:
        rewards, _ = pair_rewards(ScalarHead(model), batch)
        chosen, rejected = rewards.chunk(2)
        margins.append(chosen - rejected)
    margin = torch.cat(margins)
    return (margin > 0).float().mean().item(), margin.mean().item()


def train_rm(spec: JobSpec, out_dir: Path, callbacks: Callbacks, device: torch.device) -> JobResult:
    cfg = spec.config
    assert isinstance(cfg, RMConfig)
    seed_everything(spec.seed)
    ranks = Ranks.current()  # several processes: each takes its share of every batch

    # 1. data
    rows = load_rows(spec.dataset, "rm")
    eval_rows = load_rows(spec.eval_dataset, "rm") if spec.eval_dataset and ranks.is_main else []  # rank 0 evaluates
    total_steps = cfg.max_steps or max(1, int(cfg.epochs * len(rows)) // cfg.batch_size)

    # 2. model (scalar head on the starting model's backbone), optimizer, schedule, resume
    tokenizer = load_tokenizer(spec.model)
    run = Run(spec, out_dir, callbacks, tokenizer, ranks)

    def scalar_model(ref: str) -> PreTrainedModel:
        return prepare(load_scalar_model(ref, tokenizer, spec.seed), device, cfg.dtype, cfg.gradient_checkpointing)

    model = run.load_trained("policy", spec.model, scalar_model, "SEQ_CLS")
    check_fits(model, cfg.max_length, "hyperparameters.max_length")
    params = [p for p in model.parameters() if p.requires_grad]
    trained = ranks.wrap(ScalarHead(model))  # DistributedDataParallel with several processes
    optimizer = make_optimizer(params, cfg, cfg.learning_rate)
    scheduler = make_scheduler(optimizer, cfg, total_steps)
    start_step, _ = run.start(total_steps, optimizer, scheduler)
    if done := run.result_if_finished(start_step):
        return done
    eval_batches = [
        {k: v.to(device) for k, v in encode_pairs(tokenizer, eval_rows[i : i + 64], cfg.max_length).items()}
        for i in range(0, len(eval_rows), 64)
    ]

    for step in range(start_step + 1, total_steps + 1):
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
        loss_total, margins = torch.zeros((), device=device), []
        for i, batch in enumerate(micro_batches):
            with ranks.no_sync(trained, last=i == len(micro_batches) - 1):
                rewards, hidden = pair_rewards(trained, batch)  # (2b,)
                chosen, rejected = rewards.chunk(2)  # (b,), (b,)
                loss = -F.logsigmoid(chosen - rejected - cfg.margin).sum() / cfg.batch_size
                if cfg.lm_loss_coef > 0:
                    loss = loss + cfg.lm_loss_coef * lm_loss_sum(model, hidden, batch["labels"]) / n_lm_tokens
                (loss * ranks.loss_scale).backward()
            loss_total += loss.detach()
            margins.append((chosen - rejected).detach())
        loss_sum = ranks.sum(loss_total).item()
        check_finite("loss/rm", loss_sum, step)
        lr = optimizer.param_groups[0]["lr"]
        grad_norm = clip_and_step(params, optimizer, cfg.max_grad_norm)
        scheduler.step()

        # 4. metrics, eval, checkpoint, stop request
        margin = ranks.gather(torch.cat(margins))  # (B,)
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
        if eval_batches and (step == total_steps or (cfg.eval_every and step % cfg.eval_every == 0)):
            metrics["eval/accuracy"], metrics["eval/margin"] = evaluate_pairs(model, eval_batches)
        if result := run.end_step(step, metrics, {"policy": model}):
            return result
    raise AssertionError("unreachable: the last step ends the run")
