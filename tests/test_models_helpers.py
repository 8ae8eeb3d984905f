"""The helpers of tests/models.py: each architecture builds and loads in plain transformers, the tokenizer
behaves as a user's would, and the conversational datasets have TRL's formats."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.builtin import reviews
from tests.models import ARCHITECTURES, BOS_TOKEN, IM_END, build_model, build_tokenizer, chat_rows, write_jsonl

TEXT = "last night i saw the film and it was great . Ünïcode, CAPS & 42\n\tdone"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_builds_loads_and_generates(arch: str, tmp_path: Path) -> None:
    folder = build_model(arch, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tokenizer)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    assert not model.config.tie_word_embeddings  # every one of the four is untied by default
    messages = [{"role": "user", "content": "Finish this review: we watched the film and it was"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(prompt, str)
    inputs = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)  # (1, T + 3)
    assert output.shape == (1, inputs["input_ids"].shape[1] + 3)


def test_model_options_seed_tying_and_a_tokenizer_without_pad(tmp_path: Path) -> None:
    tied = AutoModelForCausalLM.from_pretrained(build_model("qwen2", tmp_path / "tied", tie_word_embeddings=True))
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    unpadded = build_model("llama", tmp_path / "unpadded", pad=False, add_bos=True)
    assert AutoModelForCausalLM.from_pretrained(unpadded).config.pad_token_id is None
    assert AutoTokenizer.from_pretrained(unpadded).pad_token is None
    shared = build_tokenizer(tmp_path / "tokenizer")
    weights = [
        load_file(build_model("mistral", tmp_path / name, tokenizer=shared, seed=seed) / "model.safetensors")
        for name, seed in (("a", 1), ("b", 1), ("c", 2))
    ]
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    assert not torch.equal(weights[0]["model.embed_tokens.weight"], weights[2]["model.embed_tokens.weight"])
    assert AutoTokenizer.from_pretrained(tmp_path / "a").chat_template is not None  # the given tokenizer, copied


def test_tokenizer_round_trips_and_applies_the_chat_template(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path))
    assert tokenizer.decode(tokenizer(TEXT)["input_ids"]) == TEXT
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (BOS_TOKEN, IM_END, "<|pad|>")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(rendered)["input_ids"]
    assert tokenizer.decode(ids) == rendered
    vocab = tokenizer.get_vocab()
    assert (ids.count(vocab["<|im_start|>"]), ids.count(vocab[IM_END])) == (3, 2)  # the markers are single tokens


def test_tokenizer_options(tmp_path: Path) -> None:
    plain = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "plain"))
    with_bos = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "bos", add_bos=True))
    assert plain(TEXT)["input_ids"][0] != plain.bos_token_id
    assert with_bos(TEXT)["input_ids"] == [with_bos.bos_token_id, *plain(TEXT)["input_ids"]]
    assert with_bos(TEXT, add_special_tokens=False)["input_ids"] == plain(TEXT)["input_ids"]
    no_pad = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "no_pad", pad=False))
    assert no_pad.pad_token is None and "<|pad|>" not in no_pad.get_vocab()
    assert len(no_pad) == len(plain) - 1
    assert (
        AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "no_template", chat_template=False)).chat_template
        is None
    )


def _roles(messages: list[dict[str, str]]) -> list[str]:
    return [m["role"] for m in messages]


def test_chat_rows_have_trls_conversational_formats(tmp_path: Path) -> None:
    messages = chat_rows("sft_messages", 40)
    assert all(set(row) == {"messages"} for row in messages)
    shapes = {tuple(_roles(row["messages"])) for row in messages}
    assert ("user", "assistant") in shapes and ("system", "user", "assistant", "user", "assistant") in shapes
    assert all(shape[-2:] == ("user", "assistant") for shape in shapes)
    for row in chat_rows("sft_prompt_completion", 8):
        assert (_roles(row["prompt"]), _roles(row["completion"])) == (["user"], ["assistant"])
    for row in chat_rows("preference", 8):
        assert (_roles(row["prompt"]), _roles(row["chosen"]), _roles(row["rejected"])) == (
            ["user"],
            *[["assistant"]] * 2,
        )
        assert (
            reviews.sentiment_balance(row["chosen"][0]["content"])
            > 0
            > reviews.sentiment_balance(row["rejected"][0]["content"])
        )
    for row in chat_rows("preference_implicit", 8):
        assert _roles(row["chosen"]) == _roles(row["rejected"]) == ["user", "assistant"]
        assert row["chosen"][0] == row["rejected"][0]
    assert all(_roles(row["prompt"]) == ["user"] for row in chat_rows("prompts", 8))
    assert chat_rows("preference", 8, seed=1) == chat_rows("preference", 8, seed=1) != chat_rows("preference", 8)
    path = write_jsonl(chat_rows("prompts", 3), tmp_path / "prompts.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == chat_rows("prompts", 3)
