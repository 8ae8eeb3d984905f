"""Rows in the other formats TRL and common datasets use: TRL's ``text`` rows, ShareGPT conversations and
implicit-prompt preferences of plain strings, read at upload and by the engine alike."""

import io
import json

import pytest
from transformers import AutoTokenizer

from api.datasets import summarize
from engine.core.data import encode_sft_example, special_prefix, text_ids
from engine.spec.rows import DatasetError, parse_line
from tests.models import build_tokenizer

USER = {"role": "user", "content": "Finish this review: the film was"}
ANSWER = {"role": "assistant", "content": "great fun ."}


@pytest.mark.parametrize(
    ("row", "kind", "expected"),
    [
        ({"text": "the film was great fun ."}, "sft", {"text": "the film was great fun ."}),
        (
            {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": USER["content"]},
                               {"from": "gpt", "value": ANSWER["content"]}], "id": 7},
            "sft",
            {"messages": [{"role": "system", "content": "Be brief."}, USER, ANSWER], "id": 7},
        ),
        ({"conversations": [{"from": "human", "value": USER["content"]}]}, "prompts", {"prompt": [USER]}),
        (
            {"conversations": [{"from": "human", "value": USER["content"]}],
             "chosen": {"from": "gpt", "value": "great"}, "rejected": {"from": "gpt", "value": "dull"}},
            "preference",
            {"prompt": [USER], "chosen": [{"role": "assistant", "content": "great"}],
             "rejected": [{"role": "assistant", "content": "dull"}]},
        ),
        (
            {"chosen": "the film was great fun .", "rejected": "the film was grim ."},
            "preference",
            {"prompt": "the film was", "chosen": " great fun .", "rejected": " grim ."},
        ),
    ],
)  # fmt: skip
def test_other_formats_are_read_as_our_rows(row, kind, expected):
    assert parse_line(json.dumps(row), kind, 1) == expected
    upload = io.BytesIO((json.dumps(row) + "\n").encode())
    assert summarize(upload, kind).rows == 1


@pytest.mark.parametrize(
    ("row", "kind", "expected"),
    [
        ({"text": ""}, "sft", "field 'text' must be a non-empty string"),
        ({"conversations": [{"from": "bot", "value": "hi"}]}, "sft", "a ShareGPT row's turns are"),
        ({"conversations": [{"from": "human", "value": "hi"}]}, "sft", "no assistant message to train on"),
        ({"chosen": "great", "rejected": "grim"}, "preference", "give the prompt as 'prompt'"),
    ],
)
def test_bad_rows_of_other_formats_are_named(row, kind, expected):
    with pytest.raises(DatasetError, match=expected):
        parse_line(json.dumps(row), kind, 3)


def test_a_text_row_trains_on_the_whole_text_and_eos(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tokenizer", add_bos=True))
    ids, trained = encode_sft_example(tokenizer, {"text": "the film was great fun ."})
    prefix = special_prefix(tokenizer)
    assert prefix and ids == [*prefix, *text_ids(tokenizer, "the film was great fun ."), tokenizer.eos_token_id]
    assert trained == [False] * len(prefix) + [True] * (len(ids) - len(prefix))
