"""Log-probabilities over the vocabulary in chunks (``engine.core.ops.chunked_logprobs``, used by
``engine.core.models.token_logprobs`` for every SFT, DPO, PPO and GRPO forward): the numbers and gradients of the whole
(B, T, V) logits, without holding them, on the models users bring, with LoRA and under DistributedDataParallel;
architectures that scale their logits are read through their own forward."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Gemma2Config, Gemma2ForCausalLM, PreTrainedModel

from engine.core import models
from engine.core.learner import completion_loss_sum
from engine.core.models import (
    SCALED_LOGITS,
    apply_lora,
    lm_logits,
    load_causal_lm,
    load_tokenizer,
    output_layer,
    token_logprobs,
)
from engine.core.ops import chunked_logprobs, entropy_from_logits, logprobs_from_logits
from engine.methods.dpo_train import completion_logps
from engine.spec.config import LoraSpec
from tests.helpers import free_port
from tests.models import build_model


def whole(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logprobs_from_logits(logits, tokens), entropy_from_logits(logits)


@pytest.mark.parametrize("chunk", [1, 5, 12, 24, 100])
def test_chunks_give_the_whole_logits_numbers_and_gradients(chunk: int) -> None:
    torch.manual_seed(0)
    B, T, H, V = 3, 8, 16, 50
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(B, T, H, requires_grad=True)
    tokens = torch.randint(0, V, (B, T))
    w_lp, w_ent = torch.randn(B, T), torch.randn(B, T)  # a loss that weighs every position differently

    rows_seen: list[int] = []

    def recording_head(h: torch.Tensor) -> torch.Tensor:
        rows_seen.append(h.shape[0])
        return head(h) / 0.7

    logprobs, entropy = chunked_logprobs(recording_head, hidden, tokens, chunk, entropy=True, entropy_grad=True)
    assert entropy is not None
    ((logprobs * w_lp).sum() + (entropy * w_ent).sum()).backward()
    chunked_grads = hidden.grad.clone(), head.weight.grad.clone()  # type: ignore[union-attr]
    assert max(rows_seen) == min(chunk, B * T)  # never more positions' logits than a chunk
    if chunk < B * T:
        assert sum(rows_seen) == 2 * B * T  # each chunk's logits made again in the backward pass

    hidden.grad, head.weight.grad = None, None
    ref_logprobs, ref_entropy = whole(head(hidden) / 0.7, tokens)
    ((ref_logprobs * w_lp).sum() + (ref_entropy * w_ent).sum()).backward()
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked_grads[0], hidden.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked_grads[1], head.weight.grad, rtol=0, atol=1e-6)


def test_the_entropy_takes_part_in_the_backward_only_when_asked() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 20, bias=False)
    hidden, tokens = torch.randn(2, 6, 8, requires_grad=True), torch.randint(0, 20, (2, 6))
    logprobs, entropy = chunked_logprobs(head, hidden, tokens, chunk=4, entropy=True)
    assert entropy is not None and not entropy.requires_grad and logprobs.requires_grad
    with torch.no_grad():
        _, plain = chunked_logprobs(head, hidden, tokens, chunk=100, entropy=True)
    torch.testing.assert_close(entropy, plain, rtol=0, atol=1e-6)
    assert chunked_logprobs(head, hidden, tokens, chunk=4)[1] is None


def reference_logprobs(
    model: torch.nn.Module, qr: torch.Tensor, am: torch.Tensor, P: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of the response tokens from the model's whole logits, as before chunking."""
    T = qr.shape[1] - P
    logits = lm_logits(model, qr, am, last=T + 1)[:, :-1] / temperature
    return whole(logits, qr[:, P:])


def sequences(vocab: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Three left-padded prompts of 4 tokens with 6-token responses, the last cut short by padding."""
    generator = torch.Generator().manual_seed(5)
    qr = torch.randint(1, vocab, (3, 10), generator=generator)
    am = torch.ones_like(qr)
    am[1, :2] = 0
    am[2, 8:] = 0
    return qr, am, 4


def compare(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, vocab: int) -> None:
    """token_logprobs in chunks of 5 positions against the whole logits: values and every gradient."""
    monkeypatch.setattr(models, "LOGITS_CHUNK_BYTES", 4 * vocab * 5)
    qr, am, P = sequences(vocab)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(chunked: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        if chunked:
            logprobs, entropy = token_logprobs(model, qr, am, P, 0.9, entropy=True, entropy_grad=True)
            assert entropy is not None
        else:
            logprobs, entropy = reference_logprobs(model, qr, am, P, 0.9)
        (logprobs.sum() - 0.1 * entropy.sum()).backward()
        return logprobs.detach(), entropy.detach(), [p.grad.clone() for p in params]  # type: ignore[union-attr]

    chunked, plain = run(True), run(False)
    torch.testing.assert_close(chunked[0], plain[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked[1], plain[1], rtol=0, atol=1e-5)
    # Sums in another order: a few of the gradients' float32 entries differ by ~1e-6 on some CPUs (vector widths).
    for a, b in zip(chunked[2], plain[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def causal_lm(folder: Path, arch: str) -> PreTrainedModel:
    path = build_model(arch, folder)
    return load_causal_lm(str(path), load_tokenizer(str(path)), seed=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_token_logprobs_in_chunks_match_the_whole_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    model = causal_lm(tmp_path, arch)
    compare(model, monkeypatch, model.config.vocab_size)


def test_the_builtin_gpt2s_tied_head_gets_the_same_gradient_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_causal_lm("builtin:tiny", load_tokenizer("builtin:tiny"), seed=0)
    compare(model, monkeypatch, model.config.vocab_size)


def test_lora_adapters_get_the_same_gradient_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = apply_lora(causal_lm(tmp_path, "llama"), LoraSpec(r=4, alpha=8), "CAUSAL_LM", None)
    assert output_layer(model) is not None
    compare(model, monkeypatch, model.config.vocab_size)


def test_under_distributed_data_parallel_the_head_is_found_and_gradients_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(os.environ, "MASTER_ADDR", "127.0.0.1")
    monkeypatch.setitem(os.environ, "MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = causal_lm(tmp_path, "llama")
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        assert output_layer(wrapped) is model.get_output_embeddings()
        compare(wrapped, monkeypatch, model.config.vocab_size)
    finally:
        dist.destroy_process_group()


def test_an_architecture_that_caps_its_logits_is_read_through_its_own_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=2.0,
    )
    model = Gemma2ForCausalLM(config)
    assert output_layer(model) is None
    monkeypatch.setattr(models, "LOGITS_CHUNK_BYTES", 4 * 64 * 5)
    qr, am, P = sequences(64)
    logprobs, entropy = token_logprobs(model, qr, am, P, 0.9, entropy=True)
    ref_logprobs, ref_entropy = reference_logprobs(model, qr, am, P, 0.9)  # the capped logits
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=0)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=0)
    model.config.final_logit_softcapping = None  # the same weights without the cap answer otherwise
    assert not torch.allclose(reference_logprobs(model, qr, am, P, 0.9)[0], logprobs, atol=1e-3)


def test_the_sft_and_dpo_losses_in_chunks_are_those_of_the_whole_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SFT's summed completion cross-entropy and DPO's sequence log-probs, from token_logprobs in chunks of
    3 positions, against the whole logits: values and gradients."""
    model = causal_lm(tmp_path, "qwen2")
    monkeypatch.setattr(models, "LOGITS_CHUNK_BYTES", 4 * model.config.vocab_size * 3)
    qr, am, _ = sequences(model.config.vocab_size)
    labels = torch.where(am.bool(), qr, -100)
    labels[:, :4] = -100  # the prompt is not trained
    batch = {"input_ids": qr, "attention_mask": am, "labels": labels}

    def grads_of(loss: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    chunked_sft = completion_loss_sum(model, batch)
    chunked_grads = grads_of(chunked_sft)
    logits = lm_logits(model, qr, am)
    whole_sft = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    torch.testing.assert_close(chunked_sft, whole_sft, rtol=1e-5, atol=1e-5)
    for a, b in zip(chunked_grads, grads_of(whole_sft), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # ~1e-6 apart on some CPUs, as above

    with torch.no_grad():
        whole_logps = -F.cross_entropy(
            lm_logits(model, qr, am)[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none"
        ).sum(-1)
        torch.testing.assert_close(completion_logps(model, batch), whole_logps, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("field", SCALED_LOGITS)
def test_a_logit_scale_in_the_config_sends_the_model_through_its_own_forward(tmp_path: Path, field: str) -> None:
    model = causal_lm(tmp_path, "llama")
    setattr(model.config, field, 1.0)  # unset or 1: the output layer's logits are the model's
    assert output_layer(model) is model.get_output_embeddings()
    setattr(model.config, field, 0.5)
    assert output_layer(model) is None
