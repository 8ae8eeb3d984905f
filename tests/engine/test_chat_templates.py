"""Chat rows rendered by the chat templates of real models (tests/chat_templates.py): Qwen3's and Phi-3's
multi-turn conversations, whose shorter renderings are not the start of the longer ones."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.core.data import (
    DatasetError,
    encode_conversation,
    encode_rendered,
    load_rows,
    prompt_ids,
    prompt_length_limit,
    sequence_lengths,
    truncation_warning,
)
from engine.core.models import load_tokenizer
from engine.spec.config import JobSpec
from jobs.runner import error_code
from tests.chat_templates import TEMPLATES, chat_tokenizer
from tests.engine.helpers import make_spec, train
from tests.engine.test_grpo_train import grpo_spec
from tests.models import build_model, build_tokenizer, chat_rows, openai_rows, write_jsonl
from tests.recorder import Recorder

THINKING = [
    {"role": "system", "content": "You finish short movie reviews."},
    {"role": "user", "content": "Finish this review: the film was"},
    {"role": "assistant", "content": "<think>\nit was good\n</think>\n\ngreat fun ."},
    {"role": "user", "content": "Now a negative one: the plot was"},
    {"role": "assistant", "content": "dull ."},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PreTrainedTokenizerBase]:
    """Every template's tokenizer, and the tests' ChatML one (``chatml``)."""
    root = tmp_path_factory.mktemp("templates")
    found = {name: AutoTokenizer.from_pretrained(chat_tokenizer(name, root / name)) for name in TEMPLATES}
    return {**found, "chatml": AutoTokenizer.from_pretrained(build_tokenizer(root / "chatml"))}


def trained_texts(tokenizer: PreTrainedTokenizerBase, ids: list[int], trained: list[bool]) -> list[str]:
    """The decoded stretches of trained tokens, in order."""
    texts: list[str] = []
    for i, (token, flag) in enumerate(zip(ids, trained, strict=True)):
        if flag and i > 0 and trained[i - 1]:
            texts[-1] += tokenizer.decode([token])
        elif flag:
            texts.append(tokenizer.decode([token]))
    return texts


@pytest.mark.parametrize(
    ("name", "turns"),
    [
        # Qwen3 drops the reasoning of an earlier turn, and writes an empty <think> block in the last one
        ("qwen3", ["great fun .<|im_end|>\n", "<think>\n\n</think>\n\ndull .<|im_end|>\n"]),
        # Phi-3 ends the conversation with EOS, which the rendering of its first turn alone ends with too
        ("phi3", ["<think>\nit was good\n</think>\n\ngreat fun .<|end|>\n", "dull .<|end|>\n<|endoftext|>"]),
    ],
)
def test_multi_turn_conversations_train_each_turn_as_the_whole_rendering_writes_it(tokenizers, name, turns):
    tokenizer = tokenizers[name]
    ids, trained = encode_conversation(tokenizer, THINKING)
    whole = tokenizer.apply_chat_template(THINKING, tokenize=False)
    assert tokenizer.decode(ids) == whole
    assert trained_texts(tokenizer, ids, trained) == turns


def test_a_weight_0_turn_stays_untrained_in_the_whole_rendering(tokenizers):
    tokenizer = tokenizers["qwen3"]
    weighted = [*THINKING[:2], {**THINKING[2], "weight": 0}, *THINKING[3:]]
    ids, trained = encode_conversation(tokenizer, weighted)
    assert ids == encode_conversation(tokenizer, THINKING)[0]
    assert trained_texts(tokenizer, ids, trained) == ["<think>\n\n</think>\n\ndull .<|im_end|>\n"]


@pytest.mark.parametrize("name", ["chatml", "llama3.1", "smollm3", "granite"])
def test_the_whole_rendering_trains_what_turn_by_turn_trains_where_both_apply(tokenizers, name):
    tokenizer = tokenizers[name]
    assert encode_rendered(tokenizer, THINKING, [2, 4]) == encode_conversation(tokenizer, THINKING)
    assert encode_rendered(tokenizer, THINKING, [4]) == encode_conversation(tokenizer, THINKING, first_trained=3)


def test_sft_trains_qwen3_multi_turn_rows(tmp_path: Path):
    model = build_model("qwen2", tmp_path / "qwen3", tokenizer=chat_tokenizer("qwen3", tmp_path / "tokenizer"))
    rows = [row for row in chat_rows("sft_messages", 64) if len(row["messages"]) >= 4][:8]
    dataset = write_jsonl(rows, tmp_path / "multi_turn.jsonl")
    spec = make_spec("sft", model=model, dataset=str(dataset), hyperparameters={"max_steps": 2, "batch_size": 4})
    result, recorder = train(spec, tmp_path / "job")
    assert (result.status, result.step) == ("succeeded", 2)
    assert sorted(recorder.metrics) == [1, 2]
    assert all(m["loss/sft"] > 0 for m in recorder.metrics.values())


def test_a_template_that_refuses_a_row_fails_the_job_as_dataset_invalid_naming_the_row(tmp_path: Path):
    model = build_model("llama", tmp_path / "gemma2", tokenizer=chat_tokenizer("gemma2", tmp_path / "tokenizer"))
    rows = chat_rows("sft_messages", 16)
    first_system = next(n for n, row in enumerate(rows, start=1) if row["messages"][0]["role"] == "system")
    dataset = write_jsonl(rows, tmp_path / "with_system.jsonl")
    spec = make_spec("sft", model=model, dataset=str(dataset), hyperparameters={"max_steps": 1, "batch_size": 4})
    with pytest.raises(DatasetError) as refused:
        train(spec, tmp_path / "job")
    assert str(refused.value).startswith(f"dataset row {first_system}: ")
    assert "System role not supported" in str(refused.value)
    assert error_code(refused.value) == "dataset_invalid"


def test_a_template_error_while_encoding_is_a_dataset_error(tokenizers):
    with pytest.raises(DatasetError, match="refused messages of roles \\(system, user\\): System role not supported"):
        prompt_ids(tokenizers["gemma2"], THINKING[:2])


def test_prompt_length_limit():
    assert prompt_length_limit([10, 90], 64, 200) == 64  # given: kept as given
    assert prompt_length_limit([10, 90], None, 200) == 90  # null: the longest prompt
    assert prompt_length_limit([10, 90], None, 40) == 40  # ... capped by the context's room
    assert prompt_length_limit([10, 90], None, None) == 90
    message, data = truncation_warning([10, 90, 70, 30], 64, "prompts", "max_prompt_length")
    assert data == {"param": "max_prompt_length", "truncated": 2, "of": 4, "longest": 90, "limit": 64}
    assert message.startswith("2 of 4 prompts are longer than max_prompt_length (64 tokens; the longest has 90)")


@pytest.mark.parametrize("max_prompt_length", [None, 16])  # None: the default
def test_grpo_keeps_llama_31s_system_block_unless_told_to_cut_it_and_says_when_it_cuts(
    tmp_path_factory: pytest.TempPathFactory, max_prompt_length
):
    root = tmp_path_factory.mktemp("llama31")
    model = build_model("llama", root / "model", tokenizer=chat_tokenizer("llama3.1", root / "tokenizer"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = openai_rows("reinforcement", 8)
    longest = max(len(prompt_ids(tokenizer, row["messages"])) for row in rows)
    assert longest > 64  # the default system block alone is longer than the former default limit
    spec = grpo_spec(
        model,
        dataset=str(write_jsonl(rows, root / "prompts.jsonl")),
        reward={"type": "python", "function": "tests.engine.test_grpo_train:mentions_positive"},
        hyperparameters={"total_steps": 1, "batch_size": 4, "group_size": 2, "mini_batch_size": 8,
                         "log_samples_every": 1, **({"max_prompt_length": 16} if max_prompt_length else {})},
    )  # fmt: skip
    _, recorder = train(spec, root / "job")
    cut = [data for kind, _, data in recorder.events if kind == "warning" and data and "truncated" in data]
    prompts = [sample["prompt"] for sample in recorder.samples[1]]
    if max_prompt_length is None:
        assert not cut
        assert all(p.startswith("<|begin_of_text|><|start_header_id|>system") for p in prompts)
    else:
        assert cut == [{"param": "max_prompt_length", "truncated": 8, "of": 8, "longest": longest, "limit": 16}]
        assert all(len(tokenizer(p, add_special_tokens=False)["input_ids"]) == 16 for p in prompts)


def cuts(recorder: Recorder) -> list[dict[str, object]]:
    """The truncation warnings' data."""
    return [data for kind, _, data in recorder.events if kind == "warning" and data and "truncated" in data]


@pytest.mark.parametrize(
    ("job_type", "dataset", "kind"),
    [("sft", "builtin:reviews-sft", "sft"), ("dpo", "builtin:reviews-prefs", "preference")],
)
def test_sft_and_dpo_say_how_many_examples_max_length_cuts(tmp_path, job_type, dataset, kind):
    def spec(**hyperparameters: int) -> JobSpec:
        hyperparameters = {"max_steps": 1, "batch_size": 4, **hyperparameters}
        return JobSpec.model_validate(
            {"type": job_type, "model": "builtin:tiny", "dataset": dataset, "hyperparameters": hyperparameters}
        )

    _, recorder = train(spec(max_length=12), tmp_path / "job")
    lengths = sequence_lengths(load_tokenizer("builtin:tiny"), load_rows(dataset, kind), kind)
    truncated = sum(n > 12 for n in lengths)
    assert truncated > 0
    assert cuts(recorder) == [
        {"param": "max_length", "truncated": truncated, "of": len(lengths), "longest": max(lengths), "limit": 12}
    ]
    # at the default (128) these short rows are whole: nothing to say
    _, quiet = train(spec(), tmp_path / "default")
    assert cuts(quiet) == []
