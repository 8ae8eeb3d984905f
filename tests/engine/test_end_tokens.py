"""Responses end where transformers' ``generate`` ends them: at any of a model's stop tokens (its generation
config's ``eos_token_id``, the tokenizer's EOS), not only the tokenizer's EOS. Tiny Llama 3 and Phi-3 lookalikes
(tests/end_tokens.py) answer every prompt with :data:`ANSWER` and their end-of-turn token (``<|eot_id|>``,
``<|end|>``), then go on; sampling, PPO and GRPO rollouts stop there, and checkpoints carry the stop ids."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from engine.core.data import encode_prompts
from engine.core.generate import Decoder, generate, sample
from engine.core.models import StopTokenError, load_causal_lm, load_tokenizer, resolve_stop_token, stop_token_ids
from engine.spec.config import JobSpec
from tests.end_tokens import ANSWER, LLAMA3, PHI3, Family, build_end_of_turn_model
from tests.engine.helpers import final_model_dir, train
from tests.models import chat_rows, write_jsonl

FAMILIES = {"llama3": LLAMA3, "phi3": PHI3}
MESSAGES = [{"role": "user", "content": "Finish this review: the food"}]
PROMPTS: list[Any] = [MESSAGES, "the food was", ""]
GRADER = {"type": "string_check", "name": "answer", "input": "{{sample.output_text}}", "reference": ANSWER,
          "operation": "eq"}  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's model, its generation config listing the end of turn and the EOS; and ``phi3-end``, whose
    generation config lists ``<|end|>`` alone (the tokenizer's EOS being ``<|endoftext|>``)."""
    root = tmp_path_factory.mktemp("end-tokens")
    built = {name: build_end_of_turn_model(family, root / name) for name, family in FAMILIES.items()}
    built["phi3-end"] = build_end_of_turn_model(PHI3, root / "phi3-end", generation_eos=(PHI3.end_of_turn,))
    return built


def loaded(folder: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = load_tokenizer(str(folder))
    return load_causal_lm(str(folder), tokenizer, seed=0).eval(), tokenizer


def ids(tokenizer: PreTrainedTokenizerBase, *tokens: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def answer_tokens(tokenizer: PreTrainedTokenizerBase, family: Family) -> list[int]:
    return [*tokenizer.encode(ANSWER, add_special_tokens=False), *ids(tokenizer, family.end_of_turn)]


def test_the_stop_ids_are_the_generation_configs_and_the_tokenizers_eos(folders: dict[str, Path]) -> None:
    model, tokenizer = loaded(folders["llama3"])
    assert stop_token_ids(model, tokenizer) == tuple(ids(tokenizer, "<|eot_id|>", "<|end_of_text|>"))
    model, tokenizer = loaded(folders["phi3-end"])  # the tokenizer's EOS is added to what the generation config lists
    assert stop_token_ids(model, tokenizer) == tuple(ids(tokenizer, "<|end|>", "<|endoftext|>"))
    assert model.generation_config.eos_token_id == ids(tokenizer, "<|end|>", "<|endoftext|>")
    model.config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|assistant|>"), tokenizer.eos_token_id]
    assert stop_token_ids(model, tokenizer) == tuple(ids(tokenizer, "<|end|>", "<|endoftext|>", "<|assistant|>"))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_generate_stops_at_the_end_of_turn(folders: dict[str, Path], name: str, temperature: float) -> None:
    model, tokenizer = loaded(folders[name])
    completions = generate(model, tokenizer, PROMPTS, max_new_tokens=12, temperature=temperature, seed=3)
    expected = answer_tokens(tokenizer, FAMILIES[name])
    assert [(c.text, c.finish_reason, c.tokens) for c in completions] == [(ANSWER, "stop", expected)] * len(PROMPTS)
    # plain transformers, from the same folder, stops at the same token
    plain = AutoModelForCausalLM.from_pretrained(folders[name])
    input_ids, attention_mask = encode_prompts(tokenizer, PROMPTS[:1], 64)
    out = plain.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
    assert out[0, input_ids.shape[1] :].tolist() == expected


@pytest.mark.parametrize("static_cache", [False, True])
def test_sampling_ends_once_every_row_has_any_stop_token(folders: dict[str, Path], static_cache: bool) -> None:
    model, tokenizer = loaded(folders["llama3"])
    queries, mask = encode_prompts(tokenizer, PROMPTS, 64)
    stops = stop_token_ids(model, tokenizer)
    decoder = Decoder(model, max_prompt_length=64, max_rows=8) if static_cache else None
    tokens, _ = sample(model, queries, mask, 12, 1.0, eos_token_id=stops, group_size=2, decoder=decoder,
                       generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert tokens.tolist() == [answer_tokens(tokenizer, LLAMA3)] * (2 * len(PROMPTS))


def test_a_stop_token_is_eos_or_one_token_of_the_vocabulary(folders: dict[str, Path]) -> None:
    model, tokenizer = loaded(folders["llama3"])
    assert resolve_stop_token("eos", model, tokenizer) == tuple(ids(tokenizer, "<|eot_id|>", "<|end_of_text|>"))
    assert resolve_stop_token("<|eot_id|>", model, tokenizer) == tuple(ids(tokenizer, "<|eot_id|>"))
    assert resolve_stop_token("Ġfilm", model, tokenizer) == tuple(ids(tokenizer, "Ġfilm"))  # as the vocabulary has it
    assert resolve_stop_token(" film", model, tokenizer) == tuple(ids(tokenizer, "Ġfilm"))  # text of one token
    assert resolve_stop_token(None, model, tokenizer) == ()
    with pytest.raises(StopTokenError, match=r"'<\|im_end\|>x' is not a token .* 'eos' for the model's end tokens"):
        resolve_stop_token("<|im_end|>x", model, tokenizer)
    assert issubclass(StopTokenError, ValueError)  # a job fails with invalid_spec


def rl_spec(job_type: str, folder: Path, prompts: Path, **hyperparameters: Any) -> JobSpec:
    sizes = {"batch_size": 4, "group_size": 2} if job_type == "grpo" else {"batch_size": 4, "ppo_epochs": 1}
    return JobSpec.model_validate({
        "type": job_type,
        "model": str(folder),
        "dataset": str(prompts),
        "reward": GRADER,
        "hyperparameters": {"total_steps": 1, "mini_batch_size": 4, "response_length": 8, "learning_rate": 1e-4,
                            "temperature": 1.0, **sizes, **hyperparameters},
        "checkpoint_every": 1,
    })  # fmt: skip


@pytest.mark.parametrize(
    ("job_type", "name", "stop_token", "response", "length"),
    [
        ("ppo", "phi3-end", "eos", ANSWER, 4),
        ("grpo", "llama3", "eos", ANSWER, 4),
        ("grpo", "llama3", "Ġfilm", " a great", 3),  # that token alone ends a response (it is kept in the mask)
    ],
)
def test_rollouts_end_at_the_stop_tokens_and_checkpoints_keep_them(
    tmp_path: Path, folders: dict[str, Path], job_type: str, name: str, stop_token: str, response: str, length: int
) -> None:
    prompts = write_jsonl(chat_rows("prompts", 8), tmp_path / "prompts.jsonl")
    spec = rl_spec(job_type, folders[name], prompts, stop_token=stop_token)
    result, rec = train(spec, tmp_path / "out")
    assert result.status == "succeeded"
    assert rec.metrics[1]["response/eos_fraction"] == 1.0
    assert rec.metrics[1]["response/length_mean"] == length
    assert [(s["response"], s["length"]) for s in rec.samples[1]] == [(response, length)] * len(rec.samples[1])
    assert rec.metrics[1]["reward/mean"] == (1.0 if response == ANSWER else 0.0)  # the grader read the answer
    # the checkpoint's generation config lists every stop id, so a later stage and plain transformers stop alike
    policy = final_model_dir(tmp_path / "out")
    tokenizer = load_tokenizer(str(policy))
    family = LLAMA3 if name == "llama3" else PHI3
    stops = ids(tokenizer, family.end_of_turn, family.eos)
    assert json.loads((policy / "generation_config.json").read_text())["eos_token_id"] == stops
