"""Sampling with a static KV cache (``engine.generate.sample(static_cache=True)``): every decoding step has the
same shapes, which is what lets the step be captured as a CUDA graph; it samples the tokens the growing cache
samples, with the same log-probabilities up to rounding, on the models users bring."""

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine import generate
from engine.data import encode_prompts
from engine.generate import sample
from engine.models import load_causal_lm, load_tokenizer
from tests.models import build_model

PROMPTS = ["we watched the film and it was", "the food", "i think this one is"]


def loaded(arch: str, folder: Path) -> tuple[PreTrainedModel, torch.Tensor, torch.Tensor, int]:
    """The model, left-padded prompts of uneven lengths (B, P) and their mask, and its EOS id."""
    ref = "builtin:tiny" if arch == "builtin" else str(build_model(arch, folder))
    tokenizer = load_tokenizer(ref)
    queries, mask = encode_prompts(tokenizer, PROMPTS, 16)
    return load_causal_lm(ref, tokenizer, seed=0).eval(), queries, mask, tokenizer.eos_token_id


@pytest.mark.parametrize("arch", ["builtin", "llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize(("temperature", "top_k", "group_size"), [(1.0, 0, 1), (0.7, 5, 3), (0.0, 0, 2)])
def test_static_cache_samples_what_the_growing_cache_samples(
    tmp_path: Path, arch: str, temperature: float, top_k: int, group_size: int
) -> None:
    model, queries, mask, _ = loaded(arch, tmp_path)
    runs = [
        sample(model, queries, mask, 12, temperature, top_k=top_k, group_size=group_size,
               generator=torch.Generator().manual_seed(7), static_cache=static)
        for static in (False, True)
    ]  # fmt: skip
    (tokens, logprobs), (static_tokens, static_logprobs) = runs
    assert tokens.shape == (len(PROMPTS) * group_size, 12)
    assert torch.equal(static_tokens, tokens)
    torch.testing.assert_close(static_logprobs, logprobs, rtol=0, atol=1e-5)


def test_static_cache_stops_when_every_row_has_ended(tmp_path: Path) -> None:
    """The same early stop: a forced EOS (the most likely token at temperature 0 made the EOS) ends each row."""
    model, queries, mask, _ = loaded("llama", tmp_path)
    with torch.no_grad():
        first = sample(model, queries, mask, 1, 0.0)[0][:, 0]
    eos = int(first[0])  # what greedy decoding gives the first prompt first: as its "EOS", the row ends at once
    for static in (False, True):
        tokens, _ = sample(model, queries, mask, 10, 0.0, eos_token_id=eos, static_cache=static)
        rows_ended = [(row == eos).nonzero()[:1].flatten().tolist() for row in tokens]
        assert rows_ended[0] == [0]
        assert tokens.shape[1] == max(ended[0] + 1 if ended else 10 for ended in rows_ended)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a GPU only")
def test_compiled_static_decoding_on_cuda_samples_the_same_tokens(tmp_path: Path) -> None:
    model, queries, mask, _ = loaded("llama", tmp_path)
    model, queries, mask = model.cuda(), queries.cuda(), mask.cuda()
    plain = sample(model, queries, mask, 16, 0.0)
    for _ in range(3):  # captured once, replayed after
        graphed = sample(model, queries, mask, 16, 0.0, static_cache=True, compiled=True)
        assert torch.equal(graphed[0], plain[0])
        torch.testing.assert_close(graphed[1], plain[1], rtol=0, atol=1e-4)


def test_a_step_that_cannot_be_compiled_falls_back_to_eager_decoding(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, queries, mask, _ = loaded("llama", tmp_path)

    def cannot_compile(**kwargs: object) -> object:
        raise RuntimeError("no compiler for this device")

    generate._COMPILED[model] = cannot_compile  # what compiled_decoder hands out for this model
    eager = sample(model, queries, mask, 8, 1.0, generator=torch.Generator().manual_seed(2), static_cache=True)
    with caplog.at_level("WARNING", logger="engine.generate"):
        fallen_back = sample(model, queries, mask, 8, 1.0, generator=torch.Generator().manual_seed(2),
                             static_cache=True, compiled=True)  # fmt: skip
    assert torch.equal(fallen_back[0], eager[0]) and torch.equal(fallen_back[1], eager[1])
    assert "could not be compiled" in caplog.text
    assert generate.compiled_decoder(model) is model  # not tried again
