"""Torch-free validation of uploaded JSONL datasets (one JSON object a line, in the README's upload formats),
line by line, streaming.

Rows are checked by the engine's torch-free ``engine.rows``, with the same line numbers as the engine's
reader (lines split at LF only, ``engine.rows.split_lines``), so a file the API accepts is one the engine reads.
"""

from dataclasses import dataclass
from typing import BinaryIO

from engine.rows import DatasetError, is_chat, parse_line


class InvalidFile(ValueError):
    """A line of the upload is not a valid row; the message names the line."""


@dataclass
class Summary:
    rows: int
    """Rows (blank lines not counted)."""
    chat: bool
    """Whether any row holds chat messages (a model needs a chat template to train on them)."""


def _check_row(text: str, purpose: str, number: int) -> bool:
    """Whether the row is a chat row; raises InvalidFile."""
    try:
        return is_chat(parse_line(text, purpose, number))
    except DatasetError as e:
        raise InvalidFile(str(e)) from None


MAX_LINE_BYTES = 1024 * 1024
"""Default cap on one line of an upload (``Settings.max_line_bytes``)."""


def count_rows(stream: BinaryIO, purpose: str, max_line_bytes: int = MAX_LINE_BYTES) -> int:
    """The number of rows of a valid ``purpose`` dataset; raises InvalidFile at the first bad line."""
    return summarize(stream, purpose, max_line_bytes).rows


def summarize(stream: BinaryIO, purpose: str, max_line_bytes: int = MAX_LINE_BYTES) -> Summary:
    """Rows of a valid ``purpose`` dataset, and whether they are chat rows; raises InvalidFile at the first bad
    line.

    Blank lines are skipped; a file with no rows is invalid. A line longer than ``max_line_bytes`` (its
    LF or CRLF ending not counted) is refused without reading more of it than the cap.
    """
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
            chat |= _check_row(line, purpose, number)
            rows += 1
    if rows == 0:
        raise InvalidFile("the file has no rows")
    return Summary(rows, chat)
