"""The API's torch-free JSONL check agrees with the engine's reader, line numbers included; a fine-tune file's
kind is found from its rows."""

import io
import json
from typing import Any

import pytest

from api.datasets import InvalidFile, Summary, summarize
from engine.core.data import DatasetError, parse_jsonl
from engine.spec.rows import split_lines

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
        got: int | str = summarize(io.BytesIO(content), "sft").rows
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
        got: int | str = summarize(io.BytesIO(content), "sft").rows
    except InvalidFile as e:
        got = verdict(e)
    assert got == expected


# --- summarize: purposes and OpenAI's fine-tuning formats ------------------------------------------

USER = {"role": "user", "content": "Finish this review: the film was"}
GOOD = {"role": "assistant", "content": "great fun ."}
BAD = {"role": "assistant", "content": "dull ."}
SUPERVISED = {"messages": [USER, {**BAD, "weight": 0}, USER, {**GOOD, "weight": 1}]}
DPO = {"input": {"messages": [USER]}, "preferred_output": [GOOD], "non_preferred_output": [BAD]}
REINFORCEMENT = {"messages": [USER], "reference_answer": "great"}


def jsonl(*rows: Any) -> io.BytesIO:
    """Rows as a JSONL upload (a string row is written as is: a blank or a bad line)."""
    return io.BytesIO(b"".join((row if isinstance(row, str) else json.dumps(row)).encode() + b"\n" for row in rows))


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([SUPERVISED, "", {"messages": [USER, GOOD]}], Summary(2, True, "sft")),
        ([DPO, {**DPO, "id": 1}, DPO], Summary(3, True, "preference")),
        ([REINFORCEMENT, {"messages": [USER, GOOD, USER]}], Summary(2, True, "prompts")),
    ],
)
def test_a_fine_tune_files_kind_is_found_from_its_rows(rows: list[Any], expected: Summary) -> None:
    assert summarize(jsonl(*rows), "fine-tune") == expected


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (
            [SUPERVISED, "", DPO],
            "line 3: a dpo row in a file of supervised rows (its first row's kind); a fine-tune file holds rows of "
            "one method",
        ),
        ([DPO, DPO, SUPERVISED], "line 3: a supervised row in a file of dpo rows"),
        ([SUPERVISED, REINFORCEMENT], "line 2: a reinforcement row in a file of supervised rows"),
        (["", REINFORCEMENT, "  ", DPO], "line 4: a dpo row in a file of reinforcement rows"),
    ],
)
def test_a_fine_tune_file_holds_rows_of_one_method(rows: list[Any], expected: str) -> None:
    with pytest.raises(InvalidFile) as info:
        summarize(jsonl(*rows), "fine-tune")
    assert str(info.value).startswith(expected), info.value


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([{"prompt": "a", "completion": "b"}], "line 1: not a row of OpenAI's fine-tuning formats"),
        ([SUPERVISED, {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}], "line 2: not a row of OpenAI's"),
        ([{"messages": [USER, {**GOOD, "weight": 2}]}], "line 1: field 'messages' item 1: 'weight'"),
        ([{"messages": [USER, {**GOOD, "weight": 0}]}], "line 1: field 'messages' has no assistant message"),
        ([{"messages": [USER, {**GOOD, "weight": 1}, USER]}], "line 1: field 'messages' item 1: 'weight'"),
        ([{**DPO, "preferred_output": [USER]}], "line 1: field 'preferred_output' must end with an assistant"),
        ([SUPERVISED, "not json"], "line 2: invalid JSON"),
        (["", "  "], "the file has no rows"),
        ([], "the file has no rows"),
    ],
)
def test_bad_fine_tune_files_are_named(rows: list[Any], expected: str) -> None:
    with pytest.raises(InvalidFile) as info:
        summarize(jsonl(*rows), "fine-tune")
    assert str(info.value).startswith(expected), info.value


@pytest.mark.parametrize(
    ("purpose", "rows", "expected"),
    [
        ("sft", [{"prompt": "a", "completion": "b"}], Summary(1, False, "sft")),
        ("sft", [{"prompt": "a", "completion": "b"}, SUPERVISED], Summary(2, True, "sft")),
        ("rm", [{"prompt": "a", "chosen": "b", "rejected": "c"}], Summary(1, False, "preference")),
        ("preference", [{"prompt": "a", "chosen": "b", "rejected": "c"}, DPO], Summary(2, True, "preference")),
        ("rm", [DPO], Summary(1, True, "preference")),
        ("ppo", [{"prompt": "a"}], Summary(1, False, "prompts")),
        ("prompts", [{"prompt": "a"}, REINFORCEMENT], Summary(2, True, "prompts")),
        ("ppo", [REINFORCEMENT], Summary(1, True, "prompts")),
    ],
)
def test_a_native_purpose_reports_its_kind(purpose: str, rows: list[Any], expected: Summary) -> None:
    assert summarize(jsonl(*rows), purpose) == expected


def test_a_native_purpose_takes_only_its_own_kind_of_rows() -> None:
    with pytest.raises(InvalidFile, match=r"^line 2: field 'prompt'"):
        summarize(jsonl({"prompt": "a", "chosen": "b", "rejected": "c"}, REINFORCEMENT), "rm")
    with pytest.raises(InvalidFile, match=r"^line 1: field 'messages' item 1: 'weight'"):
        summarize(jsonl({"messages": [USER, {**GOOD, "weight": 1}, USER]}), "prompts")
