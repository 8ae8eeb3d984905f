"""Datasets: loading and validating rows, tokenising them, and a resumable batch order."""

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from engine import builtin
from engine.rows import DatasetError, parse_line


def parse_jsonl(lines: list[str], kind: str) -> list[dict[str, str]]:
    """Parse and validate JSONL text; blank lines are skipped, any bad line fails the whole file."""
    rows = [parse_line(line, kind, number) for number, line in enumerate(lines, start=1) if line.strip()]
    if not rows:
        raise DatasetError("the dataset has no rows")
    return rows


def load_rows(ref: str, kind: str) -> list[dict[str, str]]:
    """Rows of a dataset: ``builtin:<name>`` or a JSONL file path."""
    if ref.startswith("builtin:"):
        name = ref.removeprefix("builtin:")
        if name not in builtin.DATASETS:
            raise DatasetError(f"unknown built-in dataset {ref!r}")
        row_kind, make_rows = builtin.DATASETS[name]
        if row_kind != kind:
            raise DatasetError(f"{ref} holds {row_kind} rows, but a {kind} dataset is needed")
        return make_rows()
    path = Path(ref)
    if not path.is_file():
        raise DatasetError(f"dataset not found: {ref}")
    return parse_jsonl(path.read_text(encoding="utf-8").splitlines(), kind)


def batch_indices(n_rows: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Row indices of the 0-based ``step``: a fresh seeded permutation per epoch, last partial batch dropped.

    Depends only on its arguments, so a resumed job continues the exact same order.
    """
    steps_per_epoch = n_rows // batch_size
    if steps_per_epoch == 0:
        raise DatasetError(f"the dataset has {n_rows} rows, fewer than one batch of {batch_size}")
    epoch, position = divmod(step, steps_per_epoch)
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    permutation = torch.randperm(n_rows, generator=generator)
    return permutation[position * batch_size : (position + 1) * batch_size].tolist()


def encode_pair(
    tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str, max_length: int
) -> tuple[list[int], int]:
    """Token ids of prompt + completion + EOS, and how many of them are prompt.

    Over-long examples lose tokens from the start of the prompt, then from the end of the completion.
    """
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = [*tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    completion_ids = completion_ids[:max_length]
    prompt_ids = prompt_ids[max(0, len(prompt_ids) + len(completion_ids) - max_length) :]
    return prompt_ids + completion_ids, len(prompt_ids)


def pad_right(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, L), padded on the right."""
    length = max(map(len, sequences))
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention_mask[i, : len(seq)] = 1
    return input_ids, attention_mask


def encode_sft_batch(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, str]], max_length: int
) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and labels (B, L); labels are -100 on prompt and padding."""
    encoded = [encode_pair(tokenizer, r["prompt"], r["completion"], max_length) for r in rows]
    input_ids, attention_mask = pad_right([ids for ids, _ in encoded], tokenizer.pad_token_id)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    for i, (_, n_prompt) in enumerate(encoded):
        labels[i, :n_prompt] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_prompt_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask (B, P); long prompts keep their last tokens.

    An empty prompt becomes the BOS token (EOS where there is none), so sampling starts unconditioned.
    """
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"][-max_prompt_length:] or [start] for p in prompts]
    length = max(map(len, ids))
    input_ids = torch.full((len(ids), length), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(ids), length), dtype=torch.long)
    for i, seq in enumerate(ids):
        input_ids[i, length - len(seq) :] = torch.tensor(seq)
        attention_mask[i, length - len(seq) :] = 1
    return input_ids, attention_mask
