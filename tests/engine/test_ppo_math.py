"""engine.methods.ppo against naive per-row, per-token Python loops."""

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from engine.core.ops import kl_per_token
from engine.methods.ppo import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    compute_gae,
    compute_rewards,
    explained_variance,
    policy_loss,
    value_loss,
)

LENGTHS = [6, 1, 4, 3, 6]
T = 6


def _mask(lengths: list[int] = LENGTHS) -> torch.Tensor:
    """Right-padded 0/1 mask (float64), as produced by truncation."""
    return torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=torch.float64)


def _randn(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(LENGTHS), T, generator=g, dtype=torch.float64) * scale


def _cells(mask: torch.Tensor):
    """Every (row, token) position, in order."""
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            yield i, t


# --- kl_per_token ----------------------------------------------------------------------------


def test_kl_k1():
    logp, ref = _randn(0), _randn(1)
    out = kl_per_token(logp, ref, "k1")
    for i, t in _cells(logp):
        assert out[i, t].item() == pytest.approx(logp[i, t].item() - ref[i, t].item(), rel=1e-12)
    assert (out < 0).any()  # k1 can be negative
    assert_close(kl_per_token(logp, ref), out)  # k1 is the default


def test_kl_k3():
    logp, ref = _randn(2), _randn(3)
    out = kl_per_token(logp, ref, "k3")
    for i, t in _cells(logp):
        r = math.exp(ref[i, t].item() - logp[i, t].item())
        assert out[i, t].item() == pytest.approx(r - 1 - math.log(r), rel=1e-9, abs=1e-12)
    assert (out >= 0).all()
    assert_close(kl_per_token(logp, logp, "k3"), torch.zeros_like(logp))


# --- compute_rewards ---------------------------------------------------------------------------


def test_compute_rewards():
    mask = _mask()
    kl = _randn(4)
    scores = torch.tensor([1.5, -2.0, 0.25, 3.0, -0.5], dtype=torch.float64)
    kl_coef = 0.3
    rewards, non_score = compute_rewards(scores, kl, mask, kl_coef)
    for i, t in _cells(mask):
        n = LENGTHS[i]
        expected_ns = -kl_coef * kl[i, t].item() if t < n else 0.0
        expected = expected_ns + (scores[i].item() if t == n - 1 else 0.0)
        assert non_score[i, t].item() == pytest.approx(expected_ns, abs=1e-12)
        assert rewards[i, t].item() == pytest.approx(expected, abs=1e-12)
    assert (rewards[mask == 0] == 0).all() and (non_score[mask == 0] == 0).all()
    # the score appears exactly once per row
    assert_close((rewards - non_score).sum(1), scores)


def test_compute_rewards_does_not_modify_inputs():
    mask, kl = _mask(), _randn(5)
    kl_before = kl.clone()
    scores = torch.ones(len(LENGTHS), dtype=torch.float64)
    _, non_score = compute_rewards(scores, kl, mask, 0.1)
    assert_close(kl, kl_before)
    assert_close(non_score, -0.1 * kl * mask)  # non-score reward carries no score


# --- compute_gae -------------------------------------------------------------------------------


def _naive_gae(rewards, values, lengths, gamma, lam):
    B = len(lengths)
    adv = [[0.0] * T for _ in range(B)]
    for i in range(B):
        n = lengths[i]
        last = 0.0
        for t in reversed(range(n)):
            next_v = values[i][t + 1] if t + 1 < n else 0.0
            delta = rewards[i][t] + gamma * next_v - values[i][t]
            last = delta + gamma * lam * last
            adv[i][t] = last
    ret = [[adv[i][t] + values[i][t] if t < lengths[i] else 0.0 for t in range(T)] for i in range(B)]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.5, 0.0), (0.0, 0.7)])
def test_compute_gae(gamma, lam):
    mask = _mask()
    rewards, values = _randn(6), _randn(7)
    # garbage outside the mask must be ignored (V after the last kept token is 0)
    rewards_in, values_in = rewards.clone(), values.clone()
    rewards_in[mask == 0] = 100.0
    values_in[mask == 0] = -50.0
    adv, ret = compute_gae(rewards_in, values_in, mask, gamma, lam)
    exp_adv, exp_ret = _naive_gae(rewards.tolist(), values.tolist(), LENGTHS, gamma, lam)
    assert_close(adv, exp_adv)
    assert_close(ret, exp_ret)
    assert_close(ret, (adv + values) * mask)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_compute_gae_monte_carlo_return():
    """gamma = lam = 1: the return is the undiscounted sum of rewards to the end of the row."""
    mask = _mask()
    rewards, values = _randn(8), _randn(9)
    _, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    for i, t in _cells(mask):
        expected = sum(rewards[i, k].item() for k in range(t, LENGTHS[i])) if t < LENGTHS[i] else 0.0
        assert ret[i, t].item() == pytest.approx(expected, abs=1e-10)


# --- policy_loss -------------------------------------------------------------------------------


def _policy_inputs(seed: int = 10):
    mask = _mask()
    old = _randn(seed)
    logprobs = (old + _randn(seed + 1, scale=0.3)).requires_grad_(True)
    advantages = _randn(seed + 2)
    return logprobs, old, advantages, mask


def _naive_policy(logprobs, old, adv, mask, eps, n=None):
    total, clipped, kl, count = 0.0, 0.0, 0.0, 0.0
    for i, t in _cells(mask):
        if not mask[i, t]:
            continue
        lr = logprobs[i, t].item() - old[i, t].item()
        r = math.exp(lr)
        a = adv[i, t].item()
        unclipped, clip_term = -a * r, -a * min(max(r, 1 - eps), 1 + eps)
        total += max(unclipped, clip_term)
        clipped += 1.0 if clip_term > unclipped else 0.0
        kl += 0.5 * lr**2
        count += 1
    n = count if n is None else n
    return total / n, clipped / n, kl / n


@pytest.mark.parametrize("cliprange", [0.05, 0.2, 1.0])
def test_policy_loss(cliprange):
    logprobs, old, adv, mask = _policy_inputs()
    out = policy_loss(logprobs, old, adv, mask, cliprange)
    loss, clipfrac, approxkl = _naive_policy(logprobs, old, adv, mask, cliprange)
    assert out.pg_loss.item() == pytest.approx(loss, rel=1e-10)
    assert out.clipfrac.item() == pytest.approx(clipfrac, rel=1e-10)
    assert out.approxkl.item() == pytest.approx(approxkl, rel=1e-10)
    assert out.pg_loss.requires_grad
    assert not out.clipfrac.requires_grad and not out.approxkl.requires_grad
    if cliprange == 0.05:
        assert 0 < clipfrac < 1  # both branches exercised


def test_policy_loss_gradient_matches_naive():
    logprobs, old, adv, mask = _policy_inputs(seed=20)
    eps = 0.2
    policy_loss(logprobs, old, adv, mask, eps).pg_loss.backward()
    n = mask.sum().item()
    expected = torch.zeros_like(old)
    for i, t in _cells(mask):
        if not mask[i, t]:
            continue
        r = math.exp(logprobs[i, t].item() - old[i, t].item())
        a = adv[i, t].item()
        # d/dlogp of max(-a r, -a clip(r)): the unclipped branch has gradient -a r, the clipped one 0
        if -a * r >= -a * min(max(r, 1 - eps), 1 + eps):
            expected[i, t] = -a * r / n
    assert_close(logprobs.grad, expected)


def test_policy_loss_n_tokens_split_equals_whole_batch():
    logprobs, old, adv, mask = _policy_inputs(seed=30)
    whole = policy_loss(logprobs, old, adv, mask, 0.2)
    (grad_whole,) = torch.autograd.grad(whole.pg_loss, logprobs)

    n = mask.sum()
    halves = [slice(0, 2), slice(2, None)]
    parts = [policy_loss(logprobs[s], old[s], adv[s], mask[s], 0.2, n_tokens=n) for s in halves]
    assert_close(sum(p.pg_loss for p in parts), whole.pg_loss)
    assert_close(sum(p.clipfrac for p in parts), whole.clipfrac)
    assert_close(sum(p.approxkl for p in parts), whole.approxkl)
    (grad_split,) = torch.autograd.grad(sum(p.pg_loss for p in parts), logprobs)
    assert_close(grad_split, grad_whole)
    # without n_tokens each half would be its own mean, which differs
    own = [policy_loss(logprobs[s], old[s], adv[s], mask[s], 0.2).pg_loss for s in halves]
    assert not torch.allclose(sum(own), whole.pg_loss)


def test_policy_loss_n_tokens_divisor():
    logprobs, old, adv, mask = _policy_inputs(seed=40)
    out = policy_loss(logprobs, old, adv, mask, 0.2, n_tokens=50.0)
    loss, clipfrac, approxkl = _naive_policy(logprobs, old, adv, mask, 0.2, n=50.0)
    assert out.pg_loss.item() == pytest.approx(loss, rel=1e-10)
    assert out.clipfrac.item() == pytest.approx(clipfrac, rel=1e-10, abs=1e-12)
    assert out.approxkl.item() == pytest.approx(approxkl, rel=1e-10)


# --- value_loss --------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [0.1, 0.5, 10.0])
def test_value_loss(eps):
    mask = _mask()
    old_values, returns = _randn(50), _randn(51)
    vpreds = old_values + _randn(52, scale=0.5)
    loss, clipfrac = value_loss(vpreds, old_values, returns, mask, eps)
    total, clipped, count = 0.0, 0.0, 0.0
    for i, t in _cells(mask):
        if not mask[i, t]:
            continue
        v, v_old, ret = vpreds[i, t].item(), old_values[i, t].item(), returns[i, t].item()
        v_clip = v_old + min(max(v - v_old, -eps), eps)
        unclipped, clip_term = (v - ret) ** 2, (v_clip - ret) ** 2
        total += 0.5 * max(unclipped, clip_term)
        clipped += 1.0 if clip_term > unclipped else 0.0
        count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-10)
    assert clipfrac.item() == pytest.approx(clipped / count, rel=1e-10, abs=1e-12)
    if eps == 0.1:
        assert clipfrac.item() > 0
    if eps == 10.0:
        assert clipfrac.item() == 0  # nothing is clipped with a huge range


def test_value_loss_n_tokens_split():
    mask = _mask()
    old_values, returns = _randn(60), _randn(61)
    vpreds = old_values + _randn(62, scale=0.5)
    whole, _ = value_loss(vpreds, old_values, returns, mask, 0.2)
    n = mask.sum()
    parts = [
        value_loss(vpreds[s], old_values[s], returns[s], mask[s], 0.2, n_tokens=n)[0]
        for s in (slice(0, 3), slice(3, None))
    ]
    assert_close(sum(parts), whole)


# --- KL controllers ----------------------------------------------------------------------------


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=64)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_kl_controller_clipped():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    ctl.update(current_kl=12.0, n_steps=64)  # error 12/6 - 1 = 1, clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 64 / 10_000), rel=1e-12)


def test_adaptive_kl_controller_below_target_unclipped():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    ctl.update(current_kl=5.4, n_steps=64)  # error 5.4/6 - 1 = -0.1, inside ±0.2
    assert ctl.value == pytest.approx(0.1 * (1 - 0.1 * 64 / 10_000), rel=1e-12)
    ctl2 = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    ctl2.update(current_kl=0.0, n_steps=64)  # error -1 clipped to -0.2
    assert ctl2.value == pytest.approx(0.1 * (1 - 0.2 * 64 / 10_000), rel=1e-12)


def test_adaptive_kl_controller_state_dict():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100)
    ctl.update(current_kl=7.0, n_steps=10)
    other = AdaptiveKLController(0.1, target=6.0, horizon=100)
    other.load_state_dict(ctl.state_dict())
    assert other.value == ctl.value != 0.1


# --- RunningMoments ----------------------------------------------------------------------------


def test_running_moments_match_concatenation():
    torch.manual_seed(70)
    chunks = [
        torch.randn(n, dtype=torch.float64) * s + m
        for n, s, m in [(5, 1.0, 0.0), (1, 1.0, 3.0), (17, 2.5, -1.0), (8, 0.3, 4.0)]
    ]
    moments = RunningMoments()
    seen = []
    for chunk in chunks:
        moments.update(chunk)
        seen.append(chunk.numpy())
        allv = np.concatenate(seen)
        assert moments.mean == pytest.approx(float(np.mean(allv)), rel=1e-10, abs=1e-12)
        assert moments.std == pytest.approx(float(np.std(allv)), rel=1e-10)
        assert moments.count == allv.size


def test_running_moments_2d_and_float32_input():
    moments = RunningMoments()
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    moments.update(a)
    moments.update(torch.tensor([10.0]))
    allv = np.array([0, 1, 2, 3, 4, 5, 10], dtype=np.float64)
    assert moments.mean == pytest.approx(allv.mean())
    assert moments.std == pytest.approx(allv.std())


def test_running_moments_state_dict_round_trip():
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0, 4.0]))
    restored = RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert (restored.mean, restored.var, restored.count) == (moments.mean, moments.var, moments.count)
    more = torch.tensor([-3.0, 8.0])
    moments.update(more)
    restored.update(more)
    assert (restored.mean, restored.std, restored.count) == (moments.mean, moments.std, moments.count)


# --- explained_variance ------------------------------------------------------------------------


def test_explained_variance():
    mask = _mask()
    returns = _randn(80)
    values = returns + _randn(81, scale=0.5)
    returns_in = returns.clone()
    returns_in[mask == 0] = 1e3  # ignored outside the mask

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs)

    kept = [(i, t) for i, t in _cells(mask) if mask[i, t]]
    r = [returns[i, t].item() for i, t in kept]
    d = [returns[i, t].item() - values[i, t].item() for i, t in kept]
    expected = 1 - var(d) / var(r)
    assert explained_variance(values, returns_in, mask).item() == pytest.approx(expected, rel=1e-10)


def test_explained_variance_perfect_and_constant():
    mask = _mask()
    returns = _randn(82)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    # predicting the mean explains nothing
    mean = (returns * mask).sum() / mask.sum()
    assert explained_variance(torch.full_like(returns, mean.item()), returns, mask).item() == pytest.approx(
        0.0, abs=1e-12
    )
