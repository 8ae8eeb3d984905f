"""engine.methods.dpo against naive per-example, per-token Python loops written from the papers' formulas."""

import math

import pytest
import torch
from torch.testing import assert_close

from engine.core.ops import logprobs_from_logits
from engine.methods.dpo import DPOLossOut, dpo_loss, sequence_logps

# --- sequence_logps ------------------------------------------------------------------------------

# (B, L, V) and per row (prompt length, completion length); the rest of the row is right padding.
SEQ_CASES = [
    ((3, 7, 5), [(2, 3), (1, 6), (4, 3)]),
    ((1, 2, 11), [(1, 1)]),
    ((4, 9, 3), [(3, 6), (5, 2), (1, 1), (9, 0)]),  # last row: no completion at all
]


def _batch(seed: int, shape: tuple[int, int, int], rows: list[tuple[int, int]], dtype=torch.float64):
    """Random logits (B, L, V) and labels (B, L): -100 on the prompt and the padding, token ids on the completion."""
    B, L, V = shape
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, L, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    ids = torch.randint(0, V, (B, L), generator=g)
    labels = torch.full((B, L), -100)
    for i, (prompt, completion) in enumerate(rows):
        labels[i, prompt : prompt + completion] = ids[i, prompt : prompt + completion]
    return logits, labels


def _sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What DPO computes of whole logits: each next token's log-prob (engine.core.models.token_logprobs from position
    1, the logits made at once), summed over the trained tokens."""
    return sequence_logps(logprobs_from_logits(logits[:, :-1], labels[:, 1:].clamp(min=0)), labels)


def _naive_sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> list[float]:
    """Σ over trained positions t of log softmax(logits[t - 1])[label_t], one float per row."""
    B, L, V = logits.shape
    out = []
    for i in range(B):
        total = 0.0
        for t in range(1, L):
            y = int(labels[i, t])
            if y == -100:
                continue
            row = [float(logits[i, t - 1, v]) for v in range(V)]
            total += row[y] - math.log(sum(math.exp(x) for x in row))
        out.append(total)
    return out


@pytest.mark.parametrize("case", range(len(SEQ_CASES)))
def test_sequence_logps(case: int):
    shape, rows = SEQ_CASES[case]
    logits, labels = _batch(case, shape, rows)
    out = _sequence_logps(logits, labels)
    assert out.shape == (shape[0],) and out.dtype == torch.float64
    for i, expected in enumerate(_naive_sequence_logps(logits, labels)):
        assert out[i].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert (out[torch.tensor([c > 0 for _, c in rows])] < 0).all()
    for i, (_, completion) in enumerate(rows):
        if completion == 0:
            assert out[i].item() == 0.0


def test_sequence_logps_ignores_masked_positions():
    """Changing logits that only predict -100 labels (or the last position, which predicts nothing) changes nothing,
    and those logits get zero gradient."""
    shape, rows = SEQ_CASES[0]
    logits, labels = _batch(10, shape, rows)
    logits.requires_grad_(True)
    out = _sequence_logps(logits, labels)
    out.sum().backward()
    assert logits.grad is not None
    predicts_trained = torch.zeros(shape[:2], dtype=torch.bool)
    predicts_trained[:, :-1] = labels[:, 1:] != -100
    assert (logits.grad[~predicts_trained] == 0).all()
    assert (logits.grad[predicts_trained].abs().sum(-1) > 0).all()

    perturbed = logits.detach().clone()
    perturbed[~predicts_trained] += 100 * torch.randn_like(perturbed[~predicts_trained], dtype=torch.float64)
    assert_close(_sequence_logps(perturbed, labels), out.detach(), rtol=0, atol=0)


def test_sequence_logps_half_precision_upcasts():
    shape, rows = SEQ_CASES[2]
    logits, labels = _batch(11, shape, rows)
    out = _sequence_logps(logits.bfloat16(), labels)
    assert out.dtype == torch.float32
    expected = torch.tensor(_naive_sequence_logps(logits.bfloat16().double(), labels), dtype=torch.float32)
    assert_close(out, expected, rtol=1e-5, atol=1e-5)


# --- dpo_loss --------------------------------------------------------------------------------------

BATCH_SIZES = [1, 5, 16]
BETAS = [0.1, 0.5, 2.0]


def _logps(seed: int, B: int) -> tuple[torch.Tensor, ...]:
    """(policy_chosen, policy_rejected, ref_chosen, ref_rejected), each (B,) float64, like summed log-probs."""
    g = torch.Generator().manual_seed(seed)
    base = -torch.rand(2, B, generator=g, dtype=torch.float64) * 30  # reference
    drift = torch.randn(2, B, generator=g, dtype=torch.float64) * 3  # policy - reference
    return base[0] + drift[0], base[1] + drift[1], base[0], base[1]


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _h(pc: float, pr: float, rc: float, rr: float) -> float:
    return (pc - pr) - (rc - rr)


def _naive_sigmoid(pc: float, pr: float, rc: float, rr: float, beta: float, eps: float) -> float:
    """cDPO (Mitchell, eq. 3): -(1-ε) log σ(βh) - ε log σ(-βh); ε = 0 is DPO (Rafailov et al., eq. 7)."""
    h = _h(pc, pr, rc, rr)
    return -(1 - eps) * _log_sigmoid(beta * h) - eps * _log_sigmoid(-beta * h)


def _naive_ipo(pc: float, pr: float, rc: float, rr: float, beta: float, eps: float) -> float:
    """IPO (Azar et al., eq. 17), τ = β: (h - 1/(2τ))²."""
    return (_h(pc, pr, rc, rr) - 1 / (2 * beta)) ** 2


def _naive_hinge(pc: float, pr: float, rc: float, rr: float, beta: float, eps: float) -> float:
    """SLiC hinge on the normalised likelihood: max(0, 1 - βh)."""
    return max(0.0, 1 - beta * _h(pc, pr, rc, rr))


NAIVE = {"sigmoid": _naive_sigmoid, "ipo": _naive_ipo, "hinge": _naive_hinge}
LOSS_CASES = [
    ("sigmoid", 0.0),
    ("sigmoid", 0.1),
    ("sigmoid", 0.3),
    ("ipo", 0.0),
    ("hinge", 0.0),
]


@pytest.mark.parametrize("B", BATCH_SIZES)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize(("loss_type", "eps"), LOSS_CASES)
def test_dpo_loss_matches_naive(B: int, beta: float, loss_type, eps: float):
    pc, pr, rc, rr = _logps(B * 100 + int(beta * 10), B)
    out = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps)
    assert isinstance(out, DPOLossOut)
    assert out.losses.shape == out.chosen_rewards.shape == out.rejected_rewards.shape == (B,)
    for i in range(B):
        args = (pc[i].item(), pr[i].item(), rc[i].item(), rr[i].item())
        assert out.losses[i].item() == pytest.approx(NAIVE[loss_type](*args, beta, eps), rel=1e-12, abs=1e-12)
        assert out.chosen_rewards[i].item() == pytest.approx(beta * (args[0] - args[2]), rel=1e-12, abs=1e-12)
        assert out.rejected_rewards[i].item() == pytest.approx(beta * (args[1] - args[3]), rel=1e-12, abs=1e-12)


def test_hinge_cases_cover_both_sides():
    """The hinge inputs above include pairs on both sides of the margin (so relu's zero is exercised)."""
    pc, pr, rc, rr = _logps(1600 + 5, 16)
    losses = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="hinge").losses
    assert (losses == 0).any() and (losses > 0).any()


def test_sigmoid_at_zero_margin_is_log2():
    """h = 0 gives log 2 whatever ε: σ(0) = 1/2."""
    x = torch.tensor([-3.0, -7.5], dtype=torch.float64)
    for eps in (0.0, 0.2, 0.5):
        out = dpo_loss(x, x - 1, x + 2, x + 1, beta=0.3, loss_type="sigmoid", label_smoothing=eps)
        assert_close(out.losses, torch.full_like(x, math.log(2)))


def test_sigmoid_is_stable_for_large_margins():
    big = torch.tensor([1e4, -1e4], dtype=torch.float64)
    zero = torch.zeros_like(big)
    losses = dpo_loss(big, zero, zero, zero, beta=1.0, loss_type="sigmoid").losses
    assert torch.isfinite(losses).all()
    assert_close(losses, torch.tensor([0.0, 1e4], dtype=torch.float64))


@pytest.mark.parametrize("loss_type", ["ipo", "hinge"])
def test_label_smoothing_only_affects_sigmoid(loss_type):
    pc, pr, rc, rr = _logps(7, 8)
    plain = dpo_loss(pc, pr, rc, rr, beta=0.2, loss_type=loss_type)
    smoothed = dpo_loss(pc, pr, rc, rr, beta=0.2, loss_type=loss_type, label_smoothing=0.2)
    assert_close(smoothed.losses, plain.losses, rtol=0, atol=0)


def test_rewards_are_beta_log_ratios_and_detached():
    pc, pr, rc, rr = (t.clone().requires_grad_(True) for t in _logps(8, 6))
    for loss_type in ("sigmoid", "ipo", "hinge"):
        out = dpo_loss(pc, pr, rc, rr, beta=0.25, loss_type=loss_type)
        assert out.losses.requires_grad
        assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad
        assert_close(out.chosen_rewards, 0.25 * (pc - rc).detach())
        assert_close(out.rejected_rewards, 0.25 * (pr - rr).detach())


def _grads(loss_type, beta: float, eps: float = 0.0, seed: int = 9, B: int = 12):
    pc, pr, rc, rr = (t.clone().requires_grad_(True) for t in _logps(seed, B))
    out = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=eps)
    out.losses.sum().backward()
    h = ((pc - pr) - (rc - rr)).detach()
    return h, pc.grad, pr.grad, rc.grad, rr.grad


@pytest.mark.parametrize("beta", BETAS)
def test_sigmoid_gradient_direction(beta: float):
    """DPO raises the chosen completion's log-prob and lowers the rejected one's (Rafailov et al., sec. 4)."""
    h, g_pc, g_pr, g_rc, g_rr = _grads("sigmoid", beta)
    assert (g_pc < 0).all() and (g_pr > 0).all()
    assert_close(g_pr, -g_pc)
    assert_close(g_rc, -g_pc)
    assert_close(g_rr, g_pc)
    # d/dπ_c of -log σ(βh) = -β σ(-βh)
    for i in range(h.shape[0]):
        assert g_pc[i].item() == pytest.approx(-beta / (1 + math.exp(beta * h[i].item())), rel=1e-12)


def test_conservative_dpo_gradient_changes_sign():
    """With ε > 0 the gradient pushes h back once βh > log((1-ε)/ε): cDPO's target margin."""
    beta, eps = 2.0, 0.1
    h, g_pc, *_ = _grads("sigmoid", beta, eps)
    threshold = math.log((1 - eps) / eps)
    assert ((beta * h) > threshold).any() and ((beta * h) < threshold).any()
    assert torch.equal(g_pc < 0, beta * h < threshold)
    for i in range(h.shape[0]):
        x = beta * h[i].item()
        expected = -beta * ((1 - eps) / (1 + math.exp(x)) - eps / (1 + math.exp(-x)))
        assert g_pc[i].item() == pytest.approx(expected, rel=1e-10)


def test_ipo_and_hinge_gradients():
    beta = 0.5
    h, g_pc, *_ = _grads("ipo", beta)
    assert_close(g_pc, 2 * (h - 1 / (2 * beta)))
    h, g_pc, *_ = _grads("hinge", beta)
    assert_close(g_pc, torch.where(beta * h < 1, -beta, 0.0).to(g_pc.dtype))


def test_unknown_loss_type_raises():
    x = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="foo"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="foo")  # type: ignore[arg-type]
