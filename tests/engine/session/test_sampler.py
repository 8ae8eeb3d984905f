"""A session's sampling (engine/session/sampler.py) against naive loops over the whole sequence: greedy tokens, the
log-probs of sampled tokens at the temperature, where stop tokens and stop strings cut, the prompt's log-probs, and
the user errors of a prompt the model cannot sample."""

import math

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.core.models import load_causal_lm, load_tokenizer
from engine.session.errors import UserError
from engine.session.sampler import SamplingParams, check_prompt, sample

PROMPT = [5, 17, 42, 9]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer("builtin:tiny")


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    return load_causal_lm("builtin:tiny", tokenizer, seed=0).eval()


def full_logits(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """The logits at every position of ``tokens``, one forward of the whole sequence: (T, V)."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def naive_greedy(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(full_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def test_greedy_samples_are_the_naive_argmax_loop(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    sequences, prompt_logprobs = sample(model, tokenizer, PROMPT, 2, params)
    expected = naive_greedy(model, PROMPT, 6)
    assert prompt_logprobs is None
    for sequence in sequences:
        assert sequence.tokens == expected and sequence.stop_reason == "length"
        assert len(sequence.logprobs) == 6


def test_sampled_logprobs_are_those_of_the_whole_sequence_at_the_temperature(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.8, stop=[], seed=3)
    sequences, _ = sample(model, tokenizer, PROMPT, 3, params)
    again, _ = sample(model, tokenizer, PROMPT, 3, params)
    assert [s.tokens for s in sequences] == [s.tokens for s in again]  # a seed samples the same
    assert len({tuple(s.tokens) for s in sequences}) > 1  # three samples of one prompt differ
    for sequence in sequences:
        logits = full_logits(model, PROMPT + sequence.tokens)[len(PROMPT) - 1 : -1] / 0.8
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(sequence.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(sequence.logprobs), expected, rtol=0, atol=1e-4)


def first_new(tokens: list[int]) -> int:
    """The first position after 0 whose token did not come earlier: a stop there cuts there and nowhere before."""
    return next(t for t in range(1, len(tokens)) if tokens[t] not in tokens[:t])


def seeded(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, **params: object) -> list[int]:
    """A sample of 8 tokens at seed 7 (the same draws whatever the stops: a stop only cuts)."""
    [sequence], _ = sample(model, tokenizer, PROMPT, 1, SamplingParams(max_tokens=8, seed=7, **params))  # type: ignore[arg-type]
    return sequence.tokens


def test_a_stop_token_ends_the_sequence_and_is_kept(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    whole = seeded(model, tokenizer, stop=[])
    t = first_new(whole)
    [sequence], _ = sample(model, tokenizer, PROMPT, 1, SamplingParams(max_tokens=8, seed=7, stop=[whole[t]]))
    assert sequence.tokens == whole[: t + 1] and sequence.stop_reason == "stop"
    assert len(sequence.logprobs) == t + 1


def test_the_models_own_stop_tokens_by_default(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    whole = seeded(model, tokenizer, stop=[])
    t = first_new(whole)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = whole[t]
    try:
        assert seeded(model, tokenizer) == whole[: t + 1]
    finally:
        model.generation_config.eos_token_id = saved


def test_a_stop_string_cuts_at_the_token_that_completes_it(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    whole = seeded(model, tokenizer, stop=[])
    text = tokenizer.decode(whole)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    # naively: the shortest prefix whose text holds the stop string
    expected = next(whole[: t + 1] for t in range(len(whole)) if stop in tokenizer.decode(whole[: t + 1]))
    [sequence], _ = sample(model, tokenizer, PROMPT, 1, SamplingParams(max_tokens=8, seed=7, stop=stop))
    assert sequence.tokens == expected and sequence.stop_reason == "stop"
    assert seeded(model, tokenizer, stop=[stop, "\x00"]) == expected


def test_prompt_logprobs_are_nan_then_each_tokens_under_what_precedes_it(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    _, scores = sample(model, tokenizer, PROMPT, 1, SamplingParams(max_tokens=1), prompt_logprobs=True)
    assert scores is not None and len(scores) == len(PROMPT) and math.isnan(scores[0])
    logprobs = full_logits(model, PROMPT).log_softmax(-1)
    expected = [logprobs[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    assert scores[1:] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "prompt.chunks: the prompt has no tokens"),
        ([3, 574], SamplingParams(), r"prompt.chunks: token id 574 is outside the vocabulary \(0 to 573\)"),
        ([1], SamplingParams(max_tokens=0), "sampling_params.max_tokens: at least 1"),
        ([1] * 100, SamplingParams(max_tokens=29), "exceed the model's context of 128"),
        ([1], SamplingParams(temperature=-1), "sampling_params.temperature"),
        ([1], SamplingParams(temperature=math.nan), "sampling_params.temperature"),
        ([1], SamplingParams(top_p=0), "sampling_params.top_p"),
        ([1], SamplingParams(top_k=0), "sampling_params.top_k"),
    ],
)
def test_what_the_model_cannot_sample_is_a_user_error_naming_the_field(
    prompt: list[int], params: SamplingParams, message: str
) -> None:
    with pytest.raises(UserError, match=message):
        check_prompt(prompt, params, 574, 128)
    check_prompt([1] * 100, SamplingParams(max_tokens=28), 574, 128)  # exactly the context is fine
