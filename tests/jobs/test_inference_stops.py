"""Serving stops where the model's turn ends (``jobs.inference.complete``, what the generate endpoint and the
OpenAI-compatible ones run): at any of its stop tokens, and at stop strings that name special tokens. The models
are tests/end_tokens.py's, which answer :data:`ANSWER` and their end-of-turn token, then go on answering."""

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from engine.core.models import load_causal_lm, load_tokenizer
from jobs import inference
from tests.end_tokens import ANSWER, LLAMA3, PHI3, build_end_of_turn_model

MESSAGES = [{"role": "user", "content": "Finish this review: the food"}]


def loaded(folder: Path) -> inference.Loaded:
    tokenizer = load_tokenizer(str(folder))
    return inference.Loaded(load_causal_lm(str(folder), tokenizer, seed=0).eval(), tokenizer)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, inference.Loaded]:
    """Llama 3 and Phi-3 lookalikes whose generation config names the end of turn, and ``base``: a Llama 3 whose
    generation config lists only the EOS, as a base model's does, so only a stop string ends its turn."""
    root = tmp_path_factory.mktemp("served")
    return {
        "llama3": loaded(build_end_of_turn_model(LLAMA3, root / "llama3")),
        "phi3": loaded(build_end_of_turn_model(PHI3, root / "phi3")),
        "base": loaded(build_end_of_turn_model(LLAMA3, root / "base", generation_eos=(LLAMA3.eos,))),
    }


def complete(served: inference.Loaded, stop: list[str] | None = None, temperature: float = 1.0) -> tuple[list, int]:
    prompts = [MESSAGES, "the food was"]
    rows, usage = inference.complete(served.model, served.tokenizer, prompts, 12, temperature, 1.0, seed=5, stop=stop)
    return [(row["text"], row["finish_reason"]) for row in rows], usage["completion_tokens"]


def tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("name", ["llama3", "phi3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_completion_ends_at_the_end_of_turn_without_it_in_the_text(
    models: dict[str, inference.Loaded], name: str, temperature: float
) -> None:
    served = models[name]
    answer = tokens(served.tokenizer, ANSWER)
    assert complete(served, temperature=temperature) == ([(ANSWER, "stop")] * 2, 2 * (answer + 1))  # counted with it


def test_stop_strings_may_name_special_tokens(models: dict[str, inference.Loaded]) -> None:
    base = models["base"]
    answer = tokens(base.tokenizer, ANSWER)
    texts, count = complete(base)
    assert texts == [(ANSWER * 3, "length")] * 2 and count == 24  # on past the end of turn: 12 tokens each
    # one special token: sampling ends at it, as at a stop token of the model
    assert complete(base, stop=["<|eot_id|>"]) == ([(ANSWER, "stop")] * 2, 2 * (answer + 1))
    # a special token among text: looked for in the text with special tokens kept
    assert complete(base, stop=["film<|eot_id|> a"]) == ([(" a great ", "stop")] * 2, 2 * (answer + 2))
    # plain text first: the stop string the fewest tokens produce wins
    assert complete(base, stop=["<|eot_id|> a", " great"]) == ([(" a", "stop")] * 2, 2 * 2)
