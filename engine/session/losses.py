"""Tinker's losses on unpadded datums: a datum is one sequence, ``tokens`` (N,) the model's input and ``inputs``
its per-position tensors (N,), where position i of the input predicts ``target_tokens[i]`` (any ids, not
necessarily the shifted input). Every loss is a SUM over tokens and datums, never a mean, so that several
``forward_backward`` calls accumulate into the gradient of one sum until the optimizer step
(docs/design/tinker-protocol.md §2.4, §5).

``cross_entropy`` is Σ -logp(target)·weight (the SDK's ``forward_backward_custom`` relies on that form, §4); the
policy losses are the registry's (engine/spec/policy_losses.py) under Tinker's names, each datum a batch of one
row, the sampler's ``logprobs`` the old log-probs; ``dro`` is Tinker's, here beside its formula. The clip
thresholds are Tinker's ratios (the registry's settings are the distances from 1), from ``loss_fn_config`` or
per-datum inputs of the same names, and default to Tinker's documented values for each loss (:data:`THRESHOLDS`).
"""

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from engine.core.models import context_length, lm_logits
from engine.core.ops import logprobs_from_logits
from engine.session.errors import UserError, datum_error
from engine.spec.policy_losses import LOSS_DEFAULTS, POLICY_LOSSES, LossBatch, LossSettings, PolicyLoss


class HasTokens(Protocol):
    """A datum as the wire decodes it: ``tokens`` int (N,), ``inputs`` name -> tensor, each (N,) expected."""

    @property
    def tokens(self) -> torch.Tensor: ...

    @property
    def inputs(self) -> Mapping[str, torch.Tensor]: ...


Config = Mapping[str, float | str]
"""``loss_fn_config``: numbers, or text (its v2 map's ``LossConfigValue``)."""
LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Config], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(the targets' log-probs (N,) with their graph, the datum's inputs, the config) -> (the loss of each token (N,),
extra per-token tensors (N,) for the metrics)."""


@dataclass(frozen=True)
class Loss:
    """One loss the server accepts: its function, the inputs it needs and may take, and its config keys."""

    compute: LossFn
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    defaults: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """The ``loss_fn_config`` keys it reads, each with its value where a request leaves it out."""

    @property
    def settings(self) -> tuple[str, ...]:
        """The ``loss_fn_config`` keys it reads."""
        return tuple(self.defaults)

    def __call__(
        self, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Config
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.compute(logprobs, inputs, {**self.defaults, **config})


THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")
"""The clip range of the ratio π/π_sampler: given in ``loss_fn_config`` or as per-datum inputs (one value per
datum: the datum's wins over the config); where neither gives it, the loss's Tinker default, registered beside it
(engine/spec/policy_losses.py ``LossDefaults.thresholds``: 0.8 / 1.2, cispo's 0.0 / 4.0, as Tinker documents
them)."""
DRO_BETA = 0.05
"""``dro``'s ``beta`` where a request leaves it out: the value of Tinker's docs' example (they name no default)."""
RATIO_MASK = "sequence_ratio_mask"
"""Tinker's name of the tokens a sequence's ratio is taken over (the registry's ``LossBatch.mask``, read by the
sequence-level loss alone). Default: the tokens of nonzero advantage, the response (Tinker's RL datums give the
prompt's tokens advantage 0)."""
TOKEN_INPUTS = ("target_tokens", "weights", "logprobs", "advantages", RATIO_MASK)
"""The inputs that carry one value per position, (N,)."""
POLICY_NAMES = {**{name: name for name in POLICY_LOSSES}, "ppo": "ppo_clip"}
"""The names the server accepts for the registry's losses -> the registry's: its own, and Tinker's where they
differ (Tinker's ``ppo`` is the clipped surrogate)."""


def cross_entropy(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Config
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-logp(target)·weight per token (N,); weights default to ones."""
    weights = inputs.get("weights")
    if weights is None:
        return -logprobs, {}
    return -logprobs * weights.to(logprobs.dtype), {}


def dro(
    logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Config
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO (Richemond et al., arXiv:2405.19107; Kimi k1.5, arXiv:2501.12599), as Tinker's losses page writes it:
    -(log π·A - ½β·(log π - log π_sampler)²) per token (N,), the quadratic penalty keeping an off-policy (even
    offline) update near the sampler; the advantages are the client's (DRO's soft ones). No ratio is taken."""
    advantages = inputs["advantages"].to(logprobs.dtype)  # (N,)
    sampler = inputs["logprobs"].to(logprobs.dtype)  # (N,)
    beta = float(config["beta"])
    return -(logprobs * advantages - 0.5 * beta * (logprobs - sampler) ** 2), {}


def threshold(name: str, inputs: Mapping[str, torch.Tensor], config: Config) -> float:
    """A clip threshold of a datum: its input's value (all equal, checked by :func:`check_datums`), else the
    config's (checked by :func:`check_config`; the loss's default where the request gave none)."""
    if name in inputs:
        return float(inputs[name].reshape(-1)[0])
    return float(config[name])


def policy_loss(loss: PolicyLoss) -> LossFn:
    """The registry's ``loss`` on one datum, a batch of one row (1, N): the sampler's ``logprobs`` are the old
    log-probs. Extras: ``clipped`` (1.0 where a clip was active), ``ratio`` (π/π_sampler, detached) and ``mask``
    (the tokens of the sequence ratio, :data:`RATIO_MASK`), each (N,)."""

    def compute(
        logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Config
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        advantages = inputs["advantages"].to(logprobs.dtype)  # (N,)
        mask = inputs.get(RATIO_MASK, advantages) != 0  # (N,)
        batch = LossBatch(inputs["logprobs"].to(logprobs.dtype)[None], advantages[None], mask.to(logprobs.dtype)[None])
        settings = LossSettings(
            clip_low=1.0 - threshold("clip_low_threshold", inputs, config),
            clip_high=threshold("clip_high_threshold", inputs, config) - 1.0,
        )
        out = loss(logprobs[None], batch, settings)  # (1, N)
        extras = {"clipped": out.clipped[0], "ratio": batch.ratio(logprobs.detach()[None])[0], "mask": batch.mask[0]}
        return out.per_token[0], extras

    return compute


RL_INPUTS = ("target_tokens", "logprobs", "advantages")
"""The inputs of every RL loss: the targets, the sampler's log-probs and the advantages."""
LOSSES: dict[str, Loss] = {
    "cross_entropy": Loss(cross_entropy, required=("target_tokens",), optional=("weights",)),
    **{
        name: Loss(
            policy_loss(POLICY_LOSSES[registered]),
            required=RL_INPUTS,
            optional=(*THRESHOLDS, RATIO_MASK),
            defaults=dict(zip(THRESHOLDS, LOSS_DEFAULTS[registered].thresholds, strict=True)),
        )
        for name, registered in POLICY_NAMES.items()
    },
    "dro": Loss(dro, required=RL_INPUTS, defaults={"beta": DRO_BETA}),
}
"""The losses the server accepts, by Tinker's names and the registry's. Not ``custom`` (the SDK runs a custom
loss on the client: a forward, then a weighted ``cross_entropy``), nor ``stable_reinforce`` (:data:`UNSUPPORTED`)."""
UNSUPPORTED = {
    "stable_reinforce": (
        "Tinker's StableReinforce objective is unpublished (its docs call it alpha, computed from what Tinker's "
        "sampler records with record_stability_info); train with ppo or another loss listed here instead (in "
        "tinker_cookbook: loss_fn=ppo, for async runs AsyncConfig.loss_fn)"
    ),
}
"""Loss names of Tinker's SDK this server refuses, with why and what to use instead."""


def find_loss(loss_fn: str) -> Loss:
    """The loss named ``loss_fn``, or a :class:`UserError` listing the supported ones."""
    if loss_fn not in LOSSES:
        reason = f" ({UNSUPPORTED[loss_fn]})" if loss_fn in UNSUPPORTED else ""
        raise UserError(f"loss_fn {loss_fn!r} is not supported{reason}; supported: {', '.join(sorted(LOSSES))}")
    return LOSSES[loss_fn]


def _threshold_problem(name: str, value: float) -> str | None:
    """Why a setting is out of its range, if it is: a clip threshold's lower bound of the ratio in [0, 1], its upper
    one ≥ 1; ``dro``'s ``beta`` ≥ 0."""
    if not math.isfinite(value):
        return f"{value:.6g} is not a finite number"
    if name == "clip_low_threshold" and not 0.0 <= value <= 1.0:
        return f"{value:.6g} is not a ratio's lower clip bound (in [0, 1], e.g. 0.8)"
    if name == "clip_high_threshold" and not value >= 1.0:
        return f"{value:.6g} is not a ratio's upper clip bound (1 or more, e.g. 1.2)"
    if name == "beta" and not value >= 0.0:
        return f"{value:.6g} is not a penalty's weight (0 or more, e.g. 0.05)"
    return None


def check_config(loss_fn: str, config: Config) -> None:
    """A :class:`UserError` for an unknown loss, a config key the loss does not read, or a bad value."""
    loss = find_loss(loss_fn)
    for key, value in config.items():
        if key not in loss.settings:
            known = f"its settings: {', '.join(loss.settings)}" if loss.settings else "it has no settings"
            raise UserError(f"loss_fn_config.{key}: not a setting of loss {loss_fn!r} ({known})")
        if isinstance(value, str):
            raise UserError(f"loss_fn_config.{key}: {value!r} is not a number")
        problem = _threshold_problem(key, float(value))
        if problem is not None:
            raise UserError(f"loss_fn_config.{key}: {problem}")


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool)


def _ids_problem(ids: torch.Tensor, vocab_size: int) -> str | None:
    """Why token ids are not ids of the vocabulary, if they are not."""
    if not _is_integer(ids):
        return f"dtype {str(ids.dtype).removeprefix('torch.')}, expected integer token ids"
    outside = (ids < 0) | (ids >= vocab_size)
    if bool(outside.any()):
        at = int(outside.nonzero()[0, 0])
        return f"token id {int(ids[at])} at position {at} is outside the vocabulary [0, {vocab_size})"
    return None


def _input_problem(name: str, value: torch.Tensor, n: int, vocab_size: int) -> str | None:
    """Why input ``name`` of a datum of ``n`` tokens is malformed, if it is."""
    shapes = [(n,)] if name in TOKEN_INPUTS else [(n,), (1,)]
    if tuple(value.shape) not in shapes:
        expected = " or ".join(str(shape) for shape in shapes)
        return f"shape {tuple(value.shape)}, expected {expected} for the {n} tokens of model_input"
    if name == "target_tokens":
        return _ids_problem(value, vocab_size)
    if value.dtype.is_floating_point and not bool(value.isfinite().all()):
        at = int((~value.isfinite()).nonzero()[0, 0])
        return f"a non-finite value ({float(value[at])}) at position {at}"
    if name in THRESHOLDS:
        if bool((value != value[0]).any()):
            values = ", ".join(f"{v:.6g}" for v in value.unique().tolist()[:3])
            return f"values differ ({values}): one threshold a datum"
        return _threshold_problem(name, float(value[0]))
    return None


def _datum_problems(
    datum: HasTokens, loss_fn: str, vocab_size: int, max_length: int | None
) -> Iterator[tuple[str, str]]:
    """(field, problem) for each thing wrong with ``datum`` under ``loss_fn``, in the order they are reported."""
    loss, tokens = LOSSES[loss_fn], datum.tokens
    n = tokens.shape[0] if tokens.ndim == 1 else 0
    if tokens.ndim != 1:
        yield "model_input", f"shape {tuple(tokens.shape)}, expected (N,): one sequence of token ids"
    elif n == 0:
        yield "model_input", "empty: a datum needs at least one token"
    elif max_length is not None and n > max_length:
        yield "model_input", f"{n} tokens exceed the model's context of {max_length} positions"
    elif (problem := _ids_problem(tokens, vocab_size)) is not None:
        yield "model_input", problem
    for name in loss.required:
        if name not in datum.inputs:
            yield f"loss_fn_inputs.{name}", f"missing: loss {loss_fn!r} needs {', '.join(loss.required)}"
    for name, value in datum.inputs.items():
        if name not in loss.required + loss.optional:
            known = ", ".join(loss.required + loss.optional)
            yield f"loss_fn_inputs.{name}", f"not an input of loss {loss_fn!r} (its inputs: {known})"
        elif (problem := _input_problem(name, value, n, vocab_size)) is not None:
            yield f"loss_fn_inputs.{name}", problem


def check_datums(datums: Sequence[HasTokens], loss_fn: str, vocab_size: int, max_length: int | None) -> None:
    """A :class:`UserError` for an unknown ``loss_fn``, or naming the first malformed datum and field: empty or
    too long (over ``max_length``, the model's context) tokens, ids outside [0, ``vocab_size``) in the tokens
    or ``target_tokens``, a missing or unknown input, an input not (N,), a non-finite value, a threshold that is
    not one value a datum or out of range."""
    find_loss(loss_fn)
    for index, datum in enumerate(datums):
        for field, problem in _datum_problems(datum, loss_fn, vocab_size, max_length):
            raise datum_error(index, field, problem)


def _chunks(datums: Sequence[HasTokens], chunk_size: int) -> list[list[int]]:
    """The datums' indices in chunks of at most ``chunk_size``, by length, so that a chunk pads little."""
    order = sorted(range(len(datums)), key=lambda i: datums[i].tokens.shape[0])
    return [order[i : i + chunk_size] for i in range(0, len(order), chunk_size)]


def _chunk_logprobs(model: torch.nn.Module, datums: Sequence[HasTokens]) -> list[torch.Tensor]:
    """Each datum's log-probs (N_i,) of its targets, from one forward of the datums right-padded to the longest."""
    device = next(model.parameters()).device
    lengths = [datum.tokens.shape[0] for datum in datums]
    input_ids = torch.zeros(len(datums), max(lengths), dtype=torch.long)  # (B, L)
    targets = torch.zeros_like(input_ids)  # (B, L)
    attention_mask = torch.zeros_like(input_ids)  # (B, L)
    for row, (datum, n) in enumerate(zip(datums, lengths, strict=True)):
        input_ids[row, :n] = datum.tokens
        targets[row, :n] = datum.inputs["target_tokens"]
        attention_mask[row, :n] = 1
    logits = lm_logits(model, input_ids.to(device), attention_mask.to(device))  # (B, L, V)
    logprobs = logprobs_from_logits(logits.float(), targets.to(device))  # (B, L), at temperature 1
    return [logprobs[row, :n] for row, n in enumerate(lengths)]


def target_logprobs(model: torch.nn.Module, datums: Sequence[HasTokens], chunk_size: int = 16) -> list[torch.Tensor]:
    """log p(target_tokens[i] | tokens[: i + 1]) at every position of each datum (N_i,), float32, with their
    graph (the caller decides about gradients): one forward per chunk of ``chunk_size`` datums."""
    found: dict[int, torch.Tensor] = {}
    for chunk in _chunks(datums, chunk_size):
        found.update(zip(chunk, _chunk_logprobs(model, [datums[i] for i in chunk]), strict=True))
    return [found[i] for i in range(len(datums))]


def input_vocab_size(model: PreTrainedModel) -> int:
    """How many token ids the model embeds."""
    embeddings = model.get_input_embeddings()
    assert isinstance(embeddings, torch.nn.Embedding)
    return embeddings.num_embeddings


def forward_backward(
    model: PreTrainedModel,
    datums: Sequence[HasTokens],
    loss_fn: str,
    config: Config,
    backward: bool,
    chunk_size: int = 16,
) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
    """Tinker's ``forward_backward`` (``forward`` without ``backward``): the datums and config checked (a
    :class:`UserError` names the first fault), then per datum ``{"logprobs", "elementwise_loss"}`` (N,) float32
    on the CPU, and the metrics ``loss:sum`` (Σ over tokens and datums) and, for the policy losses, ``clipfrac:mean``
    and ``ratio:mean`` (π/π_sampler) over the tokens of the sequence ratios (absent when there are none).

    With ``backward`` each chunk's summed loss is backpropagated as it is computed, so the graph of one chunk is
    held at a time: the gradients ACCUMULATE into ``.grad`` (nothing is zeroed, no optimizer step). Without, no
    graph is built at all.
    """
    loss = find_loss(loss_fn)
    check_config(loss_fn, config)
    check_datums(datums, loss_fn, input_vocab_size(model), context_length(model))
    outputs: dict[int, dict[str, torch.Tensor]] = {}
    total, clipped, ratios, masked = 0.0, 0.0, 0.0, 0.0
    with torch.set_grad_enabled(backward):
        for chunk in _chunks(datums, chunk_size):
            sums = []
            for i, logprobs in zip(chunk, _chunk_logprobs(model, [datums[i] for i in chunk]), strict=True):
                inputs = {name: value.to(logprobs.device) for name, value in datums[i].inputs.items()}
                per_token, extras = loss(logprobs, inputs, config)  # (N,)
                sums.append(per_token.sum())
                outputs[i] = {"logprobs": logprobs.detach().cpu(), "elementwise_loss": per_token.detach().float().cpu()}
                if "mask" in extras:
                    clipped += float((extras["clipped"] * extras["mask"]).sum())
                    ratios += float((extras["ratio"] * extras["mask"]).sum())
                    masked += float(extras["mask"].sum())
            chunk_loss = torch.stack(sums).sum()
            if backward:
                chunk_loss.backward()
            total += float(chunk_loss.detach())
    metrics = {"loss:sum": total}
    if masked > 0:
        metrics |= {"clipfrac:mean": clipped / masked, "ratio:mean": ratios / masked}
    return [outputs[i] for i in range(len(datums))], metrics
