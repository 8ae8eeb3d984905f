"""LoRA: only adapters train, checkpoints hold merged weights loadable by plain transformers, resume is
exact, and PPO's reference and reward model are the adapter-disabled bases."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from engine.core.models import load_causal_lm, load_tokenizer
from tests.engine.helpers import Pretrained, load_weights, make_spec, train
from tests.recorder import Recorder

LORA = {"r": 4, "alpha": 8}


def test_sft_lora_trains_adapters_and_saves_merged_weights(tmp_path: Path) -> None:
    spec = make_spec("sft", hyperparameters={"max_steps": 3, "learning_rate": 1e-2}, lora=LORA)
    result, _ = train(spec, tmp_path / "job")
    step_dir = tmp_path / "job" / "checkpoints" / "step-3"
    adapters = load_file(step_dir / "adapters" / "policy" / "adapter_model.safetensors")
    assert adapters and all("lora_" in key for key in adapters)
    assert any(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)  # B starts at 0: it trained

    tokenizer = load_tokenizer("builtin:tiny")
    base = load_causal_lm("builtin:tiny", tokenizer, seed=0)
    merged = AutoModelForCausalLM.from_pretrained(step_dir / "policy")
    assert not any("lora" in key for key in load_weights(step_dir / "policy"))
    # Only adapted weights moved: embeddings (not adapted) are the base's exactly; attention weights differ.
    torch.testing.assert_close(merged.transformer.wte.weight, base.transformer.wte.weight, rtol=0, atol=0)
    assert not torch.equal(merged.transformer.h[0].attn.c_attn.weight, base.transformer.h[0].attn.c_attn.weight)
    assert result.status == "succeeded"


def test_sft_lora_resume_is_exact(tmp_path: Path, deterministic: None) -> None:
    spec = make_spec("sft", hyperparameters={"max_steps": 4, "learning_rate": 1e-2}, lora=LORA)
    train(spec, tmp_path / "straight")
    paused, _ = train(spec, tmp_path / "resumed", Recorder(stop_after=2))
    assert paused.status == "paused"
    resumed, _ = train(spec, tmp_path / "resumed")
    assert resumed.status == "succeeded"
    for sub in ("policy", "adapters/policy"):
        a = load_weights(tmp_path / "straight" / "checkpoints" / "step-4" / sub)
        b = load_weights(tmp_path / "resumed" / "checkpoints" / "step-4" / sub)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), sub


def test_ppo_lora_reference_is_the_adapter_disabled_policy(pretrained: Pretrained, tmp_path: Path) -> None:
    spec = make_spec(
        "ppo",
        model=pretrained.sft,
        reward_model=pretrained.rm,
        hyperparameters={"total_steps": 2, "learning_rate": 1e-2},
        lora=LORA,
    )
    result, rec = train(spec, tmp_path / "ppo")
    assert result.status == "succeeded"
    # Fresh adapters are zero, so at the first rollout policy == reference (the policy's log-probabilities come
    # from sampling with the KV cache, the reference's from one forward: equal up to float rounding); after one
    # update they differ.
    assert rec.metrics[1]["objective/kl"] == pytest.approx(0.0, abs=1e-5)
    assert rec.metrics[2]["objective/kl"] > 1e-3
    step_dir = tmp_path / "ppo" / "checkpoints" / "step-2"
    assert (step_dir / "adapters" / "policy").is_dir() and (step_dir / "adapters" / "value").is_dir()
    # The critic started as the reward model; its merged copy must load as a scalar model.
    value = load_weights(step_dir / "value")
    assert value["score.weight"].shape[0] == 1
