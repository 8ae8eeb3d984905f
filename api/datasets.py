"""Torch-free validation of uploaded JSONL datasets (one JSON object a line, in the README's upload formats),
line by line, streaming.

Rows are checked by the engine's torch-free ``engine.spec.rows``, with the same line numbers as the engine's
reader (lines split at LF only, ``engine.spec.rows.split_lines``), so a file the API accepts is one the engine reads.
"""

from dataclasses import dataclass
from typing import BinaryIO

from engine.spec.rows import FINE_TUNE, DatasetError, dataset_kind, fine_tune_kind, is_chat, parse_json, validate_row


class InvalidFile(ValueError):
    """A line of the upload is not a valid row; the message names the line."""


@dataclass
class Summary:
    rows: int
    """Rows (blank lines not counted)."""
    chat: bool
    """Whether any row holds chat messages (a model needs a chat template to train on them)."""
    kind: str
    """What the rows are: sft, preference or prompts."""


_METHODS = {"sft": "supervised", "preference": "dpo", "prompts": "reinforcement"}
"""The OpenAI fine-tuning method each kind of row is for."""


def _check_row(text: str, kind: str | None, number: int) -> tuple[bool, str]:
    """Whether the row is a chat row, and its kind; raises InvalidFile. ``kind`` None: a row of OpenAI's
    fine-tuning formats, whose kind the row tells."""
    try:
        row = parse_json(text, number)
        found = fine_tune_kind(row, number) if kind is None else kind
        return is_chat(validate_row(row, found, number)), found
    except DatasetError as e:
        raise InvalidFile(str(e)) from None


MAX_LINE_BYTES = 1024 * 1024
"""Default cap on one line of an upload (``Settings.max_line_bytes``)."""


def summarize(stream: BinaryIO, purpose: str, max_line_bytes: int = MAX_LINE_BYTES) -> Summary:
    """Rows of a valid ``purpose`` dataset, whether they are chat rows, and their kind; raises InvalidFile at the
    first bad line. A ``fine-tune`` file's kind is its first row's (supervised, DPO or reinforcement rows), and
    every row must be of that kind.

    Blank lines are skipped; a file with no rows is invalid. A line longer than ``max_line_bytes`` (its
    LF or CRLF ending not counted) is refused without reading more of it than the cap.
    """
    detect = purpose == FINE_TUNE
    kind: str | None = None if detect else dataset_kind(purpose)
    number = rows = 0
    chat = False
    while raw := stream.readline(max_line_bytes + 2):  # split at b"\n" only, as the engine's split_lines
        content = raw.removesuffix(b"\n").removesuffix(b"\r") if raw.endswith(b"\n") else raw
        number += 1
        if len(content) > max_line_bytes:
            raise InvalidFile(f"line {number}: longer than the limit of {max_line_bytes} bytes")
        try:
            line = content.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidFile(f"line {number}: not valid UTF-8 text") from None
        if line.strip():
            is_chat_row, found = _check_row(line, None if detect else kind, number)
            if kind is None:
                kind = found
            elif found != kind:  # only a fine-tune file's rows can differ
                raise InvalidFile(
                    f"line {number}: a {_METHODS[found]} row in a file of {_METHODS[kind]} rows (its first row's "
                    "kind); a fine-tune file holds rows of one method"
                )
            chat |= is_chat_row
            rows += 1
    if rows == 0 or kind is None:
        raise InvalidFile("the file has no rows")
    return Summary(rows, chat, kind)
