"""Datasets (JSONL validation, SFT encoding), seeded generation and model references."""

import json
import shutil

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoTokenizer
from transformers.activations import GELUTanh, NewGELUActivation

from engine import builtin
from engine.core.checkpoint import JOB_FILE
from engine.core.data import (
    DatasetError,
    encode_conversation,
    encode_prompts,
    encode_sft_batch,
    load_rows,
    parse_jsonl,
)
from engine.core.generate import generate, sample, sample_next
from engine.core.models import (
    ModelNotFoundError,
    fuse_activations,
    lm_logits,
    load_causal_lm,
    load_tokenizer,
    resolve_model_ref,
    token_logprobs,
)
from engine.core.ops import truncate_after_stop
from engine.spec.rows import fine_tune_kind, validate_row
from tests.engine.helpers import make_spec, train
from tests.models import IM_END, build_model, build_tokenizer
from tests.recorder import Recorder

# --- JSONL datasets -------------------------------------------------------------------------------

GOOD_SFT = [
    json.dumps({"prompt": "we watched the film and it was", "completion": " great ."}),
    "",  # blank lines are skipped but still counted
    json.dumps({"prompt": "i streamed this drama and it was", "completion": " dull .", "extra": 1}),
]


USER = {"role": "user", "content": "Finish this review: the film was"}
GOOD = {"role": "assistant", "content": "great fun ."}
BAD = {"role": "assistant", "content": "dull ."}


@pytest.mark.parametrize(
    ("row", "kind"),
    [
        ({"messages": [{"role": "system", "content": "Be brief."}, USER, GOOD, USER, BAD]}, "sft"),
        ({"prompt": [USER], "completion": [GOOD]}, "sft"),
        ({"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}, "rm"),
        ({"chosen": [USER, GOOD], "rejected": [USER, BAD]}, "rm"),
        ({"prompt": [USER]}, "ppo"),
        ({"prompt": [USER], "answer": "42", "tags": ["a"]}, "ppo"),
    ],
)
def test_conversational_rows_of_every_kind_load_with_their_extra_columns(row, kind):
    assert parse_jsonl([json.dumps(row)], kind) == [row]


@pytest.mark.parametrize(
    ("row", "kind", "expected"),
    [
        ({"messages": [USER]}, "sft", "no assistant message"),
        ({"messages": []}, "sft", "'messages'"),
        ({"messages": [{"role": "user"}]}, "sft", "field 'messages' item 0"),
        ({"messages": [{"role": "user", "content": 3}]}, "sft", "field 'messages' item 0"),
        ({"messages": [{"role": "user", "content": "a", "name": "x"}]}, "sft", "field 'messages' item 0"),
        ({"prompt": [USER], "completion": "great"}, "sft", "'completion'"),
        ({"prompt": [USER], "completion": [USER]}, "sft", "must end with an assistant message"),
        ({"prompt": [USER], "chosen": [GOOD], "rejected": "dull"}, "rm", "'rejected'"),
        ({"chosen": [USER, GOOD], "rejected": [USER]}, "rm", "'rejected' must end with an assistant message"),
        ({"prompt": []}, "ppo", "'prompt'"),
    ],
)
def test_bad_conversational_rows_are_named(row, kind, expected):
    with pytest.raises(DatasetError) as info:
        parse_jsonl([json.dumps(row)], kind)
    assert str(info.value).startswith("line 1:") and expected in str(info.value), info.value


@pytest.mark.parametrize(
    ("bad_line", "kind", "expected"),
    [
        ('{"prompt": "a", "completion": ', "sft", "invalid JSON"),
        (json.dumps({"prompt": "a"}), "sft", "'completion'"),
        (json.dumps({"prompt": "a", "completion": 3}), "sft", "'completion'"),
        (json.dumps({"prompt": "a", "completion": ""}), "sft", "'completion'"),
        (json.dumps({"prompt": ["a"], "completion": "b"}), "sft", "'prompt'"),
        (json.dumps(["a", "b"]), "sft", "JSON object"),
        (json.dumps({"prompt": "a", "completion": "b"}), "rm", "'chosen'"),  # an sft row where rm rows belong
        (json.dumps({"prompt": "a", "chosen": "b", "rejected": None}), "rm", "'rejected'"),
        (json.dumps({"text": "a"}), "ppo", "'prompt'"),
    ],
)
def test_bad_line_is_named(bad_line, kind, expected):
    good = {
        "sft": GOOD_SFT,
        "rm": [json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"})] * 3,
        "ppo": [json.dumps({"prompt": "p"})] * 3,
    }[kind]
    lines = [*good, bad_line, good[0]]  # the bad row is line 4
    with pytest.raises(DatasetError) as info:
        parse_jsonl(lines, kind)
    message = str(info.value)
    assert message.startswith("line 4:"), message
    assert expected in message, message


def test_bad_line_in_a_file_fails_the_whole_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([*GOOD_SFT, "not json"]) + "\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"^line 4: invalid JSON"):
        load_rows(str(path), "sft")


def test_good_file_loads(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(GOOD_SFT) + "\n\n", encoding="utf-8")
    rows = load_rows(str(path), "sft")
    assert rows == [
        {"prompt": "we watched the film and it was", "completion": " great ."},
        {"prompt": "i streamed this drama and it was", "completion": " dull .", "extra": 1},  # extra columns kept
    ]


def test_load_rows_errors(tmp_path):
    with pytest.raises(DatasetError, match="no rows"):
        parse_jsonl(["", "  "], "sft")
    with pytest.raises(DatasetError, match="not found"):
        load_rows(str(tmp_path / "missing.jsonl"), "sft")
    with pytest.raises(DatasetError, match="unknown built-in"):
        load_rows("builtin:no-such-data", "sft")
    with pytest.raises(DatasetError, match="holds preference rows"):
        load_rows("builtin:reviews-prefs", "sft")


def test_builtin_datasets_are_deterministic_and_well_formed():
    # the digits prompts: every (triple, position) of 800 training triples and of 200 held-out ones
    sizes = {"digits-prompts": 2400, "digits-prompts-eval": 600}
    for name, (kind, _) in builtin.DATASETS.items():
        rows = load_rows(f"builtin:{name}", kind)
        assert rows == load_rows(f"builtin:{name}", kind)
        assert len(rows) == sizes.get(name, 400 if name.endswith("-eval") else 4000), name
        for row in rows[:50]:
            assert all(isinstance(v, str) and v for v in row.values())


def test_the_digits_tasks_held_out_triples_are_never_trained_on():
    def triples(name: str, field: str) -> set[str]:
        kind = builtin.DATASETS[name][0]
        return {row[field].split(" :")[0] for row in load_rows(f"builtin:{name}", kind)}

    train = triples("digits-prompts", "prompt") | triples("digits-sft", "prompt")
    held_out = triples("digits-prompts-eval", "prompt") | triples("digits-sft-eval", "prompt")
    assert len(held_out) == 200 and not train & held_out
    for row in load_rows("builtin:digits-prompts", "prompts")[:50]:
        digits_, position = row["prompt"].removesuffix(" =").split(" : ")
        assert row["answer"] == digits_.split()[{"first": 0, "middle": 1, "last": 2}[position]]


# --- OpenAI's fine-tuning formats ------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "Be brief."}
DPO_ROW = {"input": {"messages": [SYSTEM, USER]}, "preferred_output": [GOOD], "non_preferred_output": [BAD]}


@pytest.mark.parametrize(
    ("row", "kind", "expected"),
    [
        # supervised: the row itself, weights and extra columns kept
        (
            {"messages": [SYSTEM, USER, {**BAD, "weight": 0}, USER, {**GOOD, "weight": 1}], "id": 7},
            "sft",
            {"messages": [SYSTEM, USER, {**BAD, "weight": 0}, USER, {**GOOD, "weight": 1}], "id": 7},
        ),
        (
            {"messages": [USER, GOOD, USER, {**BAD, "weight": 0}]},
            "sft",
            {"messages": [USER, GOOD, USER, {**BAD, "weight": 0}]},
        ),
        # DPO: input.messages → prompt, preferred_output → chosen, non_preferred_output → rejected
        (
            {**DPO_ROW, "id": "a", "tags": ["x"]},
            "preference",
            {"prompt": [SYSTEM, USER], "chosen": [GOOD], "rejected": [BAD], "id": "a", "tags": ["x"]},
        ),
        (DPO_ROW, "rm", {"prompt": [SYSTEM, USER], "chosen": [GOOD], "rejected": [BAD]}),
        (
            {**DPO_ROW, "preferred_output": [USER, GOOD]},  # a multi-message output
            "preference",
            {"prompt": [SYSTEM, USER], "chosen": [USER, GOOD], "rejected": [BAD]},
        ),
        # reinforcement: messages → prompt, the reference columns kept for the graders
        (
            {"messages": [SYSTEM, USER], "reference_answer": "42", "tags": ["a"]},
            "prompts",
            {"prompt": [SYSTEM, USER], "reference_answer": "42", "tags": ["a"]},
        ),
        ({"messages": [USER, GOOD, USER]}, "ppo", {"prompt": [USER, GOOD, USER]}),
    ],
)
def test_openai_rows_are_read_as_the_native_row_of_their_kind(row, kind, expected):
    assert validate_row(json.loads(json.dumps(row)), kind, 1) == expected
    assert parse_jsonl([json.dumps(row)], kind) == [expected]


def test_openai_and_native_rows_of_one_kind_share_a_file():
    native = {"prompt": [SYSTEM, USER], "chosen": [GOOD], "rejected": [BAD]}
    assert parse_jsonl([json.dumps(native), json.dumps(DPO_ROW)], "preference") == [native, native]
    assert parse_jsonl([json.dumps({"prompt": [USER]}), json.dumps({"messages": [USER]})], "prompts") == [
        {"prompt": [USER]},
        {"prompt": [USER]},
    ]


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"messages": [USER, GOOD]}, "sft"),
        ({"messages": [SYSTEM, USER, GOOD, USER, {**BAD, "weight": 0}]}, "sft"),  # the kind, not the validity
        (DPO_ROW, "preference"),
        ({"preferred_output": [GOOD]}, "preference"),  # any DPO field
        ({"input": {"messages": [USER]}, "messages": [USER, GOOD]}, "preference"),
        ({"messages": [SYSTEM, USER], "reference_answer": "42"}, "prompts"),
        ({"messages": [USER, GOOD, USER]}, "prompts"),
        ({"messages": ["not a message"]}, "prompts"),  # validate_row names what is wrong with it
    ],
)
def test_fine_tune_kind_of_each_openai_format(row, expected):
    assert fine_tune_kind(row, 1) == expected


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": "a", "completion": "b"},
        {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},
        {"messages": []},
        {"messages": "hi"},
        {},
        [{"messages": [USER, GOOD]}],
        "text",
        None,
    ],
)
def test_fine_tune_kind_refuses_rows_of_no_openai_format(row):
    with pytest.raises(DatasetError) as info:
        fine_tune_kind(row, 3)
    assert str(info.value).startswith("line 3: not a row of OpenAI's fine-tuning formats"), info.value


WEIGHT = "'weight' (0 or 1) is for the assistant messages of supervised rows"


@pytest.mark.parametrize(
    ("row", "kind", "expected"),
    [
        ({"messages": [{**USER, "weight": 1}, GOOD]}, "sft", f"field 'messages' item 0: {WEIGHT}"),
        ({"messages": [{**SYSTEM, "weight": 0}, USER, GOOD]}, "sft", f"field 'messages' item 0: {WEIGHT}"),
        ({"messages": [USER, {**GOOD, "weight": 2}]}, "sft", f"field 'messages' item 1: {WEIGHT}"),
        ({"messages": [USER, {**GOOD, "weight": -1}]}, "sft", f"field 'messages' item 1: {WEIGHT}"),
        ({"messages": [USER, {**GOOD, "weight": True}]}, "sft", f"field 'messages' item 1: {WEIGHT}"),
        ({"messages": [USER, {**GOOD, "weight": False}]}, "sft", f"field 'messages' item 1: {WEIGHT}"),
        ({"messages": [USER, {**GOOD, "weight": 1.0}]}, "sft", f"field 'messages' item 1: {WEIGHT}"),
        ({"messages": [USER, {**GOOD, "weight": "1"}]}, "sft", f"field 'messages' item 1: {WEIGHT}"),
        ({"messages": [USER, {**GOOD, "weight": None}]}, "sft", f"field 'messages' item 1: {WEIGHT}"),
        ({"messages": [USER, {**GOOD, "weight": 0}]}, "sft", "field 'messages' has no assistant message to train on"),
        (
            {"messages": [USER, {**GOOD, "weight": 0}, USER, {**BAD, "weight": 0}]},
            "sft",
            "field 'messages' has no assistant message to train on",
        ),
        ({"messages": [USER, {**GOOD, "weight": 1}, USER]}, "prompts", f"field 'messages' item 1: {WEIGHT}"),
        ({"messages": [USER, {**GOOD, "weight": 0}, USER]}, "ppo", f"field 'messages' item 1: {WEIGHT}"),
        (
            {**DPO_ROW, "preferred_output": [{**GOOD, "weight": 1}]},
            "preference",
            f"field 'preferred_output' item 0: {WEIGHT}",
        ),
        (
            {**DPO_ROW, "non_preferred_output": [{**BAD, "weight": 0}]},
            "preference",
            f"field 'non_preferred_output' item 0: {WEIGHT}",
        ),
        (
            {**DPO_ROW, "input": {"messages": [USER, {**GOOD, "weight": 1}, USER]}},
            "preference",
            f"field 'input.messages' item 1: {WEIGHT}",
        ),
        (
            {"prompt": [USER], "chosen": [{**GOOD, "weight": 1}], "rejected": [BAD]},
            "rm",
            f"field 'chosen' item 0: {WEIGHT}",
        ),
        ({"prompt": [USER], "completion": [{**GOOD, "weight": 0}]}, "sft", f"field 'completion' item 0: {WEIGHT}"),
    ],
)
def test_bad_weights_are_named(row, kind, expected):
    with pytest.raises(DatasetError) as info:
        parse_jsonl([json.dumps(row)], kind)
    assert str(info.value) == f"line 1: {expected}"


@pytest.mark.parametrize(
    ("row", "kind", "expected"),
    [
        ({**DPO_ROW, "input": [USER]}, "preference", "line 1: field 'input' must be {\"messages\": [...]}"),
        ({**DPO_ROW, "input": {"prompt": [USER]}}, "preference", "line 1: field 'input' must be"),
        ({**DPO_ROW, "input": {"messages": []}}, "preference", "line 1: field 'input.messages' must be a non-empty"),
        ({**DPO_ROW, "input": {"messages": [USER], "tools": []}}, "preference", "(tools are not supported)"),
        ({"preferred_output": [GOOD], "non_preferred_output": [BAD]}, "preference", "line 1: field 'input'"),
        ({**DPO_ROW, "preferred_output": [USER]}, "preference", "'preferred_output' must end with an assistant"),
        ({**DPO_ROW, "non_preferred_output": [USER]}, "rm", "'non_preferred_output' must end with an assistant"),
        ({**DPO_ROW, "non_preferred_output": None}, "preference", "line 1: field 'non_preferred_output' must be"),
        ({**DPO_ROW, "preferred_output": "great"}, "preference", "line 1: field 'preferred_output' must be"),
        ({"messages": []}, "prompts", "line 1: field 'messages' must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, "prompts", "line 1: field 'messages' item 0"),
        ({"messages": [USER]}, "preference", "line 1: field 'prompt'"),  # a reinforcement row where DPO rows belong
    ],
)
def test_bad_openai_rows_are_named(row, kind, expected):
    with pytest.raises(DatasetError) as info:
        parse_jsonl([json.dumps(row)], kind)
    assert str(info.value).startswith("line 1:") and expected in str(info.value), info.value


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """The tests' small BPE tokenizer with its ChatML template (``<|im_end|>``, its EOS, ends every turn)."""
    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("chat") / "tokenizer"))


def runs(trained: list[bool]) -> list[range]:
    """The maximal stretches of trained tokens, in order."""
    found: list[range] = []
    for i, flag in enumerate(trained):
        if flag and found and found[-1].stop == i:
            found[-1] = range(found[-1].start, i + 1)
        elif flag:
            found.append(range(i, i + 1))
    return found


CONVERSATION = [
    SYSTEM,
    USER,
    {"role": "assistant", "content": "great fun ."},
    {"role": "user", "content": "Now a negative one: the plot was"},
    {"role": "assistant", "content": "dull ."},
    {"role": "user", "content": "Finish this review: the ending was"},
    {"role": "assistant", "content": "a mess ."},
]
ASSISTANT_TURNS = [2, 4, 6]


@pytest.mark.parametrize("unweighted", [[2], [4], [6], [2, 6], [4, 6]])
def test_a_weight_0_assistant_turn_stays_in_context_untrained(chat_tokenizer, unweighted):
    plain_ids, plain_trained = encode_conversation(chat_tokenizer, CONVERSATION)
    turns = runs(plain_trained)
    assert len(turns) == len(ASSISTANT_TURNS)  # one trained stretch per assistant turn, separated by the others
    weighted = [
        {**m, "weight": 0 if i in unweighted else 1} if m["role"] == "assistant" else m
        for i, m in enumerate(CONVERSATION)
    ]
    ids, trained = encode_conversation(chat_tokenizer, weighted)
    # the same tokens (the weight-0 turn is still in the context), and the same mask but that turn's stretch
    assert ids == plain_ids
    expected = list(plain_trained)
    for turn, stretch in zip(ASSISTANT_TURNS, turns, strict=True):
        if turn in unweighted:
            expected[stretch.start : stretch.stop] = [False] * len(stretch)
    assert trained == expected
    # and, rendered naively: the trained tokens are exactly each weighted turn's content and its end of turn
    assert [chat_tokenizer.decode([ids[i] for i in stretch]) for stretch in runs(trained)] == [
        CONVERSATION[i]["content"] + IM_END + "\n" for i in ASSISTANT_TURNS if i not in unweighted
    ]
    assert chat_tokenizer.decode(ids) == chat_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)


def test_weight_1_is_the_default(chat_tokenizer):
    weighted = [{**m, "weight": 1} if m["role"] == "assistant" else m for m in CONVERSATION]
    assert encode_conversation(chat_tokenizer, weighted) == encode_conversation(chat_tokenizer, CONVERSATION)


def test_sft_labels_skip_a_weight_0_turn(chat_tokenizer):
    row = validate_row({"messages": [USER, {**BAD, "weight": 0}, USER, GOOD]}, "sft", 1)
    batch = encode_sft_batch(chat_tokenizer, [row], max_length=128)
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    trained = [i for i, label in enumerate(labels) if label != -100]
    assert [labels[i] for i in trained] == [ids[i] for i in trained]
    assert chat_tokenizer.decode([ids[i] for i in trained]) == GOOD["content"] + IM_END + "\n"


# --- SFT encoding ---------------------------------------------------------------------------------


def test_sft_labels_mask_prompt_and_padding():
    tokenizer = load_tokenizer("builtin:tiny")
    rows = [
        {"prompt": "we watched the film and it was", "completion": " great . i loved it ."},
        {"prompt": "i streamed it and it was", "completion": " dull ."},
    ]
    batch = encode_sft_batch(tokenizer, rows, max_length=128)
    input_ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]  # (2, L)
    assert input_ids.shape == mask.shape == labels.shape
    for i, row in enumerate(rows):
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        n = len(prompt) + len(completion)
        # right-padded: tokens first, then padding
        assert input_ids[i, :n].tolist() == prompt + completion
        assert mask[i].tolist() == [1] * n + [0] * (input_ids.shape[1] - n)
        assert (input_ids[i, n:] == tokenizer.pad_token_id).all()
        # labels: -100 on the prompt and the padding, the completion (with its EOS) otherwise
        expected = [-100] * len(prompt) + completion + [-100] * (input_ids.shape[1] - n)
        assert labels[i].tolist() == expected
    assert mask[1].sum() < mask[0].sum()  # the second row really is padded


def test_sft_truncation_drops_the_start_of_the_prompt():
    tokenizer = load_tokenizer("builtin:tiny")
    row = {"prompt": "last night i saw the new thriller and honestly it was", "completion": " great ."}
    prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    max_length = len(completion) + 3
    batch = encode_sft_batch(tokenizer, [row], max_length=max_length)
    assert batch["input_ids"][0].tolist() == prompt[-3:] + completion
    assert batch["labels"][0].tolist() == [-100] * 3 + completion


# --- generation -----------------------------------------------------------------------------------

PROMPTS = ["we watched the film and it was", "i streamed this western and honestly it was", "the sequel was"]


@pytest.fixture(scope="module")
def sft_model(sft_dir):
    path = resolve_model_ref(str(sft_dir))
    tokenizer = load_tokenizer(path)
    return load_causal_lm(path, tokenizer, seed=0), tokenizer


def test_generate_is_reproducible_for_a_seed(sft_model):
    model, tokenizer = sft_model
    first = generate(model, tokenizer, PROMPTS, max_new_tokens=12, temperature=1.0, seed=3)
    again = generate(model, tokenizer, PROMPTS, max_new_tokens=12, temperature=1.0, seed=3)
    assert first == again
    assert [c.prompt for c in first] == PROMPTS
    others = [generate(model, tokenizer, PROMPTS, max_new_tokens=12, temperature=1.0, seed=s) for s in (4, 5)]
    assert any(o != first for o in others), "different seeds should sample differently"


def test_generate_finish_reason(sft_model):
    model, tokenizer = sft_model
    # the SFT model completes a review in well under 40 tokens, then emits EOS
    done = generate(model, tokenizer, PROMPTS, max_new_tokens=40, temperature=0)
    assert [c.finish_reason for c in done] == ["stop"] * 3
    assert all(c.text.strip() for c in done)
    assert all(tokenizer.eos_token not in c.text for c in done)
    # two tokens are never enough
    cut = generate(model, tokenizer, PROMPTS, max_new_tokens=2, temperature=0)
    assert [c.finish_reason for c in cut] == ["length"] * 3
    for short, full in zip(cut, done, strict=True):
        assert full.text.startswith(short.text)


def test_generate_finish_reason_per_row(sft_model):
    """finish_reason follows each row's own tokens, also when rows stop at different times."""
    model, tokenizer = sft_model
    prompts = PROMPTS * 4
    completions = generate(model, tokenizer, prompts, max_new_tokens=9, temperature=1.0, seed=0)
    ids, mask = encode_prompts(tokenizer, prompts, 512)
    raw, _ = sample(
        model, ids, mask, 9, 1.0, eos_token_id=tokenizer.eos_token_id, generator=torch.Generator().manual_seed(0)
    )
    expected = ["stop" if tokenizer.eos_token_id in row else "length" for row in raw.tolist()]
    assert [c.finish_reason for c in completions] == expected
    assert set(expected) == {"stop", "length"}, "this seed should give both kinds"


def test_left_padding_does_not_change_a_completion(sft_model):
    """Positions follow the mask: a prompt's samples do not depend on how much left padding it gets.

    Sampling draws the same random numbers per row whatever the probabilities, so with the same seed and batch
    size, row 1 samples the same tokens next to a long or a short neighbour (padded by different amounts).
    """
    model, tokenizer = sft_model
    neighbours = ["last night my friends and i saw the new animated film and honestly it was", "we watched"]
    lengths = [len(tokenizer(n)["input_ids"]) for n in neighbours]
    assert lengths[0] > lengths[1] + 8
    for short in ["the sequel was", "i streamed this western and it was"]:
        texts = [
            generate(model, tokenizer, [neighbour, short], max_new_tokens=16, temperature=1.0, seed=7)[1].text
            for neighbour in neighbours
        ]
        assert texts[0] == texts[1]
    greedy_alone = generate(model, tokenizer, ["the sequel was"], max_new_tokens=12, temperature=0)
    greedy_batched = generate(model, tokenizer, [neighbours[0], "the sequel was"], max_new_tokens=12, temperature=0)
    assert greedy_batched[1].text == greedy_alone[0].text


def test_sampled_logprobs_are_those_of_a_full_forward(sft_model):
    """PPO takes the policy's log-probabilities from sampling (no second forward): they must be the full-forward
    ones at the sampling temperature, before top-k filtering, with left padding and rows that stop early."""
    model, tokenizer = sft_model
    prompts = [*PROMPTS, "the sequel was"]
    ids, mask = encode_prompts(tokenizer, prompts, 512)
    generator = torch.Generator().manual_seed(3)
    raw, logprobs = sample(model, ids, mask, 18, 0.7, top_k=5, eos_token_id=tokenizer.eos_token_id, generator=generator)
    responses, kept, stopped = truncate_after_stop(raw, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert stopped.any() and not stopped.all(), "this seed should give rows of both kinds"
    full, _ = token_logprobs(model, torch.cat([ids, responses], 1), torch.cat([mask, kept], 1), ids.shape[1], 0.7)
    assert_close(logprobs * kept, full * kept, atol=1e-5, rtol=0)
    assert (logprobs[kept.bool()] < 0).all()


def test_fused_gelu_computes_gpt2s_gelu(sft_dir):
    tokenizer = load_tokenizer(str(sft_dir))
    model = load_causal_lm(str(sft_dir), tokenizer, 0).eval()
    ids, mask = encode_prompts(tokenizer, PROMPTS, 512)
    with torch.no_grad():
        before = lm_logits(model, ids, mask)
        fuse_activations(model)
        after = lm_logits(model, ids, mask)
    assert not any(type(m) is NewGELUActivation for m in model.modules())
    assert any(type(m) is GELUTanh for m in model.modules())
    assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["builtin", "llama", "gpt_neox"])
def test_models_load_with_pytorchs_fused_attention(tmp_path, arch):
    """Scaled dot-product attention (flash or memory-efficient kernels on CUDA), not the eager matmul-softmax."""
    ref = "builtin:tiny" if arch == "builtin" else str(build_model(arch, tmp_path / arch))
    model = load_causal_lm(ref, load_tokenizer(ref), seed=0)
    assert model.config._attn_implementation == "sdpa"


def test_generate_with_a_prompt_longer_than_the_context(sft_model):
    """builtin:tiny has 128 positions. A longer prompt keeps its end so that it fits with the new tokens,
    instead of crashing inside the position embedding with an IndexError."""
    model, tokenizer = sft_model
    context = model.config.n_positions  # 128
    prompt = " ".join(["we watched the film and it was great ."] * 16)
    assert len(tokenizer(prompt)["input_ids"]) > context
    completions = generate(model, tokenizer, [prompt], max_new_tokens=8, temperature=1.0)
    assert len(completions) == 1 and completions[0].finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="context"):
        generate(model, tokenizer, ["we watched"], max_new_tokens=context, temperature=1.0)


def test_generate_with_an_empty_prompt(sft_model):
    """An empty prompt samples unconditionally (from the BOS/EOS token)."""
    model, tokenizer = sft_model
    completions = generate(model, tokenizer, [""], max_new_tokens=8, temperature=1.0)
    assert len(completions) == 1 and completions[0].prompt == "" and completions[0].text


# --- model references -----------------------------------------------------------------------------


def test_resolve_model_ref(tmp_path, sft_dir):
    job = json.loads((sft_dir / JOB_FILE).read_text())
    final = sft_dir / "checkpoints" / f"step-{job['final_step']}"
    assert resolve_model_ref(str(sft_dir)) == str(final / "policy")
    assert resolve_model_ref(str(final)) == str(final / "policy")
    assert resolve_model_ref("builtin:tiny") == "builtin:tiny"
    missing = str(tmp_path / "nowhere")
    assert resolve_model_ref(missing) == missing  # e.g. a hub id


def test_resolve_model_ref_of_an_unfinished_job(tmp_path):
    out = tmp_path / "paused"
    result, _ = train(make_spec("sft", hyperparameters={"max_steps": 4}), out, Recorder(stop_after=2))
    assert result.status == "paused"
    with pytest.raises(ModelNotFoundError, match="not finished"):
        resolve_model_ref(str(out))
    # its checkpoint can be named explicitly
    assert resolve_model_ref(str(out / "checkpoints" / "step-2")) == str(out / "checkpoints" / "step-2" / "policy")
    with pytest.raises(ModelNotFoundError):
        load_tokenizer(str(out))


def test_resolve_model_ref_of_a_failed_job(tmp_path, sft_dir):
    out = tmp_path / "failed"
    shutil.copytree(sft_dir, out)
    (out / JOB_FILE).write_text(json.dumps({"status": "failed", "final_step": 60}))
    with pytest.raises(ModelNotFoundError, match="not succeeded"):
        resolve_model_ref(str(out))


def test_a_job_folder_names_a_model_in_a_later_spec(tmp_path, sft_dir):
    """An SFT job's folder is a valid ``model``: training starts from its weights and tokenizer."""
    result, rec = train(make_spec("sft", model=sft_dir, hyperparameters={"max_steps": 1}), tmp_path / "more")
    assert result.status == "succeeded"
    # a trained model starts far below the random model's loss of ~ln(vocab)
    assert rec.metrics[1]["loss/sft"] < 2.0


@pytest.mark.parametrize("top_p", [1e-46, 1e-30, 0.01])
def test_a_tiny_top_p_samples_the_most_likely_token(top_p):
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])  # (B, V)
    tokens = sample_next(logits, temperature=1.0, top_k=0, top_p=top_p, generator=torch.Generator().manual_seed(0))
    assert tokens.tolist() == [1, 0]
