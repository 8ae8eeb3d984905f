"""Folded LoRA rollouts (``engine.core.models.folded_adapters``): sampling with the adapters added into the float32 base
weights gives the adapter path's tokens and log-probabilities, and the base weights come back bit-identical
however many times they are folded, so training with folded rollouts ends where training with unfused ones does.
In bfloat16 the sampler's log-probs agree with the unfused training pass as closely as a model without adapters
agrees with itself (a bfloat16 weight cannot hold W + ΔW, so there the adapters stay unfused)."""

import copy
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

import engine.core.learner
from engine.core.distributed import Ranks
from engine.core.generate import sample
from engine.core.learner import Learner, Sampling, base_of
from engine.core.models import apply_lora, folded_adapters, load_causal_lm, load_tokenizer, prepare, token_logprobs
from engine.spec.config import LoraSpec
from tests.models import build_model


def lora_model(folder: Path, arch: str, dtype: str = "float32", b_scale: float = 0.05) -> PreTrainedModel:
    """A tiny random ``arch`` model in ``dtype`` with LoRA r=4 on every linear layer (as jobs apply it: after the
    cast, so the adapters are float32), its B matrices random with standard deviation ``b_scale`` (fresh ones are
    zero, and would fold as nothing)."""
    path = build_model(arch, folder)
    base = prepare(load_causal_lm(str(path), load_tokenizer(str(path)), seed=0), torch.device("cpu"), dtype, False)
    model = apply_lora(base, LoraSpec(r=4, alpha=8), "CAUSAL_LM", None)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * b_scale)
    return model.eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0, 0, 5, 9, 12], [3, 7, 1, 8, 4], [0, 6, 6, 2, 11]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0], [1]])).long()
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_folded_sampling_gives_the_adapter_paths_tokens_and_logprobs(tmp_path: Path, arch: str) -> None:
    model = lora_model(tmp_path / arch, arch)
    ids, mask = prompts()

    def sampled(folded: bool) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(3)
        with torch.inference_mode(), folded_adapters(model) if folded else nullcontext():
            return sample(model, ids, mask, 12, temperature=1.0, generator=generator, group_size=2)

    plain_tokens, plain_logprobs = sampled(False)
    folded_tokens, folded_logprobs = sampled(True)
    assert torch.equal(folded_tokens, plain_tokens)
    torch.testing.assert_close(folded_logprobs, plain_logprobs, rtol=0, atol=1e-5)
    assert not any(layer.merged for layer in model.modules() if hasattr(layer, "merged"))  # unfolded after


def test_folding_many_times_leaves_the_weights_bit_identical(tmp_path: Path) -> None:
    model = lora_model(tmp_path / "llama", "llama")
    ids, mask = prompts()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    for _ in range(50):
        with torch.inference_mode(), folded_adapters(model):
            model(input_ids=ids, attention_mask=mask)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, logits)


def test_training_with_folded_rollouts_ends_where_unfused_training_does(tmp_path: Path) -> None:
    """Many steps of sample-then-train (a REINFORCE-like loss on the sampled tokens), once sampling with folded
    adapters and once through the adapters: the same tokens every step, and the same adapter weights and outputs
    at the end."""
    folded_model = lora_model(tmp_path / "llama", "llama")
    plain_model = copy.deepcopy(folded_model)
    ids, mask = prompts()
    runs = []
    for model, folded in ((folded_model, True), (plain_model, False)):
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(trained, lr=1e-2)
        generator = torch.Generator().manual_seed(5)
        tokens_seen = []
        for _ in range(20):
            model.eval()
            with torch.inference_mode(), folded_adapters(model) if folded else nullcontext():
                tokens, _ = sample(model, ids, mask, 6, temperature=1.0, generator=generator)
            tokens = tokens.clone()
            model.train()
            sequence = torch.cat([ids, tokens], dim=1)
            full_mask = torch.cat([mask, torch.ones_like(tokens)], dim=1)
            logits = model(input_ids=sequence, attention_mask=full_mask).logits[:, ids.shape[1] - 1 : -1]
            loss = -torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tokens_seen.append(tokens)
        runs.append((model, tokens_seen))
    (folded_run, folded_tokens), (plain_run, plain_tokens) = runs
    assert all(torch.equal(a, b) for a, b in zip(folded_tokens, plain_tokens, strict=True))
    folded_state, plain_state = folded_run.state_dict(), plain_run.state_dict()
    for name, value in plain_state.items():
        if "lora_" in name:
            torch.testing.assert_close(folded_state[name], value, rtol=0, atol=1e-6)
        else:  # the frozen base: untouched by 20 folds
            assert torch.equal(folded_state[name], value), name
    folded_run.eval()
    plain_run.eval()
    with torch.no_grad():
        torch.testing.assert_close(folded_run(input_ids=ids, attention_mask=mask).logits,
                                   plain_run(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=1e-5)  # fmt: skip


def sampler_gap(model: PreTrainedModel, folded: bool) -> float:
    """Mean |Δlogp| over 16 x 32 sampled tokens between the sampler's log-probs (the rollout's, PPO's old ones)
    and the training pass's on the same tokens (``token_logprobs``, the adapters unfused, as the update computes
    them); ``folded``: sampling inside ``folded_adapters``."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (16, 8), generator=generator)  # (B, P)
    mask = (torch.arange(8) >= torch.randint(0, 7, (16, 1), generator=generator)).long()  # left padding
    with torch.inference_mode(), folded_adapters(model) if folded else nullcontext():
        tokens, logprobs = sample(model, ids * mask, mask, 32, temperature=1.0, generator=generator)  # (B, T)
    sequence = torch.cat([ids * mask, tokens], dim=1)  # (B, P + T)
    with torch.inference_mode():
        trained, _ = token_logprobs(model, sequence, torch.cat([mask, torch.ones_like(tokens)], dim=1), 8)
    return (logprobs - trained).abs().mean().item()


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "qwen3_moe"])
def test_bf16_lora_sampling_agrees_with_the_training_pass_as_sampling_without_lora_does(
    tmp_path: Path, arch: str
) -> None:
    """Adapters as a few hundred small optimizer steps leave them (B ~ 0.002; on a Qwen3-MoE, the fused experts'
    ParamWrapper adapters too): folded into bfloat16 weights they were rounded, and the sampler's log-probs were
    2 to 4 times as far from the training pass as the same model's without its adapters."""
    model = lora_model(tmp_path / arch, arch, dtype="bfloat16", b_scale=0.002)
    with base_of(model):  # the same weights without LoRA: the gap sampling alone leaves
        no_lora_gap = sampler_gap(model, folded=False)
    lora_gap = sampler_gap(model, folded=True)
    assert 0 < lora_gap <= 1.5 * no_lora_gap, (lora_gap, no_lora_gap)


@pytest.mark.parametrize(("dtype", "folds"), [("float32", True), ("bfloat16", False)])
def test_float32_layers_fold_and_bf16_ones_keep_their_adapters(tmp_path: Path, dtype: str, folds: bool) -> None:
    from peft.tuners.lora import LoraLayer

    model = lora_model(tmp_path / "llama", "llama", dtype=dtype)
    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    with folded_adapters(model):
        assert all(layer.merged == folds for layer in layers)
    assert not any(layer.merged for layer in layers)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_bf16_lora_rollouts_sample_folded_and_keep_the_training_pass_log_probs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """A rollout's sampling (engine.core.learner.Learner.sample) runs folded, at the full model's speed, even in
    bfloat16; the log-probs it hands PPO are the training pass's, within 1.5x the no-LoRA sampler's gap."""
    from peft.tuners.lora import LoraLayer

    model = lora_model(tmp_path / arch, arch, dtype="bfloat16", b_scale=0.002)
    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    merged_while_sampling = []

    def watched(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        merged_while_sampling.append(all(layer.merged for layer in layers))
        return sample(*args, **kwargs)

    monkeypatch.setattr(engine.core.learner, "sample", watched)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (16, 8), generator=generator)  # (B, P)
    mask = (torch.arange(8) >= torch.randint(0, 7, (16, 1), generator=generator)).long()  # left padding
    learner = Learner(model, Ranks(), Sampling(response_length=32, temperature=1.0), chunk_size=8)
    tokens, logprobs = learner.sample(ids * mask, mask, generator)
    sequence, full_mask = torch.cat([ids * mask, tokens], dim=1), torch.cat([mask, torch.ones_like(tokens)], dim=1)
    with torch.inference_mode():
        trained, _ = token_logprobs(model, sequence, full_mask, 8)
    with base_of(model):
        no_lora_gap = sampler_gap(model, folded=False)
    assert merged_while_sampling == [True] and not any(layer.merged for layer in layers)
    assert (logprobs - trained).abs().mean().item() <= 1.5 * no_lora_gap
