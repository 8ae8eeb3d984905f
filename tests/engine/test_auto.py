"""The "auto" hyperparameters (engine/spec/auto.py) against the rules they document: OpenAI's epochs and batch by the
file's size, TRL's rates at a 4096-wide model falling as 1 / width, LoRA at 10 × the full rate, explicit values
winning."""

import math

import pytest

from engine.builtin import TINY_CONFIG
from engine.spec.auto import (
    FULL_RATES,
    REFERENCE_WIDTH,
    auto_batch_size,
    auto_epochs,
    auto_hyperparameters,
    auto_learning_rate,
    auto_total_steps,
    model_width,
)
from engine.spec.config import JOB_TYPES, JobSpec


def test_epochs_and_batch_follow_openais_documented_rules() -> None:
    assert [auto_epochs(n) for n in (1, 10, 33, 34, 100, 8333, 8334, 20_000, 30_000)] == [25, 10, 4, 3, 3, 3, 2, 1, 1]
    assert [auto_batch_size(n) for n in (1, 249, 250, 1000, 10_000, 1_000_000)] == [1, 1, 1, 2, 20, 256]


@pytest.mark.parametrize("rows", [1, 16, 33, 240, 4000, 9000, 30_000])
def test_auto_epochs_see_100_to_25000_examples_where_the_caps_allow(rows: int) -> None:
    seen = auto_epochs(rows) * rows
    assert seen >= min(100, 25 * rows)
    assert seen <= max(25_000, rows)


def test_ppo_and_grpo_steps_make_the_same_passes_over_the_prompts() -> None:
    assert auto_total_steps(4000, 64) == math.ceil(3 * 4000 / 64)
    assert auto_total_steps(16, 64) == 2  # 7 passes over 16 prompts: 112 prompts, two batches of 64
    assert auto_total_steps(1, 16) == 2  # 25 passes over one prompt
    assert auto_total_steps(30_000, 1000) == 30


def test_the_width_is_read_from_every_config_spelling() -> None:
    assert model_width({"hidden_size": 4096, "num_hidden_layers": 32}) == 4096  # Llama, Qwen2, Mistral, GPT-NeoX
    assert model_width(TINY_CONFIG) == 128  # GPT-2's n_embd
    assert model_width({"d_model": 512}) == 512
    assert model_width({"model_type": "llava", "text_config": {"hidden_size": 2048}}) == 2048
    assert model_width({"hidden_size": True}) is None
    assert model_width({"vocab_size": 1000}) is None


@pytest.mark.parametrize("job_type", sorted(FULL_RATES))
def test_rates_are_the_common_ones_at_4096_and_fall_as_one_over_the_width(job_type: str) -> None:
    assert auto_learning_rate(job_type, REFERENCE_WIDTH, lora=False) == FULL_RATES[job_type]
    for width in (64, 128, 768, 2048, 8192):
        full = auto_learning_rate(job_type, width, lora=False)
        assert full == pytest.approx(FULL_RATES[job_type] * REFERENCE_WIDTH / width, rel=1e-2)
        assert auto_learning_rate(job_type, 2 * width, lora=False) == pytest.approx(full / 2, rel=1e-2)
        assert auto_learning_rate(job_type, width, lora=True) == pytest.approx(min(10 * full, 1e-2), rel=1e-2)
    assert auto_learning_rate(job_type, 1, lora=True) == 1e-2  # capped, however narrow the model


def test_the_documented_values_for_the_builtin_model() -> None:
    assert {t: auto_learning_rate(t, 128, lora=False) for t in FULL_RATES} == {
        "sft": 6.4e-4,
        "rm": 3.2e-4,
        "dpo": 3.2e-5,
    }
    assert auto_learning_rate("ppo", 128, lora=False) is None
    assert auto_learning_rate("grpo", 4096, lora=True) is None


def test_given_values_win_and_max_steps_keeps_the_epochs() -> None:
    assert auto_hyperparameters("dpo", {}, rows=240, width=128, lora=False) == {"epochs": 3.0, "learning_rate": 3.2e-5}
    given = {"epochs": 1, "learning_rate": 1e-6}
    assert auto_hyperparameters("dpo", given, rows=240, width=128, lora=False) == {}
    assert auto_hyperparameters("sft", {"max_steps": 5}, rows=16, width=64, lora=True) == {"learning_rate": 1e-2}
    assert auto_hyperparameters("rm", {"max_steps": None}, rows=16, width=None, lora=False) == {"epochs": 7.0}
    assert auto_hyperparameters("sft", {}, rows=None, width=None, lora=False) == {}
    assert auto_hyperparameters("ppo", {"batch_size": 8}, rows=16, width=128, lora=False) == {"total_steps": 14}
    assert auto_hyperparameters("grpo", {"total_steps": 3}, rows=16, width=128, lora=False) == {}


@pytest.mark.parametrize("job_type", list(JOB_TYPES))
def test_every_auto_choice_is_a_valid_spec(job_type: str) -> None:
    for rows in (1, 16, 240, 4000, 1_000_000):
        for width in (8, 64, 128, 4096, 16_384):
            chosen = auto_hyperparameters(job_type, {}, rows=rows, width=width, lora=True)
            models = {"reward_model": "builtin:tiny"} if JOB_TYPES[job_type].reward_model else {}
            if JOB_TYPES[job_type].teacher:
                models["teacher"] = "builtin:tiny"
            spec = JobSpec.model_validate(
                {"type": job_type, "model": "builtin:tiny", "dataset": "x.jsonl", "hyperparameters": chosen, **models}
            )
            assert {name: spec.hyperparameters[name] for name in chosen} == chosen
