"""Every saved model loads back whole (engine/core/models.py ``save_model``, ``merged_state_dict``, ``check_saved``):
for each architecture of tests/models.py, in full and with LoRA, plain transformers loads the saved folder with
no missing or unexpected weight, and the weights it loads are the engine's model's (its adapters merged). A save
that would not load back whole fails instead, naming the weights; and LoRA on the fused experts of an MoE
(transformers 5's Qwen3-MoE) trains, folds and saves.
"""

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedModel

from engine import builtin
from engine.core.models import (
    IncompleteSaveError,
    apply_lora,
    check_saved,
    folded_adapters,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    save_model,
)
from engine.spec.config import JobSpec, LoraSpec
from tests.engine.helpers import final_model_dir, train
from tests.models import ARCHITECTURES, MORE_ARCHITECTURES, build_model, build_tokenizer

EVERY_ARCHITECTURE = ARCHITECTURES + MORE_ARCHITECTURES
LORA = LoraSpec(r=4, alpha=8)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def with_trained_adapters(model: PreTrainedModel, seed: int = 1) -> PreTrainedModel:
    """``model`` with LoRA whose B matrices are random, as after training (fresh ones are zero: ΔW = 0)."""
    model = apply_lora(model, LORA, "CAUSAL_LM" if model.can_generate() else "SEQ_CLS", None)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def assert_loads_back_whole(auto: type, folder: Path, expected: dict[str, torch.Tensor]) -> None:
    loaded, info = auto.from_pretrained(folder, output_loading_info=True)  # type: ignore[attr-defined]
    assert {key: value for key, value in info.items() if value} == {}, "every weight saved, under its own name"
    state = loaded.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", EVERY_ARCHITECTURE)
def test_a_saved_causal_lm_loads_back_whole_in_plain_transformers(
    arch: str, lora: bool, tokenizer_dir: Path, tmp_path: Path
) -> None:
    folder = build_model(arch, tmp_path / "base", tokenizer=tokenizer_dir)
    tokenizer = load_tokenizer(str(folder))
    model = load_causal_lm(str(folder), tokenizer, seed=0)
    if lora:
        model = with_trained_adapters(model)
    save_model(model, tokenizer, tmp_path / "out" / "policy")
    # With LoRA, the weights to expect are merged by peft itself, on a copy.
    merged = copy.deepcopy(model).merge_and_unload() if lora else model  # type: ignore[operator]
    assert_loads_back_whole(AutoModelForCausalLM, tmp_path / "out" / "policy", merged.state_dict())


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_saved_lora_reward_model_loads_back_whole(arch: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    folder = build_model(arch, tmp_path / "base", tokenizer=tokenizer_dir)
    tokenizer = load_tokenizer(str(folder))
    model = with_trained_adapters(load_scalar_model(str(folder), tokenizer, seed=0))
    save_model(model, tokenizer, tmp_path / "out" / "policy")
    merged = copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]
    assert_loads_back_whole(AutoModelForSequenceClassification, tmp_path / "out" / "policy", merged.state_dict())


def test_a_save_missing_or_adding_weights_fails_naming_them(tokenizer_dir: Path, tmp_path: Path) -> None:
    folder = build_model("qwen3_moe", tmp_path / "base", tokenizer=tokenizer_dir)
    tokenizer = load_tokenizer(str(folder))
    model = load_causal_lm(str(folder), tokenizer, seed=0)
    out = tmp_path / "out"
    save_model(model, tokenizer, out)
    check_saved(model, out)  # as saved: whole (the experts one by one, as transformers writes them)
    weights = load_file(out / "model.safetensors")
    weights["model.layers.0.mlp.experts.base_layer.down_proj"] = weights.pop("model.layers.0.mlp.gate.weight")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(IncompleteSaveError, match="would not load back whole") as caught:
        check_saved(model, out)
    assert "missing 1 weights (model.layers.0.mlp.gate.weight)" in str(caught.value)
    assert "unexpected 1 weights (model.layers.0.mlp.experts.base_layer.down_proj)" in str(caught.value)


def test_folding_moe_expert_adapters_computes_what_the_adapters_do(tokenizer_dir: Path, tmp_path: Path) -> None:
    folder = build_model("qwen3_moe", tmp_path / "base", tokenizer=tokenizer_dir)
    tokenizer = load_tokenizer(str(folder))
    model = with_trained_adapters(load_causal_lm(str(folder), tokenizer, seed=0)).eval()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    ids = torch.tensor([tokenizer.encode("the film was good and")])  # (1, L)
    with torch.no_grad():
        unfolded = model(input_ids=ids).logits  # (1, L, V)
        with folded_adapters(model):
            folded = model(input_ids=ids).logits
    torch.testing.assert_close(folded, unfolded, rtol=1e-4, atol=1e-5)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items()), "unfolded after"


def test_grpo_with_lora_on_a_moe_trains_a_step_and_saves_it_whole(tokenizer_dir: Path, tmp_path: Path) -> None:
    folder = build_model("qwen3_moe", tmp_path / "base", tokenizer=tokenizer_dir)
    spec = JobSpec.model_validate(
        {
            "type": "grpo",
            "model": str(folder),
            "dataset": "builtin:digits-prompts",
            "reward": builtin.digits.GRADER,
            "lora": {"r": 4, "alpha": 8},
            "hyperparameters": {"total_steps": 1, "batch_size": 2, "group_size": 2, "mini_batch_size": 4,
                                "response_length": 4},
        }
    )  # fmt: skip
    result, _ = train(spec, tmp_path / "grpo")
    assert result.status == "succeeded", result
    policy = final_model_dir(tmp_path / "grpo")
    _, info = AutoModelForCausalLM.from_pretrained(policy, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}
