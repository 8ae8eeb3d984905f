"""The API's torch-free JSONL check agrees with the engine's reader, line numbers included."""

import io

import pytest

from api.datasets import InvalidFile, count_rows
from engine.data import DatasetError, parse_jsonl
from engine.rows import split_lines

CASES = [
    b'{"prompt": "a", "completion": "b"}\n',
    b'{"prompt": "a", "completion": "b"}',
    b'\n\n{"prompt": "a", "completion": "b"}\n\n',
    b'{"prompt": "a", "completion": "b"}\r\n{"prompt": "c", "completion": "d"}\r\n',
    b'{"prompt": "a", "completion": "b"}\r{"prompt": "c"}\r',
    b'{"prompt": "a", "completion": "b"}\n{"prompt": "a\xe2\x80\xa8b", "completion": "c"}\n',  # U+2028 in a string
    b'{"prompt": "a", "completion": "b"}\n\x0c\n{"prompt": "a"}\n',
    b'{"prompt": "a", "completion": "b"}\n[1]\n',
    b'{"prompt": "a", "completion": 3}\n',
    b'{"prompt": "", "completion": "b"}\n',
    b"\n  \n",
    b"",
    b'\xef\xbb\xbf{"prompt": "a", "completion": "b"}\n',  # a byte-order mark
    b'{"prompt": "a", "completion": "b"}\n' + b"[" * 5000 + b"]" * 5000 + b"\n",  # nested too deeply for json
    b'{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": "b", "n": ' + b"9" * 5000 + b"}\n",
]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"prompt": "a\xe2\x80\xa8b", "completion": "c\xc2\x85d"}\n', 1),  # raw U+2028 and U+0085 in strings
        (b'{"prompt": "a", "completion": "b"}\n' + b"[" * 5000 + b"]" * 5000 + b"\n", "line 2"),
        (b'{"prompt": "a", "completion": "b", "n": ' + b"9" * 5000 + b"}\n", "line 1"),
    ],
)
def test_line_breaks_in_strings_are_text_and_unparsable_lines_are_named(content: bytes, expected: int | str) -> None:
    try:
        got: int | str = count_rows(io.BytesIO(content), "sft")
    except InvalidFile as e:
        got = verdict(e)
    assert got == expected


def verdict(error: Exception) -> str:
    """``line N`` for a bad line, ``empty`` for a file without rows."""
    message = str(error)
    return message.split(":")[0] if message.startswith("line ") else "empty"


@pytest.mark.parametrize("content", CASES)
def test_same_verdict_as_the_engine(content: bytes) -> None:
    try:
        expected: int | str = len(parse_jsonl(split_lines(content.decode("utf-8")), "sft"))
    except DatasetError as e:
        expected = verdict(e)
    try:
        got: int | str = count_rows(io.BytesIO(content), "sft")
    except InvalidFile as e:
        got = verdict(e)
    assert got == expected
