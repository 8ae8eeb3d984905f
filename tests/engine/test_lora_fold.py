"""Folded LoRA rollouts (``engine.models.folded_adapters``): sampling with the adapters added into the base
weights gives the adapter path's tokens and log-probabilities, and the base weights come back bit-identical
however many times they are folded, so training with folded rollouts ends where training with unfused ones does."""

import copy
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine.config import LoraSpec
from engine.generate import sample
from engine.models import apply_lora, folded_adapters, load_causal_lm, load_tokenizer
from tests.models import build_model


def lora_model(folder: Path, arch: str) -> PreTrainedModel:
    """A tiny random ``arch`` model with LoRA r=4 on every linear layer, its B matrices random (fresh ones are
    zero, and would fold as nothing)."""
    path = build_model(arch, folder)
    model = apply_lora(load_causal_lm(str(path), load_tokenizer(str(path)), seed=0), LoraSpec(r=4, alpha=8),
                       "CAUSAL_LM", None)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
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
