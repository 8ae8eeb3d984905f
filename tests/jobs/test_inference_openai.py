"""What ``jobs.inference`` adds for the OpenAI-compatible endpoints, on the built-in tiny model (no database):
``n`` samples per prompt, stop strings, token counts and chat formatting."""

import pytest
import torch

from engine.core import generate as engine_generate
from engine.core.models import load_causal_lm, load_tokenizer
from jobs import inference
from jobs.inference import ChatTemplateMissing, GenerateError

PROMPTS = ["The food was", "Service here is", ""]


@pytest.fixture(scope="module")
def tiny() -> inference.Loaded:
    tokenizer = load_tokenizer("builtin:tiny")
    model = load_causal_lm("builtin:tiny", tokenizer, seed=0).to(torch.device("cpu"))
    return inference.Loaded(model.eval(), tokenizer)


def test_one_sample_per_prompt_is_what_generate_gave(tiny: inference.Loaded) -> None:
    rows, usage = inference.complete(tiny.model, tiny.tokenizer, PROMPTS, 12, 1.0, 1.0, seed=4)
    before = engine_generate.generate(tiny.model, tiny.tokenizer, PROMPTS, 12, 1.0, seed=4)
    assert rows == [{"prompt": c.prompt, "text": c.text, "finish_reason": c.finish_reason} for c in before]
    assert usage["prompt_tokens"] == sum(len(tiny.tokenizer(p)["input_ids"]) or 1 for p in PROMPTS)
    assert 3 <= usage["completion_tokens"] <= 36


def test_n_samples_are_distinct_and_seeded(tiny: inference.Loaded) -> None:
    rows, usage = inference.complete(tiny.model, tiny.tokenizer, PROMPTS[:2], 12, 1.0, 1.0, seed=1, n=3)
    assert [r["prompt"] for r in rows] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert len({r["text"] for r in rows[:3]}) == 3
    again, _ = inference.complete(tiny.model, tiny.tokenizer, PROMPTS[:2], 12, 1.0, 1.0, seed=1, n=3)
    assert again == rows
    _, single_usage = inference.complete(tiny.model, tiny.tokenizer, PROMPTS[:2], 12, 1.0, 1.0, seed=1)
    assert single_usage["prompt_tokens"] == usage["prompt_tokens"]  # each prompt counted once


def test_stop_strings_cut_the_text_and_its_token_count(tiny: inference.Loaded) -> None:
    [full], full_usage = inference.complete(tiny.model, tiny.tokenizer, PROMPTS[:1], 16, 1.0, 1.0, seed=2)
    text = full["text"]
    stop = text[len(text) // 2 :][:2]
    assert stop.strip()
    [cut], cut_usage = inference.complete(tiny.model, tiny.tokenizer, PROMPTS[:1], 16, 1.0, 1.0, seed=2,
                                          stop=["never-there", stop])  # fmt: skip
    assert cut == {"prompt": PROMPTS[0], "text": text[: text.find(stop)], "finish_reason": "stop"}
    assert 1 <= cut_usage["completion_tokens"] < full_usage["completion_tokens"]
    # The count is the fewest tokens whose text holds the stop string.
    ids = tiny.tokenizer(text, add_special_tokens=False)["input_ids"]
    k = inference._tokens_to_stop(tiny.tokenizer, ids, [stop])
    assert stop in tiny.tokenizer.decode(ids[:k]) and stop not in tiny.tokenizer.decode(ids[: k - 1])


def test_chat_prompts_need_a_template(tiny: inference.Loaded) -> None:
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(ChatTemplateMissing, match=r"job:job_x@3 has no chat template.*/v1/completions"):
        inference.chat_prompt(tiny.tokenizer, messages, "job_x", 3)
    assert issubclass(ChatTemplateMissing, GenerateError)
    tokenizer = load_tokenizer("builtin:tiny")
    tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}" + (
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    assert inference.chat_prompt(tokenizer, messages, "job_x", 3) == "[system] Be kind. [user] Hi [assistant]"
    tokenizer.chat_template = "{{ raise_exception('no system messages') }}"
    with pytest.raises(GenerateError, match="no system messages"):
        inference.chat_prompt(tokenizer, messages, "job_x", 3)
