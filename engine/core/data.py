"""Datasets: loading and validating rows, tokenising them, and a resumable batch order."""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from engine import builtin
from engine.spec.rows import (
    ChatTemplateMissingError,
    DatasetError,
    Message,
    Text,
    dataset_kind,
    is_chat,
    parse_line,
    split_lines,
    split_prompt,
)


def parse_jsonl(lines: list[str], kind: str) -> list[dict[str, Any]]:
    """Parse and validate JSONL text; blank lines are skipped, any bad line fails the whole file."""
    rows = [parse_line(line, kind, number) for number, line in enumerate(lines, start=1) if line.strip()]
    if not rows:
        raise DatasetError("the dataset has no rows")
    return rows


def load_rows(ref: str, kind: str) -> list[dict[str, Any]]:
    """Rows of a dataset: ``builtin:<name>`` or a JSONL file path."""
    if ref.startswith("builtin:"):
        name = ref.removeprefix("builtin:")
        if name not in builtin.DATASETS:
            raise DatasetError(f"unknown built-in dataset {ref!r}")
        row_kind, make_rows = builtin.DATASETS[name]
        if row_kind != dataset_kind(kind):
            raise DatasetError(f"{ref} holds {row_kind} rows, but a {dataset_kind(kind)} dataset is needed")
        return make_rows()
    path = Path(ref)
    if not path.is_file():
        raise DatasetError(f"dataset not found: {ref}")
    return parse_jsonl(split_lines(path.read_text(encoding="utf-8")), kind)


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


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The tokens of ``text`` alone, no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens the tokenizer puts before a text (Llama's BOS; none for GPT-2 or Qwen2)."""
    marked, plain = list(tokenizer("x", add_special_tokens=True)["input_ids"]), text_ids(tokenizer, "x")
    for start in range(len(marked) - len(plain) + 1):
        if marked[start : start + len(plain)] == plain:
            return marked[:start]
    return []


def render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], add_generation_prompt: bool) -> str:
    """Messages as the tokenizer's chat template writes them (``add_generation_prompt``: ending with the opening
    of the assistant's turn)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateMissingError("chat messages need a tokenizer with a chat template, and this one has none")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except TemplateError as e:  # the template's own raise_exception, e.g. Gemma's "System role not supported"
        roles = ", ".join(m["role"] for m in messages)
        raise DatasetError(f"the model's chat template refused messages of roles ({roles}): {e}") from None
    assert isinstance(text, str)
    return text


def require_chat_template(tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]], field: str) -> None:
    """Refuse chat rows up front when the tokenizer cannot render them (``field``: the spec field they came from):
    it has no chat template, or the template refuses a row (rendered once per sequence of roles, which is what
    templates check: Gemma refuses a system turn, others turns that do not alternate); the error names the row."""
    if not any(is_chat(row) for row in rows):
        return
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateMissingError(
            f"{field}: the rows are chat messages, and the model's tokenizer has no chat template to render them "
            "with; use plain-text rows, or a model whose tokenizer has a chat template"
        )
    rendered: set[tuple[tuple[str, ...], bool]] = set()
    for number, row in enumerate(rows, start=1):
        for messages, generation in chat_renderings(row):
            roles = tuple(m["role"] for m in messages)
            if (roles, generation) not in rendered:
                rendered.add((roles, generation))
                try:
                    render(tokenizer, messages, add_generation_prompt=generation)
                except DatasetError as e:
                    raise DatasetError(f"{field} row {number}: {e}") from None


def chat_renderings(row: dict[str, Any]) -> list[tuple[list[Message], bool]]:
    """The conversations a valid chat row is rendered as in training, each with whether it ends with the generation
    prompt: a prompt alone does, the others are whole conversations (a plain-text row: none)."""
    if "messages" in row:
        return [([{"role": m["role"], "content": m["content"]} for m in row["messages"]], False)]
    if not is_chat(row):
        return []
    if "prompt" not in row:  # implicit-prompt preference rows: two whole conversations
        return [(row["chosen"], False), (row["rejected"], False)]
    answers = [row[field] for field in ("completion", "chosen", "rejected") if field in row]
    return [([*row["prompt"], *answer], False) for answer in answers] or [(row["prompt"], True)]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: Text) -> list[int]:
    """The tokens a sequence starts with: the tokenizer's own prefix (BOS where it adds one) and the text, or the
    messages rendered by the chat template with the generation prompt (the template writes its own BOS)."""
    if isinstance(prompt, str):
        return special_prefix(tokenizer) + text_ids(tokenizer, prompt)
    return text_ids(tokenizer, render(tokenizer, prompt, add_generation_prompt=True))


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], first_trained: int = 0
) -> tuple[list[int], list[bool]]:
    """Token ids of a rendered conversation, and which of them are trained: the assistant messages from index
    ``first_trained`` on (but those of OpenAI's ``"weight": 0``), each from the end of the generation prompt
    before it to the end of its turn.

    Rendered turn by turn (the conversation up to each trained message, with and without it), so the trained
    tokens are exactly what sampling after that prompt would have to produce. The last trained turn ends with
    EOS (added when the template does not write it). A template whose shorter conversations are not the start
    of the longer ones (Qwen3 drops the reasoning of earlier turns, Phi-3 ends every rendering with EOS) is
    read from one rendering of the whole conversation instead (:func:`encode_rendered`).
    """
    ids: list[int] = []
    trained: list[bool] = []
    done = ""

    def add(text: str, is_trained: bool) -> None:
        new = text_ids(tokenizer, text)
        ids.extend(new)
        trained.extend([is_trained] * len(new))

    untrained = {i for i, message in enumerate(messages) if message.get("weight") == 0}
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]  # the template sees no weights
    targets = [
        i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first_trained and i not in untrained
    ]
    for i in targets:
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        after = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (before.startswith(done) and after.startswith(before)):  # a later turn rewrites an earlier one
            return encode_rendered(tokenizer, messages, targets)
        add(before[len(done) :], False)
        start = len(ids)
        add(after[len(before) :], True)
        if tokenizer.eos_token_id not in ids[start:]:
            ids.append(tokenizer.eos_token_id)
            trained.append(True)
        done = after
    whole = render(tokenizer, messages, add_generation_prompt=False)
    if whole.startswith(done) and whole[len(done) :]:
        add(whole[len(done) :], False)
    return ids, trained


def encode_rendered(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], targets: list[int]
) -> tuple[list[int], list[bool]]:
    """Token ids of the conversation rendered once, whole, and which are trained: the turns of the assistant
    messages ``targets``, as that rendering writes them (TRL trains the same text, marked by the template's
    ``{% generation %}`` blocks where it has them).

    Each turn is found without help from the template: its content is where the rendering changes when only that
    message's content does; the turn starts where the generation prompt before it ends (when rendering up to it
    with the generation prompt gives the start of the whole, else with its content) and ends with what the template
    writes after the content of a last message (``<|im_end|>``, ``<|end|>``), as far as the whole rendering writes
    it too. The last trained turn ends with EOS (added when the template does not write it).
    """
    whole = render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i in targets:
        start, end = _content_span(tokenizer, messages, i, whole)
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True)
        if whole.startswith(prompt) and len(prompt) <= start:
            start = len(prompt)
        last = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        closing = last[_content_span(tokenizer, messages[: i + 1], i, last)[1] :]  # e.g. "<|im_end|>\n"
        end += max(cut for cut in _token_ends(tokenizer, closing) if whole.startswith(closing[:cut], end))
        if spans and start < spans[-1][1]:
            raise DatasetError(f"the chat template writes assistant message {i} inside the one before it")
        spans.append((start, end))
    ids: list[int] = []
    trained: list[bool] = []
    position = 0
    for start, end in spans:
        for text, is_trained in ((whole[position:start], False), (whole[start:end], True)):
            new = text_ids(tokenizer, text)
            ids.extend(new)
            trained.extend([is_trained] * len(new))
        position = end
    if tokenizer.eos_token_id not in text_ids(tokenizer, whole[spans[-1][0] : spans[-1][1]]):
        ids.append(tokenizer.eos_token_id)
        trained.append(True)
    tail = text_ids(tokenizer, whole[position:])
    return ids + tail, trained + [False] * len(tail)


def _token_ends(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """0 and the offsets in ``text`` where its tokens end (every offset when the tokenizer cannot tell)."""
    try:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    except NotImplementedError:  # a slow tokenizer
        return list(range(len(text) + 1))
    return [0, *(end for _, end in offsets)]


def _content_span(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], i: int, rendered: str
) -> tuple[int, int]:
    """Where ``rendered`` (``messages`` rendered without the generation prompt) holds what message ``i``'s content
    became: the part that changes when that content is replaced by a character found nowhere in it."""
    marker = next(c for c in "\ue000\ue001\ue002\ue003" if c not in rendered)
    swapped = render(tokenizer, [*messages[:i], {**messages[i], "content": marker}, *messages[i + 1 :]], False)
    start = 0
    while start < min(len(rendered), len(swapped)) and rendered[start] == swapped[start]:
        start += 1
    end = 0
    while end < min(len(rendered), len(swapped)) - start and rendered[-1 - end] == swapped[-1 - end]:
        end += 1
    if marker not in swapped[start : len(swapped) - end]:
        raise DatasetError(f"the chat template does not write the content of assistant message {i}")
    return start, len(rendered) - end


def encode_completion(
    tokenizer: PreTrainedTokenizerBase, prompt: Text, completion: Text
) -> tuple[list[int], list[bool]]:
    """Prompt then completion, and which tokens are the completion's: plain text as prefix + prompt +
    completion + EOS, messages as the chat template renders them."""
    if isinstance(prompt, str) and isinstance(completion, str):
        head = prompt_ids(tokenizer, prompt)
        tail = [*text_ids(tokenizer, completion), tokenizer.eos_token_id]
        return head + tail, [False] * len(head) + [True] * len(tail)
    assert isinstance(prompt, list) and isinstance(completion, list)
    return encode_conversation(tokenizer, [*prompt, *completion], first_trained=len(prompt))


def truncate(ids: list[int], trained: list[bool], max_length: int) -> tuple[list[int], list[bool]]:
    """At most ``max_length`` tokens: first dropped from the start of the prompt (the tokens before the first
    trained one), then from the end."""
    first = trained.index(True) if True in trained else len(ids)
    drop = max(0, min(first, len(ids) - max_length))
    return ids[drop:][:max_length], trained[drop:][:max_length]


def sequence_lengths(tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict[str, Any]], kind: str) -> list[int]:
    """The tokens each row trains on before any cut: an ``sft`` row's example, a ``preference`` row's longer
    completion (prompt included)."""
    if kind == "sft":
        return [len(encode_sft_example(tokenizer, row)[0]) for row in rows]
    lengths = []
    for row in rows:
        prompt, chosen, rejected = preference_parts(row)
        lengths.append(max(len(encode_completion(tokenizer, prompt, text)[0]) for text in (chosen, rejected)))
    return lengths


def encode_sft_example(tokenizer: PreTrainedTokenizerBase, row: dict[str, Any]) -> tuple[list[int], list[bool]]:
    if "text" in row and "prompt" not in row and "messages" not in row:  # the whole text trained, then EOS
        head, tail = special_prefix(tokenizer), [*text_ids(tokenizer, row["text"]), tokenizer.eos_token_id]
        return head + tail, [False] * len(head) + [True] * len(tail)
    if "messages" in row:
        return encode_conversation(tokenizer, row["messages"])
    return encode_completion(tokenizer, row["prompt"], row["completion"])


def preference_parts(row: dict[str, Any]) -> tuple[Text, Text, Text]:
    """(prompt, chosen, rejected) of a preference row, the implicit-prompt form made explicit."""
    if "prompt" not in row:
        return split_prompt(row)
    return row["prompt"], row["chosen"], row["rejected"]


def pad_right(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, L), padded on the right."""
    length = max(map(len, sequences))
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention_mask[i, : len(seq)] = 1
    return input_ids, attention_mask


def labelled_batch(
    encoded: list[tuple[list[int], list[bool]]], pad_id: int, max_length: int
) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and labels (B, L), right-padded; labels are -100 except on trained tokens."""
    cut = [truncate(ids, trained, max_length) for ids, trained in encoded]
    input_ids, attention_mask = pad_right([ids for ids, _ in cut], pad_id)
    labels = torch.full_like(input_ids, -100)
    for i, (ids, trained) in enumerate(cut):
        flags = torch.tensor(trained, dtype=torch.bool)
        labels[i, : len(ids)] = torch.where(flags, torch.tensor(ids), -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def encode_sft_batch(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]], max_length: int
) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and labels (B, L); labels are -100 on prompts, non-assistant turns and padding."""
    return labelled_batch([encode_sft_example(tokenizer, row) for row in rows], tokenizer.pad_token_id, max_length)


def prompt_length_limit(lengths: Sequence[int], max_prompt_length: int | None, room: int | None) -> int:
    """The most prompt tokens a job keeps: ``max_prompt_length`` when given, else the longest of ``lengths`` (the
    dataset's prompts, in tokens) capped by ``room`` (the model's context minus the response length; None: no
    cap)."""
    if max_prompt_length is not None:
        return max_prompt_length
    longest = max(lengths, default=1)
    return max(1, min(longest, room)) if room is not None else longest


def truncation_warning(
    lengths: Sequence[int], limit: int, what: str, param: str, kept: str = "keep only their last {limit} tokens"
) -> tuple[str, dict[str, object]]:
    """The event of ``what`` (e.g. "prompts") longer than ``limit`` tokens, cut as ``kept`` says (by default they
    lose their first tokens): a message and ``{"param", "truncated", "of", "longest", "limit"}``; raises ValueError
    when none is longer."""
    cut = [n for n in lengths if n > limit]
    if not cut:
        raise ValueError(f"no {what} are longer than {limit} tokens")
    message = (
        f"{len(cut)} of {len(lengths)} {what} are longer than {param} ({limit} tokens; the longest has "
        f"{max(cut)}) and {kept.format(limit=limit)}"
    )
    return message, {"param": param, "truncated": len(cut), "of": len(lengths), "longest": max(cut), "limit": limit}


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Text], max_prompt_length: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask (B, P); prompts longer than ``max_prompt_length`` keep their last tokens
    (None: every prompt whole).

    An empty prompt becomes the BOS token (EOS where there is none), so sampling starts unconditioned.
    """
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    whole = [prompt_ids(tokenizer, p) for p in prompts]
    ids = [(seq[-max_prompt_length:] if max_prompt_length else seq) or [start] for seq in whole]
    length = max(map(len, ids))
    input_ids = torch.full((len(ids), length), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(ids), length), dtype=torch.long)
    for i, seq in enumerate(ids):
        input_ids[i, length - len(seq) :] = torch.tensor(seq)
        attention_mask[i, length - len(seq) :] = 1
    return input_ids, attention_mask
