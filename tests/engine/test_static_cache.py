"""Sampling through a :class:`engine.core.generate.Decoder`: static KV caches, one per padded shape, reused across
rollouts, and decoding steps compiled a bounded number of times. It samples the tokens the growing cache samples,
with the same log-probabilities up to rounding, on the models users bring; a job's models die with the job.

On the CPU the compiled path runs through a recording backend (dynamo traces, guards and recompiles exactly as it
does for inductor; the graph then runs as traced), so the recompile bound and the cache reuse are tested here; the
CUDA test checks the graphs themselves."""

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from engine.builtin import digits
from engine.callbacks import Callbacks
from engine.core import generate
from engine.core.data import encode_prompts
from engine.core.generate import BUCKET_LEVELS, Decoder, bucket, sample
from engine.core.models import load_causal_lm, load_tokenizer, token_logprobs
from engine.run import run_job
from engine.spec.config import JobSpec
from tests.models import build_model

PROMPTS = ["we watched the film and it was", "the food", "i think this one is"]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Each test starts with no compiled code (as each job does: :func:`engine.core.generate.release_compiled`), so no
    earlier test's compiles count against dynamo's recompile limit."""
    torch.compiler.reset()


def loaded(arch: str, folder: Path) -> tuple[PreTrainedModel, torch.Tensor, torch.Tensor, int]:
    """The model, left-padded prompts of uneven lengths (B, P) and their mask, and its EOS id."""
    ref = "builtin:tiny" if arch == "builtin" else str(build_model(arch, folder))
    tokenizer = load_tokenizer(ref)
    queries, mask = encode_prompts(tokenizer, PROMPTS, 16)
    return load_causal_lm(ref, tokenizer, seed=0).eval(), queries, mask, tokenizer.eos_token_id


class Recording:
    """A ``torch.compile`` backend that keeps each graph dynamo hands it and runs it as traced."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs.append(gm)
        return gm.forward


def test_bucket_pads_to_one_of_a_few_sizes() -> None:
    assert [bucket(n, 40, smallest=16) for n in (1, 16, 17, 20, 21, 40)] == [16, 16, 20, 20, 40, 40]
    assert [bucket(n, 12) for n in range(1, 13)] == [2, 2, 3, 6, 6, 6, 12, 12, 12, 12, 12, 12]
    assert bucket(13, 12) == 16  # beyond the top: the next power of two
    assert bucket(3, 15, smallest=16) == 15  # never beyond the top
    assert all(len({bucket(n, top) for n in range(1, top + 1)}) <= BUCKET_LEVELS for top in range(1, 300))


@pytest.mark.parametrize("arch", ["builtin", "llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize(("temperature", "top_k", "group_size"), [(1.0, 0, 1), (0.7, 5, 3), (0.0, 0, 2)])
def test_a_decoder_samples_what_the_growing_cache_samples(
    tmp_path: Path, arch: str, temperature: float, top_k: int, group_size: int
) -> None:
    """Prompts padded from 8 to 16 positions, 3, 6 or 9 rows padded to 4, 8 or 16: the same tokens, and again
    from the same (reset) caches."""
    model, queries, mask, _ = loaded(arch, tmp_path)
    decoder = Decoder(model, max_prompt_length=40, max_rows=16)
    runs, addresses = [], []
    for d in (None, decoder, decoder):
        runs.append(sample(model, queries, mask, 12, temperature, top_k=top_k, group_size=group_size,
                           generator=torch.Generator().manual_seed(7), decoder=d))  # fmt: skip
        layers: list[Any] = [layer for cache in decoder._caches.values() for layer in cache.layers]
        addresses.append([layer.keys.data_ptr() for layer in layers])
    (tokens, logprobs), *static = runs
    assert tokens.shape == (len(PROMPTS) * group_size, 12)
    for static_tokens, static_logprobs in static:
        assert torch.equal(static_tokens, tokens)
        torch.testing.assert_close(static_logprobs, logprobs, rtol=0, atol=1e-5)
    assert decoder.stats.path == "static" and decoder.stats.eager_steps == 2 * 11
    assert len(decoder._caches) == 2  # the padded decoding shape's, and the prompts' (copied into it): reused
    assert addresses[2] == addresses[1]  # the same tensors: a CUDA graph recorded on them replays


@pytest.mark.parametrize("check_every", [1, 8])
def test_sampling_stops_when_every_row_has_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check_every: int
) -> None:
    """The same early stop, looked at every step or every 8 (no host sync in between): a forced EOS (the most
    likely token at temperature 0 made the EOS) ends each row, the output cut back to the last row's stop."""
    monkeypatch.setattr(generate, "EOS_CHECK_EVERY", check_every)
    model, queries, mask, _ = loaded("llama", tmp_path)
    first = sample(model, queries, mask, 1, 0.0)[0][:, 0]
    eos = int(first[0])  # what greedy decoding gives the first prompt first: as its "EOS", the row ends at once
    for decoder in (None, Decoder(model, 16, 4)):
        tokens, _ = sample(model, queries, mask, 20, 0.0, eos_token_id=eos, decoder=decoder)
        rows_ended = [(row == eos).nonzero()[:1].flatten().tolist() for row in tokens]
        assert rows_ended[0] == [0]
        assert tokens.shape[1] == max(ended[0] + 1 if ended else 20 for ended in rows_ended)


def test_compiles_are_bounded_whatever_the_prompt_lengths_and_batch_sizes(tmp_path: Path) -> None:
    """Every prompt length from 1 to the maximum and every batch size up to the job's: a handful of compiles (one
    per bucket, never dynamo's silent eager fallback at its ninth), and none again when a shape comes back."""
    model, _, _, _ = loaded("llama", tmp_path)
    backend = Recording()
    decoder = Decoder(model, max_prompt_length=40, max_rows=8, compile={"backend": backend})
    shapes = [(5, length) for length in range(1, 41)] + [(rows, 7) for rows in range(1, 9)]
    for rows, length in shapes:
        ids = torch.randint(3, 500, (rows, length), generator=torch.Generator().manual_seed(rows * 100 + length))
        sample(model, ids, torch.ones_like(ids), 3, 1.0, generator=torch.Generator().manual_seed(0), decoder=decoder)
    stats = decoder.stats
    assert stats.fallback is None and stats.eager_steps == 0 and stats.compiled_steps == 2 * len(shapes)
    padded = {(bucket(rows, 8), bucket(length, 40, smallest=16) + 3) for rows, length in shapes}
    assert set(stats.compiles) == {f"{rows}x{positions}" for rows, positions in padded}
    assert all(n == 1 for n in stats.compiles.values()) and len(backend.graphs) == len(padded) <= BUCKET_LEVELS**2
    assert decoder.compiled_fraction() == 1.0


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_window_models_compile_once_per_shape(tmp_path: Path, arch: str) -> None:
    """Mistral's and Gemma 2's sliding-window layers (a window of 4,096 positions, more than the cache holds) decode
    as plain static layers: one compile for the shape, not one at every token, and the growing cache's tokens."""
    model, queries, mask, _ = loaded(arch, tmp_path)
    decoder = Decoder(model, max_prompt_length=16, max_rows=4, compile={"backend": Recording()})
    plain = sample(model, queries, mask, 10, 1.0, generator=torch.Generator().manual_seed(0))
    compiled = sample(model, queries, mask, 10, 1.0, generator=torch.Generator().manual_seed(0), decoder=decoder)
    assert torch.equal(compiled[0], plain[0])
    torch.testing.assert_close(compiled[1], plain[1], rtol=0, atol=1e-5)
    assert decoder.stats.compiles == {"4x26": 1} and decoder.stats.eager_steps == 0


def test_a_recompile_limit_reached_anyway_is_a_fallback_not_a_silent_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo's limit at 2 compiles: the third shape ends the compiled steps with a warning naming the limit, where
    dynamo itself would run eagerly and say nothing."""
    monkeypatch.setitem(generate._LIMITS, "recompile_limit", 2)
    model, _, _, _ = loaded("llama", tmp_path)
    warnings: list[str] = []
    decoder = Decoder(model, max_prompt_length=64, max_rows=1, compile={"backend": Recording()}, warn=warnings.append)
    for length in (10, 20, 40):  # prompt buckets 16, 32, 64
        ids = torch.randint(3, 500, (1, length), generator=torch.Generator().manual_seed(length))
        sample(model, ids, torch.ones_like(ids), 3, 1.0, generator=torch.Generator().manual_seed(0), decoder=decoder)
    assert decoder.stats.compiled_steps == 2 * 2 and decoder.stats.eager_steps == 2
    assert len(warnings) == 1 and "recompile" in warnings[0].lower()


def test_a_step_that_cannot_be_compiled_falls_back_to_eager_decoding_once(tmp_path: Path) -> None:
    model, queries, mask, _ = loaded("llama", tmp_path)

    def cannot_compile(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        raise RuntimeError("no compiler for this device")

    warnings: list[str] = []
    decoder = Decoder(model, 16, 4, compile={"backend": cannot_compile}, warn=warnings.append)
    eager = sample(
        model, queries, mask, 8, 1.0, generator=torch.Generator().manual_seed(2), decoder=Decoder(model, 16, 4)
    )
    for _ in range(2):
        fallen_back = sample(model, queries, mask, 8, 1.0, generator=torch.Generator().manual_seed(2), decoder=decoder)
        assert torch.equal(fallen_back[0], eager[0]) and torch.equal(fallen_back[1], eager[1])
    assert len(warnings) == 1 and "no compiler for this device" in warnings[0]
    assert decoder.stats.fallback is not None and "no compiler for this device" in decoder.stats.fallback
    assert decoder.stats.compiled_steps == 0 and decoder.stats.eager_steps == 2 * 7
    assert decoder.compiled_fraction() == 0.0


@pytest.mark.parametrize(("job_type", "compiles"), [("ppo", True), ("grpo", False)])
def test_a_finished_job_leaves_no_compiled_decoder_holding_its_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, job_type: str, compiles: bool
) -> None:
    """A PPO job whose rollouts decode compiled (a recording backend standing in for CUDA's), and a GRPO job whose
    backend cannot compile: the share of steps run compiled is a metric, a fallback is a warning event of the job,
    the decoder's record is logged, and once the job is over nothing keeps its policy."""
    backend = Recording()

    def failing(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        raise RuntimeError("no compiler for this device")

    monkeypatch.setattr(generate, "compile_options", lambda device: {"backend": backend if compiles else failing})
    decoders: list[weakref.ref[Decoder]] = []
    policies: list[weakref.ref[torch.nn.Module]] = []
    created = generate.Decoder

    class Watched(created):  # type: ignore[misc, valid-type]
        def __init__(self, model: PreTrainedModel, *args: Any, **kwargs: Any) -> None:
            super().__init__(model, *args, **kwargs)
            decoders.append(weakref.ref(self))
            policies.append(weakref.ref(model))

    monkeypatch.setattr(generate, "Decoder", Watched)
    metrics: list[dict[str, float]] = []
    events: list[tuple[str, str, dict[str, Any] | None]] = []

    class Recorded(Callbacks):
        def on_metrics(self, step: int, values: dict[str, float]) -> None:
            metrics.append(values)

        def on_event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
            events.append((kind, message, data))

    group = {"group_size": 2} if job_type == "grpo" else {}
    spec = JobSpec.model_validate({
        "type": job_type, "model": "builtin:tiny", "dataset": "builtin:digits-prompts", "reward": digits.GRADER,
        "hyperparameters": {"total_steps": 2, "batch_size": 4, "mini_batch_size": 4, "response_length": 6,
                            "stop_token": None, **group},
    })  # fmt: skip
    with caplog.at_level("INFO", logger="engine.core.generate"):
        result = run_job(spec, tmp_path / "job", Recorded(), torch.device("cpu"))
    gc.collect()
    assert result.status == "succeeded"
    assert [m["rollout/compiled_fraction"] for m in metrics] == [1.0 if compiles else 0.0] * 2
    fallbacks = [e for e in events if e[2] == {"reason": "decode_fallback"}]
    assert bool(backend.graphs) == compiles and len(fallbacks) == (0 if compiles else 1)
    assert compiles or (fallbacks[0][0] == "warning" and "no compiler for this device" in fallbacks[0][1])
    assert decoders and all(ref() is None for ref in decoders)
    assert policies and all(ref() is None for ref in policies)
    records = [r for r in caplog.records if hasattr(r, "decode_stats")]
    assert len(records) == 1 and records[0].decode_stats["compiled_steps" if compiles else "eager_steps"] == 2 * 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are recorded on a GPU only")
def test_compiled_decoding_on_cuda_runs_cuda_graphs_recorded_once_per_shape(tmp_path: Path) -> None:
    """bf16, a cache of 15 + 12 = 27 positions (no multiple of 8): every step compiled, no graph skipped, one
    recording per shape over three rollouts, replayed to the same numbers, the training pass's log-probs."""
    model, queries, mask, _ = loaded("llama", tmp_path)
    torch.nn.Module.to(model, device="cuda", dtype=torch.bfloat16)  # in place
    queries, mask = queries.cuda(), mask.cuda()
    decoder = generate.job_decoder(model, True, max_prompt_length=15, max_rows=3, device=torch.device("cuda"))
    assert decoder is not None
    runs = [  # temperature 1: the sampler's log-probs are the forward's (greedy ones would be the one-hot's zeros)
        sample(model, queries, mask, 12, 1.0, generator=torch.Generator("cuda").manual_seed(0), decoder=decoder)
        for _ in range(3)
    ]
    for tokens, logprobs in runs:  # replays of the same graphs: the same numbers
        assert torch.equal(tokens, runs[0][0]) and torch.equal(logprobs, runs[0][1])
    qr = torch.cat([queries, runs[0][0]], dim=1)
    forward, _ = token_logprobs(
        model, qr, torch.ones_like(qr) * torch.cat([mask, torch.ones_like(runs[0][0])], 1), queries.shape[1]
    )
    torch.testing.assert_close(runs[0][1], forward.float(), rtol=0, atol=5e-2)  # bf16: the training pass's numbers
    stats = decoder.stats
    assert stats.path == "compiled" and stats.fallback is None
    assert stats.eager_steps == 0 and stats.compiled_steps == 3 * 11 and stats.cudagraph_skips == 0
    assert stats.compiles == {"3x27": 1} and stats.recordings == {"3x27": 1}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory is measured on a GPU only")
def test_jobs_on_cuda_give_their_memory_back(tmp_path: Path) -> None:
    """Two GRPO jobs decoding through CUDA graphs, one after the other in one process: the second ends with the
    memory allocated where the first left it (cuBLAS' workspaces and nothing else: no policy, cache or graph pool)."""
    spec = JobSpec.model_validate({
        "type": "grpo", "model": "builtin:tiny", "dataset": "builtin:digits-prompts", "reward": digits.GRADER,
        "hyperparameters": {"total_steps": 2, "batch_size": 4, "group_size": 2, "mini_batch_size": 4,
                            "response_length": 6, "stop_token": None, "dtype": "bfloat16"},
    })  # fmt: skip
    allocated = []
    for i in range(2):
        assert run_job(spec, tmp_path / f"job-{i}", Callbacks(), torch.device("cuda")).status == "succeeded"
        gc.collect()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[1] == allocated[0]
