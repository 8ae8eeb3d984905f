"""Dataset rows, torch-free so the API validates uploads with the very rules the engine reads by.

A dataset's kind says what its rows hold, whichever job reads them (a preference file feeds a reward model
and DPO alike). Each kind takes plain-string rows and TRL's conversational rows (lists of ``{"role", "content"}``
messages, https://huggingface.co/docs/trl/dataset_formats):

- ``sft``: ``{"prompt": str, "completion": str}``; ``{"text": str}`` (the loss on the whole text);
  ``{"messages": [...]}`` (the loss on every assistant turn); ``{"prompt": [...], "completion": [...]}`` (the
  loss on the completion's messages).
- ``preference``: ``{"prompt": str, "chosen": str, "rejected": str}``; the same with message lists; or only
  ``{"chosen": [...], "rejected": [...]}``, two whole conversations whose common first messages are the prompt
  (plain strings: their common first words).
- ``prompts``: ``{"prompt": str}`` or ``{"prompt": [...]}`` (rendered with the generation prompt; messages end
  before the answer: not with an assistant message).

``rm`` and ``ppo``, the kinds' names before there were more job types than kinds, stay accepted as aliases.

Each kind also reads the row format of OpenAI's fine-tuning API (https://platform.openai.com/docs/api-reference/
fine-tuning), made one of the rows above by :func:`validate_row`:

- ``sft``: ``{"messages": [...]}``, an assistant message may carry ``"weight": 0`` (not trained) or ``1``.
- ``preference``: DPO's ``{"input": {"messages": [...]}, "preferred_output": [...], "non_preferred_output": [...]}``
  → ``{"prompt", "chosen", "rejected"}``.
- ``prompts``: reinforcement's ``{"messages": [...], ...}`` (the conversation to answer) → ``{"prompt": [...]}``.

ShareGPT rows (``{"conversations": [{"from": "human" | "gpt" | "system", "value": str}, ...]}``, preferences with
``chosen`` and ``rejected`` answers ``{"from": "gpt", "value"}``) are made message rows of each kind.

A file uploaded with ``purpose: "fine-tune"`` holds one of these; :func:`fine_tune_kind` tells which from a row.

Columns beyond these are kept with the row (reward functions may read them).
"""

import json
from typing import Any, Literal

Message = dict[str, str]
"""One chat message: ``{"role": ..., "content": ...}``."""
Text = str | list[Message]
"""A prompt or a completion: plain text, or messages for the tokenizer's chat template."""

DatasetKind = Literal["sft", "preference", "prompts"]
KIND_ALIASES: dict[str, DatasetKind] = {"rm": "preference", "ppo": "prompts"}
"""Earlier names of the kinds (a file's ``purpose``), still accepted."""
# Required fields of a plain row, per dataset kind.
ROW_FIELDS: dict[str, tuple[str, ...]] = {
    "sft": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
    "prompts": ("prompt",),
}
MESSAGE_KEYS = frozenset({"role", "content"})
FINE_TUNE = "fine-tune"
"""The ``purpose`` of a file in one of OpenAI's fine-tuning formats; its rows' kind is found from them."""
DPO_FIELDS = ("input", "preferred_output", "non_preferred_output")
"""The fields of a row of OpenAI's DPO format."""


class DatasetError(ValueError):
    """A dataset reference names nothing readable, or a row is malformed."""


class ChatTemplateMissingError(DatasetError):
    """Chat rows, and a tokenizer without a chat template to render them with."""


def dataset_kind(name: str) -> DatasetKind:
    """The kind ``name`` stands for (``rm`` → ``preference``, ``ppo`` → ``prompts``); ValueError if none."""
    kind = KIND_ALIASES.get(name, name)
    if kind not in ROW_FIELDS:
        raise ValueError(f"unknown dataset kind {name!r}; known: {', '.join(ROW_FIELDS)}")
    return kind  # type: ignore[return-value]  # one of ROW_FIELDS' keys


def is_chat(row: dict[str, Any]) -> bool:
    """Whether a valid row holds messages rather than plain strings."""
    return "messages" in row or isinstance(row.get("prompt", row.get("chosen")), list)


def fine_tune_kind(row: object, line: int) -> DatasetKind:
    """The kind of a row of OpenAI's fine-tuning formats: ``preference`` (DPO's fields), ``sft`` (``messages``
    ending with an assistant message: supervised) or ``prompts`` (``messages`` ending otherwise: reinforcement)."""
    if isinstance(row, dict) and any(field in row for field in DPO_FIELDS):
        return "preference"
    if isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
        last = row["messages"][-1]
        return "sft" if isinstance(last, dict) and last.get("role") == "assistant" else "prompts"
    raise DatasetError(
        f'line {line}: not a row of OpenAI\'s fine-tuning formats: expected {{"messages": [...]}} (supervised, or '
        'reinforcement when the last message is not the assistant\'s) or DPO\'s {"input", "preferred_output", '
        '"non_preferred_output"}'
    )


def validate_row(row: object, kind: str, line: int) -> dict[str, Any]:
    """A row of ``kind`` (extra columns kept; OpenAI's formats made ours), or a DatasetError naming the line and
    the field."""
    kind = dataset_kind(kind)
    if not isinstance(row, dict):
        raise DatasetError(f"line {line}: expected a JSON object, got {type(row).__name__}")
    if "conversations" in row and "messages" not in row and "prompt" not in row:
        return _from_sharegpt(row, kind, line)
    if kind == "sft" and "text" in row and not any(field in row for field in ("messages", *ROW_FIELDS["sft"])):
        if not isinstance(row["text"], str) or not row["text"]:
            raise DatasetError(f"line {line}: field 'text' must be a non-empty string")
        return row  # TRL's language-modelling rows: the loss on the whole text
    if kind == "sft" and "messages" in row:
        messages = _messages(row["messages"], line, "messages", weighted=True)
        if not any(m["role"] == "assistant" and m.get("weight", 1) for m in messages):
            raise DatasetError(f"line {line}: field 'messages' has no assistant message to train on")
        return row
    if kind == "preference" and any(field in row for field in DPO_FIELDS):
        return _from_openai_dpo(row, line)
    if kind == "prompts" and "messages" in row and "prompt" not in row:
        prompt = _prompt_messages(row["messages"], line, "messages")
        return {"prompt": prompt, **{k: v for k, v in row.items() if k != "messages"}}
    if kind == "preference" and "prompt" not in row and isinstance(row.get("chosen"), list):
        split_prompt(row, line)  # the implicit-prompt form
        return row
    if kind == "preference" and "prompt" not in row and isinstance(row.get("chosen"), str):
        return {**row, **_split_text_prompt(row, line)}
    fields = ROW_FIELDS[kind]
    if isinstance(row.get("prompt"), list):  # conversational: every field a list of messages
        if kind == "prompts":
            _prompt_messages(row["prompt"], line, "prompt")
        for field in fields:
            _messages(row.get(field), line, field)
        for field in fields[1:]:
            if row[field][-1]["role"] != "assistant":
                raise DatasetError(f"line {line}: field {field!r} must end with an assistant message")
        return row
    for field in fields:
        value = row.get(field)
        if not isinstance(value, str) or not value:
            raise DatasetError(f"line {line}: field {field!r} must be a non-empty string (or a list of messages)")
    return row


def split_prompt(row: dict[str, Any], line: int = 0) -> tuple[list[Message], list[Message], list[Message]]:
    """(prompt, chosen, rejected) of an implicit-prompt preference row: the prompt is the messages the two
    conversations share from the start (as TRL's ``extract_prompt``); each keeps at least its last message."""
    chosen = _messages(row.get("chosen"), line, "chosen")
    rejected = _messages(row.get("rejected"), line, "rejected")
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    for field, messages in (("chosen", chosen), ("rejected", rejected)):
        if messages[-1]["role"] != "assistant":
            raise DatasetError(f"line {line}: field {field!r} must end with an assistant message")
    return chosen[:shared], chosen[shared:], rejected[shared:]


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
"""ShareGPT's ``from`` → the message's ``role``."""


def _from_sharegpt(row: dict[str, Any], kind: str, line: int) -> dict[str, Any]:
    """A ShareGPT row (``{"conversations": [{"from", "value"}, ...]}``; preferences with ``chosen`` and
    ``rejected`` answers ``{"from": "gpt", "value"}``, as LLaMA-Factory reads them) as a row of messages."""

    def messages(value: object, field: str) -> list[Message]:
        items = value if isinstance(value, list) else [value]
        converted = []
        for i, item in enumerate(items):
            if not (
                isinstance(item, dict) and item.get("from") in SHAREGPT_ROLES and isinstance(item.get("value"), str)
            ):
                raise DatasetError(
                    f'line {line}: field {field!r} item {i}: a ShareGPT row\'s turns are {{"from": str, "value": str}} '
                    f"with 'from' one of {', '.join(SHAREGPT_ROLES)}"
                )
            converted.append({"role": SHAREGPT_ROLES[item["from"]], "content": item["value"]})
        return _messages(converted, line, field)

    turns = messages(row["conversations"], "conversations")
    rest = {k: v for k, v in row.items() if k not in ("conversations", "chosen", "rejected")}
    if kind == "preference":
        return validate_row(
            {
                "prompt": turns,
                "chosen": messages(row.get("chosen"), "chosen"),
                "rejected": messages(row.get("rejected"), "rejected"),
                **rest,
            },
            kind,
            line,
        )
    return validate_row({("messages" if kind == "sft" else "prompt"): turns, **rest}, kind, line)


def _split_text_prompt(row: dict[str, Any], line: int) -> dict[str, str]:
    """The prompt, chosen and rejected of an implicit-prompt preference row of plain strings: the prompt is the text
    both share from the start, up to the last space before they differ (TRL's ``extract_prompt`` cuts where they
    differ; a space keeps every word whole)."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if not (isinstance(chosen, str) and isinstance(rejected, str) and chosen and rejected):
        raise DatasetError(f"line {line}: fields 'chosen' and 'rejected' must be non-empty strings")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    cut = chosen.rfind(" ", 0, shared)
    if cut <= 0:
        raise DatasetError(
            f"line {line}: a preference row without 'prompt' needs 'chosen' and 'rejected' to start with the same "
            "words (the prompt) and then differ; give the prompt as 'prompt'"
        )
    return {"prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[cut:]}


def _from_openai_dpo(row: dict[str, Any], line: int) -> dict[str, Any]:
    """A row of OpenAI's DPO format as ``{"prompt", "chosen", "rejected"}`` message lists."""
    source = row.get("input")
    if not isinstance(source, dict) or source.keys() != {"messages"}:
        raise DatasetError(f"line {line}: field 'input' must be {{\"messages\": [...]}} (tools are not supported)")
    prompt = _messages(source["messages"], line, "input.messages")
    parts = {"prompt": prompt}
    for field, name in (("preferred_output", "chosen"), ("non_preferred_output", "rejected")):
        messages = _messages(row.get(field), line, field)
        if messages[-1]["role"] != "assistant":
            raise DatasetError(f"line {line}: field {field!r} must end with an assistant message")
        parts[name] = messages
    return {**parts, **{k: v for k, v in row.items() if k not in DPO_FIELDS}}


def _prompt_messages(value: object, line: int, field: str) -> list[Message]:
    """The messages of a ``prompts`` row: a conversation for the policy to answer, which must not end with the
    answer (an assistant message): trained on, a policy would read the answer in its prompt."""
    messages = _messages(value, line, field)
    if messages[-1]["role"] == "assistant":
        raise DatasetError(
            f"line {line}: field {field!r} ends with an assistant message; a prompt is the conversation the policy "
            "answers, so it must end before the answer (put a reference answer in another column, e.g. "
            "'reference_answer', for the graders)"
        )
    return messages


def _messages(value: object, line: int, field: str, weighted: bool = False) -> list[Message]:
    """``value`` as a list of messages; with ``weighted``, an assistant message may also carry OpenAI's ``weight``
    (0: not trained, 1: trained)."""
    if not isinstance(value, list) or not value:
        raise DatasetError(f"line {line}: field {field!r} must be a non-empty list of messages")
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or message.keys() - {"weight"} != MESSAGE_KEYS
            or not all(isinstance(message[k], str) for k in MESSAGE_KEYS)
            or not message["role"]
        ):
            raise DatasetError(f'line {line}: field {field!r} item {i} must be {{"role": str, "content": str}}')
        if "weight" in message and not (
            weighted
            and message["role"] == "assistant"
            and message["weight"] in (0, 1)
            and type(message["weight"]) is int
        ):
            raise DatasetError(
                f"line {line}: field {field!r} item {i}: 'weight' (0 or 1) is for the assistant messages of "
                "supervised rows"
            )
    return value


def parse_line(text: str, kind: str, line: int) -> dict[str, Any]:
    """One JSONL line as a row of ``kind``."""
    return validate_row(parse_json(text, line), kind, line)


def parse_json(text: str, line: int) -> object:
    """One JSONL line's value, or a DatasetError naming the line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"line {line}: invalid JSON ({e.msg})") from None
    except RecursionError:
        raise DatasetError(f"line {line}: invalid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise DatasetError(f"line {line}: invalid JSON ({e})") from None


def split_lines(text: str) -> list[str]:
    """JSONL lines: split at LF only (a CRLF's CR dropped), never at the other line breaks ``str.splitlines``
    knows (U+2028, U+0085, ...), which valid JSON may hold raw inside a string."""
    return [line.removesuffix("\r") for line in text.split("\n")]
