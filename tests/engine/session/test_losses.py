"""engine.session.losses against naive per-token loops: each datum run alone through a plain full forward, the
log-softmax read at every position for its target, each loss written out token by token from Tinker's formulas
(docs/design/tinker-protocol.md §5) and summed; values, and the gradients of a tiny model's parameters (full and
LoRA) by autograd of the naive sum. Then ragged chunks, accumulation over calls, forward-only, and every
validation error naming its datum and field."""

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from engine.core.models import apply_lora, load_causal_lm, load_tokenizer
from engine.session.errors import UserError
from engine.session.losses import LOSSES, check_config, check_datums, forward_backward, target_logprobs
from engine.spec.config import LoraSpec
from engine.spec.policy_losses import POLICY_LOSSES
from tests.models import KV_HEADS, SIZES

LENGTHS = [5, 1, 7, 3, 6, 2, 4]
PROMPT = 2
"""The first tokens of each datum are its prompt: advantage 0, as Tinker's RL datums have them."""
VOCAB = 574
"""builtin:tiny's vocabulary."""
CONTEXT = 128
"""builtin:tiny's context."""
ATOL, RTOL = 2e-5, 1e-4
"""Batched, right-padded forwards against one unpadded forward per datum: float32 rounding apart."""


@dataclass
class Datum:
    tokens: torch.Tensor
    inputs: dict[str, torch.Tensor]


def tiny() -> PreTrainedModel:
    return load_causal_lm("builtin:tiny", load_tokenizer("builtin:tiny"), seed=0)


def tiny_lora() -> PreTrainedModel:
    """builtin:tiny with adapters whose B is random too (fresh B is 0, which would leave A without a gradient)."""
    torch.manual_seed(1)
    model = apply_lora(tiny(), LoraSpec(r=4, alpha=8), "CAUSAL_LM", None)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return model


def tiny_llama() -> PreTrainedModel:
    """A random Llama of tests/models.py's sizes: rotary positions, an untied head, grouped-query attention."""
    torch.manual_seed(0)
    options: dict[str, Any] = {**SIZES, "num_key_value_heads": KV_HEADS["llama"], "vocab_size": VOCAB}
    return LlamaForCausalLM(LlamaConfig(**options))


MODELS = {"full": tiny, "lora": tiny_lora, "llama": tiny_llama}


def naive_logprobs(model: PreTrainedModel, datum: Datum) -> list[torch.Tensor]:
    """log p(target_i | tokens[: i + 1]) as 0-d tensors with their graph, one plain forward of the datum alone."""
    logits = model(input_ids=datum.tokens[None]).logits[0]  # (N, V)
    return [torch.log_softmax(logits[i].float(), -1)[datum.inputs["target_tokens"][i]] for i in range(len(logits))]


def make_datums(seed: int, lengths: list[int] = LENGTHS, model: PreTrainedModel | None = None) -> list[Datum]:
    """Random tokens, targets that are not the shifted input, weights, advantages (0 on the prompt), and
    sampler log-probs near the model's own (so that the ratios straddle every clip range), when ``model``."""
    g = torch.Generator().manual_seed(seed)
    datums = []
    for n in lengths:
        tokens = torch.randint(0, VOCAB, (n,), generator=g)
        targets = torch.randint(0, VOCAB, (n,), generator=g)
        advantages = torch.randn(n, generator=g)
        advantages[:PROMPT] = 0.0
        inputs = {"target_tokens": targets, "weights": torch.rand(n, generator=g), "advantages": advantages}
        datums.append(Datum(tokens, inputs))
    if model is not None:
        with torch.no_grad():
            for datum in datums:
                own = torch.stack(naive_logprobs(model, Datum(datum.tokens, datum.inputs)))
                datum.inputs["logprobs"] = own + 0.3 * torch.randn(len(own), generator=g)
    return datums


def clip(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return x.clamp(low, high)


TINKER_DEFAULTS = {"cispo": (0.0, 4.0)}
"""Each loss's clip thresholds where a request gives none, as Tinker documents them (its losses page): cispo's
clip(π/π_sampler, 0, 4); (0.8, 1.2), PPO's ε = 0.2, for the others."""
DRO_BETA = 0.05
"""dro's beta where a request gives none: the value of Tinker's docs' example."""


def thresholds(loss_fn: str, config: dict[str, float]) -> tuple[float, float]:
    low, high = TINKER_DEFAULTS.get(loss_fn, (0.8, 1.2))
    return config.get("clip_low_threshold", low), config.get("clip_high_threshold", high)


def naive_losses(
    loss_fn: str,
    logprobs: list[torch.Tensor],
    inputs: dict[str, torch.Tensor],
    low: float,
    high: float,
    beta: float = DRO_BETA,
) -> list[torch.Tensor]:
    """Each token's loss, token by token, as Tinker's docs write the loss (ratios π/π_sampler)."""
    n = len(logprobs)
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights", torch.ones(n))
        return [-logprobs[t] * weights[t] for t in range(n)]
    old, advantages = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "dro":  # -(log p·A - ½β(log p - log q)²)
        return [-(logprobs[t] * advantages[t] - 0.5 * beta * (logprobs[t] - old[t]) ** 2) for t in range(n)]
    ratio_mask = inputs.get("sequence_ratio_mask", advantages)
    losses = []
    kept = [t for t in range(n) if ratio_mask[t] != 0]
    sequence = torch.exp(sum((logprobs[t] - old[t] for t in kept), torch.zeros(())) / max(len(kept), 1))
    for t in range(n):
        ratio, a = torch.exp(logprobs[t] - old[t]), advantages[t]
        if loss_fn == "importance_sampling":
            losses.append(-ratio * a)
        elif loss_fn in ("ppo", "ppo_clip"):
            losses.append(-torch.minimum(ratio * a, clip(ratio, low, high) * a))
        elif loss_fn == "cispo":
            losses.append(-clip(ratio, low, high).detach() * a * logprobs[t])
        else:  # gspo: each token carries the sequence ratio's value and its own log-prob's gradient
            token = sequence.detach() * torch.exp(logprobs[t] - logprobs[t].detach())
            losses.append(-torch.minimum(token * a, clip(token, low, high) * a))
    return losses


def naive_total(
    model: PreTrainedModel, datums: list[Datum], loss_fn: str, low: float, high: float, beta: float = DRO_BETA
) -> torch.Tensor:
    """Σ over datums and tokens of the naive losses, with the graph to the model's parameters."""
    return sum(
        (
            sum(naive_losses(loss_fn, naive_logprobs(model, d), d.inputs, low, high, beta), torch.zeros(()))
            for d in datums
        ),
        torch.zeros(()),
    )


def for_loss(datums: list[Datum], loss_fn: str) -> list[Datum]:
    """The datums with the inputs ``loss_fn`` takes."""
    keep = set(LOSSES[loss_fn].required + LOSSES[loss_fn].optional)
    return [Datum(d.tokens, {k: v for k, v in d.inputs.items() if k in keep}) for d in datums]


def grads(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=ATOL, rtol=RTOL, msg=name)


def test_the_server_takes_tinker_names_and_the_registry() -> None:
    assert set(LOSSES) == {"cross_entropy", "ppo", "dro", *POLICY_LOSSES}
    assert {"cross_entropy", "ppo", "importance_sampling", "cispo", "gspo"} <= set(LOSSES)


@pytest.mark.parametrize("chunk_size", [1, 3, 16])
def test_target_logprobs_are_the_naive_ones_over_ragged_chunks(chunk_size: int) -> None:
    model = tiny()
    datums = make_datums(0)
    found = target_logprobs(model, datums, chunk_size=chunk_size)
    for datum, logprobs in zip(datums, found, strict=True):
        assert logprobs.dtype == torch.float32 and logprobs.requires_grad
        torch.testing.assert_close(logprobs, torch.stack(naive_logprobs(model, datum)), atol=ATOL, rtol=RTOL)


CASES = [
    ("full", "cross_entropy", {}),
    ("lora", "cross_entropy", {}),
    ("llama", "cross_entropy", {}),
    ("full", "importance_sampling", {}),
    ("full", "ppo", {}),
    ("full", "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("lora", "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("llama", "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("full", "ppo_clip", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("full", "cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("full", "cispo", {}),  # Tinker's default: clip(π/π_sampler, 0, 4)
    ("lora", "cispo", {}),
    ("full", "dro", {}),
    ("lora", "dro", {"beta": 0.3}),
    ("llama", "dro", {"beta": 0.0}),
    ("full", "gspo", {}),
    ("full", "gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}),
    ("lora", "gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}),
]


@pytest.mark.parametrize(("kind", "loss_fn", "config"), CASES)
def test_forward_backward_is_the_naive_sum_and_its_gradient(kind: str, loss_fn: str, config: dict[str, float]) -> None:
    model = MODELS[kind]()
    naive_model = copy.deepcopy(model)
    datums = for_loss(make_datums(1, model=model), loss_fn)
    (low, high), beta = thresholds(loss_fn, config), config.get("beta", DRO_BETA)

    outputs, metrics = forward_backward(model, datums, loss_fn, config, backward=True, chunk_size=3)
    total = naive_total(naive_model, datums, loss_fn, low, high, beta)
    total.backward()

    for datum, output in zip(datums, outputs, strict=True):
        with torch.no_grad():
            logprobs = naive_logprobs(naive_model, datum)
            expected = torch.stack(naive_losses(loss_fn, logprobs, datum.inputs, low, high, beta))
        assert output["logprobs"].dtype == output["elementwise_loss"].dtype == torch.float32
        assert not output["logprobs"].requires_grad and not output["elementwise_loss"].requires_grad
        torch.testing.assert_close(output["logprobs"], torch.stack(logprobs), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(output["elementwise_loss"], expected, atol=ATOL, rtol=RTOL)
    assert metrics["loss:sum"] == pytest.approx(float(total.detach()), abs=1e-4, rel=1e-4)
    assert_same_grads(grads(model), grads(naive_model))
    if loss_fn == "dro":
        assert set(metrics) == {"loss:sum"}  # Tinker's documented diagnostics; no ratio is taken
    elif loss_fn != "cross_entropy":
        assert metrics["ratio:mean"] > 0
        # the ratios here lie within (0.2, 3): cispo's default range (0, 4) clips none, (0.8, 1.2) clipped some
        clipping = loss_fn != "importance_sampling" and (loss_fn, config) != ("cispo", {})
        assert (0 < metrics["clipfrac:mean"] < 1) if clipping else metrics["clipfrac:mean"] == 0


def test_policy_metrics_are_over_the_response_tokens() -> None:
    model = tiny()
    datums = for_loss(make_datums(2, model=model), "ppo")
    _, metrics = forward_backward(model, datums, "ppo", {}, backward=False)
    clipped = kept = 0
    ratios = 0.0
    with torch.no_grad():
        found = target_logprobs(model, datums)
    for datum, logprobs in zip(datums, found, strict=True):
        for t in range(len(logprobs)):
            if datum.inputs["advantages"][t] != 0:
                ratio = float(torch.exp(logprobs[t] - datum.inputs["logprobs"][t]))
                a = float(datum.inputs["advantages"][t])
                clipped += (a > 0 and ratio > 1.2) or (a < 0 and ratio < 0.8)
                ratios += ratio
                kept += 1
    assert metrics["clipfrac:mean"] == pytest.approx(clipped / kept)
    assert metrics["ratio:mean"] == pytest.approx(ratios / kept, rel=1e-5)


def test_cross_entropy_weights_default_to_ones() -> None:
    model = tiny()
    datums = [Datum(d.tokens, {"target_tokens": d.inputs["target_tokens"]}) for d in make_datums(3)]
    outputs, metrics = forward_backward(model, datums, "cross_entropy", {}, backward=False)
    for output in outputs:
        torch.testing.assert_close(output["elementwise_loss"], -output["logprobs"])
    assert metrics == {"loss:sum": pytest.approx(-sum(float(o["logprobs"].sum()) for o in outputs), rel=1e-5)}


def test_per_datum_thresholds_are_the_config_s_and_win_over_it() -> None:
    model = tiny()
    datums = for_loss(make_datums(4, model=model), "ppo")
    by_config, _ = forward_backward(model, datums, "ppo", {"clip_low_threshold": 0.9}, backward=False)
    per_datum = [Datum(d.tokens, {**d.inputs, "clip_low_threshold": torch.full((len(d.tokens),), 0.9)}) for d in datums]
    by_input, _ = forward_backward(model, per_datum, "ppo", {"clip_low_threshold": 0.5}, backward=False)
    once = [Datum(d.tokens, {**d.inputs, "clip_low_threshold": torch.tensor([0.9])}) for d in datums]
    by_one_value, _ = forward_backward(model, once, "ppo", {}, backward=False)
    default, _ = forward_backward(model, datums, "ppo", {}, backward=False)
    for a, b, c in zip(by_config, by_input, by_one_value, strict=True):
        torch.testing.assert_close(a["elementwise_loss"], b["elementwise_loss"])
        torch.testing.assert_close(a["elementwise_loss"], c["elementwise_loss"])
    changed = [
        not torch.equal(a["elementwise_loss"], d["elementwise_loss"]) for a, d in zip(by_config, default, strict=True)
    ]
    assert any(changed)  # 0.9 clips where the default 0.8 does not


def test_the_sequence_ratio_mask_input_sets_the_tokens_of_the_sequence_ratio() -> None:
    model = tiny()
    datums = for_loss(make_datums(5, model=model), "gspo")
    for datum in datums:
        datum.inputs["sequence_ratio_mask"] = (torch.arange(len(datum.tokens)) % 2).float()
    naive_model = copy.deepcopy(model)
    outputs, _ = forward_backward(model, datums, "gspo", {"clip_high_threshold": 1.02}, backward=True)
    naive_total(naive_model, datums, "gspo", 0.8, 1.02).backward()
    for datum, output in zip(datums, outputs, strict=True):
        with torch.no_grad():
            logprobs = naive_logprobs(naive_model, datum)
            expected = torch.stack(naive_losses("gspo", logprobs, datum.inputs, 0.8, 1.02))
        torch.testing.assert_close(output["elementwise_loss"], expected, atol=ATOL, rtol=RTOL)
    assert_same_grads(grads(model), grads(naive_model))


def test_gradients_accumulate_over_calls_as_one_call_of_all_datums() -> None:
    model = tiny()
    datums = for_loss(make_datums(6, model=model), "ppo")
    together = copy.deepcopy(model)
    _, first = forward_backward(model, datums[:3], "ppo", {}, backward=True, chunk_size=2)
    _, second = forward_backward(model, datums[3:], "ppo", {}, backward=True, chunk_size=2)
    _, both = forward_backward(together, datums, "ppo", {}, backward=True, chunk_size=2)
    assert first["loss:sum"] + second["loss:sum"] == pytest.approx(both["loss:sum"], abs=1e-5)
    assert_same_grads(grads(model), grads(together))


def test_forward_only_builds_no_graph_and_leaves_grad_none() -> None:
    model = tiny()
    datums = for_loss(make_datums(7, model=model), "cispo")
    outputs, metrics = forward_backward(model, datums, "cispo", {}, backward=False)
    assert all(p.grad is None for p in model.parameters())
    with_backward, metrics_backward = forward_backward(copy.deepcopy(model), datums, "cispo", {}, backward=True)
    for a, b in zip(outputs, with_backward, strict=True):
        torch.testing.assert_close(a["elementwise_loss"], b["elementwise_loss"])
    assert metrics == pytest.approx(metrics_backward)


Change = Callable[[Datum], None]


def _set(name: str, value: Callable[[int], torch.Tensor]) -> Change:
    def change(datum: Datum) -> None:
        datum.inputs[name] = value(len(datum.tokens))

    return change


def _tokens(value: Callable[[int], torch.Tensor]) -> Change:
    def change(datum: Datum) -> None:
        datum.tokens = value(len(datum.tokens))

    return change


def _drop(name: str) -> Change:
    def change(datum: Datum) -> None:
        del datum.inputs[name]

    return change


def _nan_at_1(n: int) -> torch.Tensor:
    advantages = torch.ones(n)
    advantages[1] = float("nan")
    return advantages


BAD_DATUMS = [
    ("ppo", _tokens(lambda n: torch.zeros(0, dtype=torch.long)), "model_input", ["empty"]),
    ("ppo", _tokens(lambda n: torch.zeros(1, n, dtype=torch.long)), "model_input", ["shape (1, 5)"]),
    ("ppo", _tokens(lambda n: torch.full((n,), VOCAB)), "model_input", [f"token id {VOCAB}", f"[0, {VOCAB})"]),
    ("ppo", _tokens(lambda n: torch.zeros(CONTEXT + 1, dtype=torch.long)), "model_input", ["129 tokens", "128"]),
    ("ppo", _set("target_tokens", lambda n: torch.full((n,), -1)), "loss_fn_inputs.target_tokens", ["token id -1"]),
    ("ppo", _set("target_tokens", lambda n: torch.zeros(n)), "loss_fn_inputs.target_tokens", ["float32", "integer"]),
    ("ppo", _drop("advantages"), "loss_fn_inputs.advantages", ["missing", "'ppo'"]),
    ("ppo", _drop("logprobs"), "loss_fn_inputs.logprobs", ["missing"]),
    ("cross_entropy", _drop("target_tokens"), "loss_fn_inputs.target_tokens", ["missing", "'cross_entropy'"]),
    ("cross_entropy", _set("weights", lambda n: torch.ones(n + 1)), "loss_fn_inputs.weights", ["shape (6,)", "5"]),
    ("cross_entropy", _set("weights", lambda n: torch.ones(n, 1)), "loss_fn_inputs.weights", ["shape (5, 1)"]),
    ("ppo", _set("advantages", _nan_at_1), "loss_fn_inputs.advantages", ["non-finite", "position 1"]),
    ("ppo", _set("mask", lambda n: torch.ones(n)), "loss_fn_inputs.mask", ["not an input of loss 'ppo'"]),
    ("cross_entropy", _set("advantages", torch.ones), "loss_fn_inputs.advantages", ["not an input"]),
    ("ppo", _set("clip_low_threshold", lambda n: torch.arange(n) / n), "loss_fn_inputs.clip_low_threshold", ["differ"]),
    (
        "ppo",
        _set("clip_high_threshold", lambda n: torch.full((n,), 0.9)),
        "loss_fn_inputs.clip_high_threshold",
        ["0.9"],
    ),
    ("ppo", _set("clip_low_threshold", lambda n: torch.full((2,), 0.8)), "loss_fn_inputs.clip_low_threshold", ["(2,)"]),
]


@pytest.mark.parametrize(("loss_fn", "change", "field", "words"), BAD_DATUMS)
def test_a_bad_datum_is_named_with_its_field(loss_fn: str, change: Change, field: str, words: list[str]) -> None:
    datums = make_datums(8, lengths=[3, 5, 4])
    for datum in datums:
        datum.inputs["logprobs"] = torch.full((len(datum.tokens),), -1.0)
    datums = for_loss(datums, loss_fn)
    check_datums(datums, loss_fn, VOCAB, CONTEXT)  # the datums as made are good
    change(datums[1])
    with pytest.raises(UserError) as error:
        check_datums(datums, loss_fn, VOCAB, CONTEXT)
    message = str(error.value)
    assert message.startswith(f"data[1].{field}: "), message
    assert all(word in message for word in words), message
    model = tiny()
    with pytest.raises(UserError, match=r"^data\[1\]\."):
        forward_backward(model, datums, loss_fn, {}, backward=True)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("loss_fn", ["stable_reinforce", "custom", "PPO"])
def test_an_unknown_loss_is_named_and_the_supported_listed(loss_fn: str) -> None:
    for check in (lambda: check_datums([], loss_fn, VOCAB, CONTEXT), lambda: check_config(loss_fn, {})):
        with pytest.raises(UserError) as error:
            check()
        assert f"{loss_fn!r}" in str(error.value)
        assert all(name in str(error.value) for name in ("cross_entropy", "ppo", "dro", *POLICY_LOSSES))
        if loss_fn == "stable_reinforce":  # why, and what to train with instead
            assert "unpublished" in str(error.value) and "loss_fn=ppo" in str(error.value), str(error.value)


def test_cispo_without_a_config_weights_by_the_ratio_up_to_4_as_tinker_documents() -> None:
    """Tinker's cispo default is clip(π/π_sampler, 0.0, 4.0): ratios 0.5, 2 and 6 weigh 0.5, 2 and 4 (clipped at
    [0.8, 1.2] they weighed 0.8, 1.2, 1.2); only the ratio above 4 counts as clipped."""
    model = tiny()
    datum = for_loss(make_datums(10, lengths=[5]), "cispo")[0]
    with torch.no_grad():
        own = torch.stack(naive_logprobs(model, datum))  # (5,)
    ratios = torch.tensor([1.0, 1.0, 0.5, 2.0, 6.0])
    datum.inputs["logprobs"] = own - ratios.log()
    datum.inputs["advantages"] = torch.tensor([0.0, 0.0, 1.0, -1.0, 1.0])
    outputs, metrics = forward_backward(model, [datum], "cispo", {}, backward=False)
    weights = torch.tensor([1.0, 1.0, 0.5, 2.0, 4.0])
    expected = -weights * datum.inputs["advantages"] * outputs[0]["logprobs"]
    torch.testing.assert_close(outputs[0]["elementwise_loss"], expected, atol=ATOL, rtol=RTOL)
    assert metrics["clipfrac:mean"] == pytest.approx(1 / 3)  # of the 3 response tokens, the ratio 6


def test_huge_log_ratios_give_finite_losses_and_gradients() -> None:
    """Sampler log-probs 100 below or above the model's own (ratios e^±100, past float32): every ratio loss's sum
    and gradients stay finite, as does ratio:mean (the log-ratio clamped to ±20 as verl clamps it)."""
    for loss_fn in ("importance_sampling", "ppo", "cispo", "gspo"):
        model = tiny()
        datums = for_loss(make_datums(11, model=model), loss_fn)
        for i, datum in enumerate(datums):
            datum.inputs["logprobs"] = datum.inputs["logprobs"] + (100.0 if i % 2 else -100.0)
        _, metrics = forward_backward(model, datums, loss_fn, {}, backward=True)
        assert all(math.isfinite(value) for value in metrics.values()), (loss_fn, metrics)
        assert all(bool(g.isfinite().all()) for g in grads(model).values()), loss_fn


@pytest.mark.parametrize(
    ("loss_fn", "config", "words"),
    [
        ("cross_entropy", {"clip_low_threshold": 0.8}, ["loss_fn_config.clip_low_threshold", "no settings"]),
        ("ppo", {"kl_coeff": 0.1}, ["loss_fn_config.kl_coeff", "'ppo'", "clip_high_threshold"]),
        ("ppo", {"clip_low_threshold": "low"}, ["loss_fn_config.clip_low_threshold", "not a number"]),
        ("ppo", {"clip_low_threshold": 1.2}, ["loss_fn_config.clip_low_threshold", "[0, 1]"]),
        ("ppo", {"clip_high_threshold": 0.8}, ["loss_fn_config.clip_high_threshold", "1 or more"]),
        ("ppo", {"clip_high_threshold": float("inf")}, ["loss_fn_config.clip_high_threshold"]),
        ("dro", {"beta": -0.1}, ["loss_fn_config.beta", "0 or more"]),
        ("dro", {"clip_low_threshold": 0.8}, ["loss_fn_config.clip_low_threshold", "'dro'", "beta"]),
    ],
)
def test_a_bad_config_is_named_by_its_key(loss_fn: str, config: dict[str, float | str], words: list[str]) -> None:
    with pytest.raises(UserError) as error:
        check_config(loss_fn, config)
    assert all(word in str(error.value) for word in words), str(error.value)
    datums = for_loss(make_datums(9, lengths=[3], model=tiny()), loss_fn)
    with pytest.raises(UserError, match="loss_fn_config"):
        forward_backward(tiny(), datums, loss_fn, config, backward=False)
