"""The chassis every loop uses (engine/core/learner.py): a minibatch's gradients do not depend on how it is split into
micro-batches, the objective's terms are the formulas', the optimizer step clips the norm of every group together,
and the update driver shuffles, counts and stops as documented."""

import math

import pytest
import torch

from engine.core.distributed import Ranks
from engine.core.learner import Learner, LossInputs, Objective, Tokens, accumulate, micro_batches, run_updates
from engine.core.loop import make_optimizer, make_scheduler
from engine.core.models import load_causal_lm, load_tokenizer, token_logprobs
from engine.core.ops import kl_per_token
from engine.spec.config import SFTConfig
from engine.spec.policy_losses import POLICY_LOSSES, LossSettings

P, T, N = 4, 5, 6


@pytest.fixture
def learner() -> Learner:
    tokenizer = load_tokenizer("builtin:tiny")
    model = load_causal_lm("builtin:tiny", tokenizer, seed=0)
    learner = Learner(model, Ranks(), chunk_size=4)
    cfg = SFTConfig(max_grad_norm=1.0)
    learner.optimizer = make_optimizer(model.parameters(), cfg, 1e-3)
    learner.scheduler = make_scheduler(learner.optimizer, cfg, 10)
    learner.max_grad_norm = 1.0
    return learner


def batch() -> tuple[Tokens, LossInputs]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (N, P + T), generator=generator)
    attention = torch.ones_like(ids)
    attention[0, :2] = 0  # a left-padded prompt
    mask = torch.ones(N, T)
    mask[1, 3:] = 0  # a response that stopped early
    attention[1, P + 3 :] = 0
    old = torch.randn(N, T, generator=generator) * 0.1 - 3.0
    advantages = torch.randn(N, T, generator=generator)
    ref = old + 0.05 * torch.randn(N, T, generator=generator)
    inputs = LossInputs(old * mask, advantages * mask, mask, N, mask.sum(), ref * mask)
    return Tokens(ids, attention, P), inputs


def rows(inputs: LossInputs, index: slice) -> LossInputs:
    assert inputs.ref_logprobs is not None
    return LossInputs(inputs.old_logprobs[index], inputs.advantages[index], inputs.mask[index], inputs.n_sequences,
                      inputs.n_tokens, inputs.ref_logprobs[index])  # fmt: skip


def gradients(learner: Learner) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in learner.params if p.grad is not None])


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_micro_batches_accumulate_the_minibatch_gradient(learner: Learner, aggregation: str) -> None:
    tokens, inputs = batch()
    objective = Objective("ppo_clip", LossSettings(0.2, 0.2), aggregation, T, kl_coef=0.1, entropy=True,  # type: ignore[arg-type]
                          entropy_coef=0.01)  # fmt: skip
    whole = learner.forward_backward(tokens, objective, inputs)
    whole_grad = gradients(learner).clone()
    learner.model.zero_grad(set_to_none=True)

    def micro(part: slice, last: bool) -> dict[str, torch.Tensor]:
        return learner.forward_backward(tokens.rows(part), objective, rows(inputs, part), last)

    parts = accumulate(
        N, 4, ("policy", "kl", "entropy", "clipfrac", "approx_kl"), micro, learner.ranks, torch.device("cpu")
    )
    assert [s for s, _ in micro_batches(N, 4)] == [slice(0, 4), slice(4, 8)]
    # Summed in two parts: a few float32 entries differ by ~2e-7 on some CPUs (vector widths).
    torch.testing.assert_close(gradients(learner), whole_grad, rtol=1e-5, atol=1e-6)
    for key, value in parts.items():
        assert value == pytest.approx(whole[key].item(), rel=1e-5, abs=1e-7)


def test_the_objective_is_the_clipped_loss_plus_the_kl_less_the_entropy(learner: Learner) -> None:
    tokens, inputs = batch()
    assert inputs.ref_logprobs is not None
    objective = Objective("ppo_clip", LossSettings(0.2, 0.2), kl_coef=0.1, kl_estimator="k3", entropy=True)
    stats = learner.forward_backward(tokens, objective, inputs, grad=False)
    with torch.no_grad():
        logprobs, entropy = token_logprobs(learner.model, tokens.query_responses, tokens.attention_mask, P,
                                           entropy=True)  # fmt: skip
    assert entropy is not None
    mask, n = inputs.mask, inputs.mask.sum()
    ratio = (logprobs - inputs.old_logprobs).exp()
    a = inputs.advantages
    expected_pg = (torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * mask).sum() / n
    expected_kl = (kl_per_token(logprobs, inputs.ref_logprobs, "k3") * mask).sum() / n
    assert stats["policy"].item() == pytest.approx(expected_pg.item(), rel=1e-5)
    assert stats["kl"].item() == pytest.approx(expected_kl.item(), rel=1e-5)
    assert stats["entropy"].item() == pytest.approx(((entropy * mask).sum() / n).item(), rel=1e-5)
    assert stats["approx_kl"].item() == pytest.approx(((0.5 * (logprobs - inputs.old_logprobs) ** 2 * mask).sum() / n)
                                                .item(), rel=1e-5)  # fmt: skip
    assert all(p.grad is None for p in learner.params)  # grad=False: measured only


def test_optim_step_clips_every_group_together(learner: Learner) -> None:
    for p in learner.params:
        p.grad = torch.ones_like(p)
    norm = math.sqrt(sum(p.numel() for p in learner.params))
    before = [p.detach().clone() for p in learner.params]
    assert learner.optim_step() == pytest.approx(norm, rel=1e-4)
    assert all(p.grad is None for p in learner.params)
    assert any(not torch.equal(b, p) for b, p in zip(before, learner.params, strict=True))
    lr = learner.lr
    assert learner.schedule() == lr and learner.lr != lr  # the schedule moved on after reporting the step's rate


def test_run_updates_shuffles_each_pass_and_stops_at_the_limit(learner: Learner) -> None:
    seen: list[tuple[list[int], int]] = []

    def minibatch(inds: torch.Tensor, update: int) -> dict[str, float]:
        seen.append((inds.tolist(), update))
        return {"policy": 0.0, "approx_kl": 0.5 if update == 4 else 0.0}

    shuffle = torch.Generator().manual_seed(0)
    stats, stopped = run_updates(learner, 6, 2, 2, shuffle, minibatch, ("policy",), 1)
    assert not stopped and [u for _, u in seen] == list(range(6)) and len(stats["grad_norm"]) == 6
    assert sorted(i for inds, _ in seen[:3] for i in inds) == list(range(6))  # each pass sees every row once
    seen.clear()
    stats, stopped = run_updates(learner, 6, 2, 2, shuffle, minibatch, ("policy",), 1, limit=("approx_kl", 0.1))
    assert stopped and [u for _, u in seen] == [0, 1, 2, 3, 4] and len(stats["approx_kl"]) == 5


def test_run_updates_refuses_a_non_finite_loss(learner: Learner) -> None:
    from engine.core.loop import NonFiniteLossError

    with pytest.raises(NonFiniteLossError):
        run_updates(learner, 2, 2, 1, torch.Generator(), lambda inds, u: {"policy": math.nan}, ("policy",), 3)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_gradient_is_refused_and_the_weights_kept(learner: Learner, bad: float) -> None:
    """A finite loss whose gradient holds a NaN (or an infinity): the step raises NonFiniteLossError, as a
    non-finite loss does, and neither the weights nor the optimizer state move; the gradients are cleared."""
    from engine.core.loop import NonFiniteLossError

    tokens, inputs = batch()
    learner.forward_backward(tokens, Objective("ppo_clip", LossSettings(0.2, 0.2)), inputs)
    learner.optim_step()  # a good step first: the optimizer has state to keep
    before = [p.detach().clone() for p in learner.params]
    assert learner.optimizer is not None
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in learner.optimizer.state.items()}
    learner.forward_backward(tokens, Objective("ppo_clip", LossSettings(0.2, 0.2)), inputs)
    assert all(math.isfinite(p.grad.sum().item()) for p in learner.params if p.grad is not None)
    learner.params[3].grad.view(-1)[7] = bad  # type: ignore[union-attr]
    with pytest.raises(NonFiniteLossError, match=f"grad_norm is {bad}"):
        run_updates(learner, 2, 2, 1, torch.Generator(), lambda inds, u: {"policy": 0.5}, ("policy",), 3)
    assert all(torch.equal(p, b) for p, b in zip(learner.params, before, strict=True))
    assert all(p.grad is None for p in learner.params)
    for p, s in learner.optimizer.state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_rollout_correction_weights_each_tokens_policy_loss(learner: Learner, name: str) -> None:
    """With ``rollout_correction`` C, forward_backward's policy loss (and its gradient) is the naive sum over the
    kept tokens of min(π_old/π_sampler, C) × the token's loss, over the kept token count, for every loss."""
    tokens, inputs = batch()
    cap = 1.5
    sampler = (inputs.old_logprobs + 0.5 * torch.randn(N, T, generator=torch.Generator().manual_seed(1))) * inputs.mask
    inputs.sampler_logprobs = sampler
    objective = Objective(name, LossSettings(0.2, 0.2, rollout_correction=cap))
    stats = learner.forward_backward(tokens, objective, inputs)
    grad = gradients(learner).clone()
    learner.model.zero_grad(set_to_none=True)

    logprobs, _ = token_logprobs(learner.model, tokens.query_responses, tokens.attention_mask, P)
    per_token = POLICY_LOSSES[name](logprobs, inputs, LossSettings(0.2, 0.2)).per_token
    total, capped = torch.zeros(()), 0
    for i in range(N):
        for t in range(T):
            if inputs.mask[i, t] == 1:
                ratio = math.exp(inputs.old_logprobs[i, t].item() - sampler[i, t].item())  # π_old / π_sampler
                total = total + min(ratio, cap) * per_token[i, t]
                capped += ratio > cap
    expected = total / inputs.mask.sum()
    expected.backward()
    assert stats["policy"].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad, gradients(learner), rtol=1e-5, atol=1e-7)
    assert 0 < capped < inputs.mask.sum()  # some weights capped, some not


def test_rollout_correction_needs_the_samplers_logprobs(learner: Learner) -> None:
    tokens, inputs = batch()
    objective = Objective("ppo_clip", LossSettings(0.2, 0.2, rollout_correction=2.0))
    with pytest.raises(ValueError, match="needs the sampler's log-probs"):
        learner.forward_backward(tokens, objective, inputs)


def test_load_state_of_save_state_trains_on_as_an_uninterrupted_run(learner: Learner) -> None:
    """The Tinker-compatible API's save_state / load_state: two updates, the state saved, two more; a learner of
    another model (another seed) restored from that state takes the same two updates, bit for bit."""
    tokens, inputs = batch()
    objective = Objective("ppo_clip", LossSettings(0.2, 0.2), kl_coef=0.1)

    def update(learner: Learner, steps: int) -> None:
        for _ in range(steps):
            learner.forward_backward(tokens, objective, inputs, last=True)
            learner.optim_step()
            learner.schedule()

    update(learner, 2)
    state = learner.save_state()
    update(learner, 2)
    other = Learner(load_causal_lm("builtin:tiny", load_tokenizer("builtin:tiny"), seed=1), Ranks(), chunk_size=4)
    cfg = SFTConfig(max_grad_norm=1.0)
    other.optimizer = make_optimizer(other.model.parameters(), cfg, 1e-3)
    other.scheduler = make_scheduler(other.optimizer, cfg, 10)
    other.max_grad_norm = 1.0
    assert not torch.equal(other.params[0], learner.params[0])
    other.load_state(state)
    update(other, 2)
    assert other.lr == learner.lr
    for mine, theirs in zip(learner.params, other.params, strict=True):
        assert torch.equal(mine, theirs)
    with pytest.raises(ValueError, match="trained parameters differ"):
        other.load_state({**state, "weights": {"lm_head.weight": state["weights"][next(iter(state["weights"]))]}})
