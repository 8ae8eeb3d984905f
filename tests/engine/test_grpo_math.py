"""engine.methods.grpo (and the k2 KL estimator) against naive per-sample, per-token loops of the papers' formulas, and
the KL estimators' gradients as a reward and as a loss term, which decide where each is accepted
(engine/spec/config.py)."""

import math
import statistics

import pytest
import torch

from engine.core.ops import aggregate, kl_per_token
from engine.methods.grpo import STD_EPS, clipped_surrogate, kl_to_go, sequence_advantages, tied_groups, token_advantages

G = 4
LENGTHS = [5, 1, 3, 5, 2, 4, 5, 3]  # two groups of four samples
T = 5
SCORES = [1.0, 0.0, 0.5, 1.0, 0.2, 0.2, 0.9, -0.3]


def _mask() -> torch.Tensor:
    return torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in LENGTHS], dtype=torch.float64)


def _randn(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(LENGTHS), T, generator=g, dtype=torch.float64) * scale


def _scores() -> torch.Tensor:
    return torch.tensor(SCORES, dtype=torch.float64)


def _group_of(i: int) -> list[float]:
    start = i // G * G
    return SCORES[start : start + G]


def test_kl_k2():
    logp, ref = _randn(0), _randn(1)
    out = kl_per_token(logp, ref, "k2")
    for i in range(len(LENGTHS)):
        for t in range(T):
            assert out[i, t].item() == pytest.approx(0.5 * (logp[i, t].item() - ref[i, t].item()) ** 2, rel=1e-12)


def _kl_gradients(estimator: str, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact expectations over one token of a 64-word vocabulary, the policy's logits θ = ref + eps·z: the gradient
    in θ of KL(π || π_ref), of the estimator as a reward (E_π[k·∇log π], k held fixed: what a policy gradient of the
    penalty follows) and as a loss term on π's own samples (E_π[∇k])."""
    g = torch.Generator().manual_seed(9)
    ref_logits, z = torch.randn(64, generator=g, dtype=torch.float64), torch.randn(64, generator=g, dtype=torch.float64)
    ref = torch.log_softmax(ref_logits, 0)
    theta = (ref_logits + eps * z).requires_grad_(True)
    logp = torch.log_softmax(theta, 0)  # (V,)
    p = logp.exp().detach()
    k = kl_per_token(logp, ref, estimator)  # type: ignore[arg-type]
    (true,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta, retain_graph=True)
    (as_reward,) = torch.autograd.grad((p * k.detach() * logp).sum(), theta, retain_graph=True)
    (as_loss,) = torch.autograd.grad((p * k).sum(), theta)
    return true, as_reward, as_loss


@pytest.mark.parametrize("eps", [0.1, 0.01])
def test_only_k1_pulls_with_the_kls_gradient_from_the_reward(eps: float) -> None:
    true, k1, _ = _kl_gradients("k1", eps)
    torch.testing.assert_close(k1, true, rtol=1e-9, atol=1e-15)  # E_π[k1·∇log π] = ∇KL
    for estimator in ("k2", "k3"):  # ≈ ½ k1²: the first order cancels, a pull ~1/eps times too weak
        _, as_reward, _ = _kl_gradients(estimator, eps)
        assert as_reward.norm() < true.norm() * eps, estimator


def test_k1_as_a_loss_term_has_no_expected_gradient_and_k2_k3_pull_towards_the_reference() -> None:
    true, _, k1 = _kl_gradients("k1", 0.1)
    assert k1.abs().max().item() < 1e-15  # E_π[∇log π] = 0
    _, _, k2 = _kl_gradients("k2", 0.1)
    torch.testing.assert_close(k2, true, rtol=1e-9, atol=1e-15)  # E_π[k1·∇log π]
    _, _, k3 = _kl_gradients("k3", 0.1)  # ∇KL(π_ref || π): the same direction to first order
    assert torch.nn.functional.cosine_similarity(k3, true, dim=0).item() > 0.9


def test_grpo_advantage_is_the_group_normalised_score():
    out = sequence_advantages(_scores(), G, "grpo")
    for i, r in enumerate(SCORES):
        group = _group_of(i)
        expected = (r - statistics.mean(group)) / (statistics.stdev(group) + STD_EPS)
        assert out[i].item() == pytest.approx(expected, rel=1e-9)


def test_dr_grpo_advantage_subtracts_the_group_mean_only():
    out = sequence_advantages(_scores(), G, "dr_grpo")
    for i, r in enumerate(SCORES):
        assert out[i].item() == pytest.approx(r - statistics.mean(_group_of(i)), rel=1e-9, abs=1e-12)


def test_rloo_baseline_leaves_the_sample_out():
    out = sequence_advantages(_scores(), G, "rloo")
    for i, r in enumerate(SCORES):
        start = i // G * G
        others = [SCORES[j] for j in range(start, start + G) if j != i]
        assert out[i].item() == pytest.approx(r - sum(others) / len(others), rel=1e-9, abs=1e-12)


def test_rloo_needs_two_samples_per_prompt():
    with pytest.raises(ValueError, match="group_size of at least 2"):
        sequence_advantages(_scores(), 1, "rloo")


ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


def _naive_tied_fraction(scores: list[float], group_size: int, estimator: str) -> float:
    """The share of samples whose score ties with every score of its baseline: its group's (the batch's for
    reinforce_pp)."""
    untrained = 0
    for i, r in enumerate(scores):
        start = 0 if estimator == "reinforce_pp" else i // group_size * group_size
        end = len(scores) if estimator == "reinforce_pp" else start + group_size
        untrained += all(scores[j] == r for j in range(start, end))
    return untrained / len(scores)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize(
    ("scores", "group_size"),
    [
        ([0.5, 0.5, 0.5, 0.5, 1.0, 0.0, 0.0, 0.0], 4),  # one of two groups tied
        ([0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], 4),  # the whole batch tied
        (SCORES, 4),  # none tied
        ([0.5, 0.5, 1.0, 0.0, 0.0, 0.0], 2),  # two of three pairs tied
        ([1.0, 0.0, 0.0, 1.0], 1),  # one sample a prompt
        ([0.3, 0.3, 0.3], 1),
    ],
)
def test_tied_fraction_is_the_share_of_samples_without_signal(
    scores: list[float], group_size: int, estimator: str
) -> None:
    out = tied_groups(torch.tensor(scores, dtype=torch.float64), group_size, estimator)  # type: ignore[arg-type]
    assert out.item() == pytest.approx(_naive_tied_fraction(scores, group_size, estimator), rel=1e-6)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("first_group_only", [True, False])
def test_the_samples_counted_tied_carry_no_signal(estimator: str, first_group_only: bool) -> None:
    """What the share counts: samples whose shared score can move without moving any advantage of the batch."""
    scores = [0.5] * G + ([1.0, 0.0, 0.0, 0.0] if first_group_only else [0.5] * G)
    moved = [0.75] * G + scores[G:] if first_group_only else [0.75] * (2 * G)  # the tied samples, still tied
    before, after = (torch.tensor(x, dtype=torch.float64) for x in (scores, moved))
    mask = _mask()
    same = torch.equal(
        token_advantages(before, mask, G, estimator),  # type: ignore[arg-type]
        token_advantages(after, mask, G, estimator),  # type: ignore[arg-type]
    )
    fraction = tied_groups(before, G, estimator).item()  # type: ignore[arg-type]
    if first_group_only and estimator == "reinforce_pp":  # the group is compared with the batch's mean
        assert not same and fraction == 0.0
    else:
        assert same and fraction == (0.5 if first_group_only else 1.0)


def test_kl_to_go_sums_the_penalty_from_each_token_on():
    kl, mask = _randn(2), _mask()
    out = kl_to_go(kl, mask, 0.1)
    for i, n in enumerate(LENGTHS):
        for t in range(T):
            expected = sum(-0.1 * kl[i, s].item() for s in range(t, n)) if t < n else 0.0
            assert out[i, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def _naive_whiten(values: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Zero mean, unit (biased) variance over the given cells."""
    mean = sum(values.values()) / len(values)
    var = sum((v - mean) ** 2 for v in values.values()) / len(values)
    return {k: (v - mean) / math.sqrt(var + 1e-8) for k, v in values.items()}


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_whitens_the_return_of_score_and_kl_rewards_over_the_batch(estimator: str) -> None:
    """REINFORCE++ (Hu 2025): token rewards -β·KL, plus the score (less the group mean for the baseline
    variant) on the last token; each token's return is the sum of the rewards from it on (γ = 1), whitened over
    every kept token of the batch."""
    kl, mask, beta = _randn(3, 0.3), _mask(), 0.05
    out = token_advantages(_scores(), mask, G, estimator, kl=kl, kl_coef=beta)  # type: ignore[arg-type]
    returns = {}
    for i, n in enumerate(LENGTHS):
        score = SCORES[i] - (statistics.mean(_group_of(i)) if estimator == "reinforce_pp_baseline" else 0.0)
        rewards = [-beta * kl[i, t].item() + (score if t == n - 1 else 0.0) for t in range(n)]
        for t in range(n):
            returns[(i, t)] = sum(rewards[t:])
    expected = _naive_whiten(returns)
    for i in range(len(LENGTHS)):
        for t in range(T):
            assert out[i, t].item() == pytest.approx(expected.get((i, t), 0.0), rel=1e-6, abs=1e-9)


def test_group_advantages_are_the_same_on_every_kept_token_without_kl():
    mask = _mask()
    out = token_advantages(_scores(), mask, G, "grpo")
    seq = sequence_advantages(_scores(), G, "grpo")
    for i, n in enumerate(LENGTHS):
        for t in range(T):
            assert out[i, t].item() == pytest.approx(seq[i].item() if t < n else 0.0, abs=1e-12)


@pytest.mark.parametrize(("low", "high"), [(0.2, 0.2), (0.2, 0.28)])
def test_clipped_surrogate_per_token(low: float, high: float) -> None:
    logp, old, adv = _randn(4, 0.3), _randn(5, 0.3), _randn(6)
    loss, clipped = clipped_surrogate(logp, old, adv, low, high)
    for i in range(len(LENGTHS)):
        for t in range(T):
            ratio = math.exp(logp[i, t].item() - old[i, t].item())
            a = adv[i, t].item()
            plain, bounded = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
            assert loss[i, t].item() == pytest.approx(max(plain, bounded), rel=1e-9)
            assert clipped[i, t].item() == float(bounded > plain)


def test_clip_higher_lets_a_positive_advantage_raise_the_ratio_further():
    logp = torch.tensor([[math.log(1.25)]], dtype=torch.float64, requires_grad=True)
    old, adv = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    symmetric, _ = clipped_surrogate(logp, old, adv, 0.2, 0.2)
    higher, _ = clipped_surrogate(logp, old, adv, 0.2, 0.28)
    (g_sym,) = torch.autograd.grad(symmetric.sum(), logp)
    (g_high,) = torch.autograd.grad(higher.sum(), logp)
    assert g_sym.item() == 0.0  # ratio 1.25 > 1.2: clipped, no gradient
    assert g_high.item() < 0.0  # within 1.28: still pushed up


def _naive_aggregate(loss: torch.Tensor, how: str, max_tokens: int) -> float:
    rows = [[loss[i, t].item() for t in range(n)] for i, n in enumerate(LENGTHS)]
    if how == "token_mean":
        return sum(sum(r) for r in rows) / sum(LENGTHS)
    if how == "sequence_mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * max_tokens)


@pytest.mark.parametrize("how", ["token_mean", "sequence_mean", "constant"])
def test_aggregations(how: str) -> None:
    loss, mask = _randn(7), _mask()
    out = aggregate(loss, mask, how, max_tokens=T)  # type: ignore[arg-type]
    assert out.item() == pytest.approx(_naive_aggregate(loss, how, T), rel=1e-9)


@pytest.mark.parametrize("how", ["token_mean", "sequence_mean", "constant"])
def test_micro_batch_parts_sum_to_the_whole(how: str) -> None:
    loss, mask = _randn(8), _mask()
    whole = aggregate(loss, mask, how, max_tokens=T)  # type: ignore[arg-type]
    n_seq, n_tok = len(LENGTHS), mask.sum()
    parts = sum(
        aggregate(loss[i : i + 3], mask[i : i + 3], how, n_sequences=n_seq, n_tokens=n_tok, max_tokens=T)  # type: ignore[arg-type]
        for i in range(0, len(LENGTHS), 3)
    )
    assert float(parts) == pytest.approx(whole.item(), rel=1e-9)
