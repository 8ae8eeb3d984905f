"""engine.core.ops against naive references written with plain Python loops."""

import math

import pytest
import torch
from torch.testing import assert_close

from engine.core.ops import (
    entropy_from_logits,
    first_true_index,
    last_valid_index,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    position_ids_from_mask,
    reward_index,
    stop_ids,
    truncate_after_stop,
)


def _data(seed: int = 0, B: int = 4, T: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float64 values and a right-padded 0/1 mask with rows of different lengths."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=torch.float64) * 3 + 1.5
    lengths = [T, 1, 4, 2][:B]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=torch.float64)
    return x, mask


def _naive_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    total, count = 0.0, 0.0
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[i, t]:
                total += x[i, t].item()
                count += 1
    return total / count


def _naive_var(x: torch.Tensor, mask: torch.Tensor) -> float:
    mean = _naive_mean(x, mask)
    total, count = 0.0, 0.0
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[i, t]:
                total += (x[i, t].item() - mean) ** 2
                count += 1
    return total / count


def test_masked_mean_all_dims():
    x, mask = _data()
    x[mask == 0] = 1e6  # padded values must not leak into the mean
    assert_close(masked_mean(x, mask), torch.tensor(_naive_mean(x, mask), dtype=torch.float64))


def test_masked_mean_along_dim():
    x, mask = _data(seed=1)
    rows = [
        sum(x[i, t].item() for t in range(x.shape[1]) if mask[i, t]) / sum(mask[i].tolist()) for i in range(x.shape[0])
    ]
    cols = [
        sum(x[i, t].item() for i in range(x.shape[0]) if mask[i, t]) / sum(mask[:, t].tolist())
        for t in range(x.shape[1])
    ]
    assert_close(masked_mean(x, mask, dim=1), torch.tensor(rows, dtype=torch.float64))
    assert_close(masked_mean(x, mask, dim=0), torch.tensor(cols, dtype=torch.float64))


def test_masked_var_is_biased():
    x, mask = _data(seed=2)
    expected = _naive_var(x, mask)
    assert_close(masked_var(x, mask), torch.tensor(expected, dtype=torch.float64))
    n = int(mask.sum().item())
    unbiased = expected * n / (n - 1)
    assert not math.isclose(masked_var(x, mask).item(), unbiased, rel_tol=1e-6)


def test_masked_whiten_zero_mean_unit_var():
    x, mask = _data(seed=3)
    out = masked_whiten(x, mask)
    mean, var = _naive_mean(x, mask), _naive_var(x, mask)
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            expected = (x[i, t].item() - mean) / math.sqrt(var + 1e-8) if mask[i, t] else 0.0
            assert out[i, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert _naive_mean(out, mask) == pytest.approx(0.0, abs=1e-9)
    assert _naive_var(out, mask) == pytest.approx(1.0, rel=1e-6)


def test_masked_whiten_keeps_mean_without_shift():
    x, mask = _data(seed=4)
    out = masked_whiten(x, mask, shift_mean=False)
    mean = _naive_mean(x, mask)
    assert abs(mean) > 0.1  # the test would be vacuous with a zero mean
    assert _naive_mean(out, mask) == pytest.approx(mean, rel=1e-9)
    assert _naive_var(out, mask) == pytest.approx(1.0, rel=1e-6)
    assert (out[mask == 0] == 0).all()


def _naive_log_softmax(row: list[float]) -> list[float]:
    m = max(row)
    log_z = m + math.log(sum(math.exp(v - m) for v in row))
    return [v - log_z for v in row]


def test_logprobs_from_logits():
    torch.manual_seed(0)
    B, T, V = 3, 5, 11
    logits = torch.randn(B, T, V, dtype=torch.float64) * 4
    tokens = torch.randint(0, V, (B, T))
    out = logprobs_from_logits(logits, tokens)
    assert out.shape == (B, T)
    expected = torch.empty(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            expected[i, t] = _naive_log_softmax(logits[i, t].tolist())[tokens[i, t].item()]
    # computed in float32 (logits are cast with .float()), so compare at float32 precision
    assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_entropy_from_logits():
    torch.manual_seed(1)
    B, T, V = 3, 4, 9
    logits = torch.randn(B, T, V, dtype=torch.float64) * 3
    logits[0, 0] = 0.0  # uniform: entropy log V
    out = entropy_from_logits(logits)
    expected = torch.empty(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            logp = _naive_log_softmax(logits[i, t].tolist())
            expected[i, t] = -sum(math.exp(lp) * lp for lp in logp)
    assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert out[0, 0].item() == pytest.approx(math.log(V), rel=1e-6)


def _naive_first_true(row: list[bool]) -> int:
    for t, b in enumerate(row):
        if b:
            return t
    return len(row)


def test_first_true_index():
    torch.manual_seed(2)
    bools = torch.rand(6, 8) < 0.2
    bools[0] = False  # no True -> T
    bools[1] = True  # all True -> 0
    bools[2] = False
    bools[2, 7] = True  # only the last
    out = first_true_index(bools)
    assert out.tolist() == [_naive_first_true(r) for r in bools.tolist()]
    assert out[0].item() == 8 and out[1].item() == 0 and out[2].item() == 7


PAD, STOP = 0, 9


def _naive_truncate(rows: list[list[int]], stop: int | set[int]) -> tuple[list[list[int]], list[list[int]], list[bool]]:
    stops = stop if isinstance(stop, set) else {stop}
    out, masks, stopped = [], [], []
    for row in rows:
        kept, m, seen = [], [], False
        for tok in row:
            if seen:
                kept.append(PAD)
                m.append(0)
            else:
                kept.append(tok)
                m.append(1)
                seen = tok in stops
        out.append(kept)
        masks.append(m)
        stopped.append(seen)
    return out, masks, stopped


def test_truncate_after_stop():
    responses = torch.tensor(
        [
            [3, 4, STOP, 5, STOP, 6],  # stop in the middle (first occurrence wins)
            [STOP, 4, 5, 6, 7, 8],  # stop at position 0
            [3, 4, 5, 6, 7, 8],  # no stop
            [3, 4, 5, 6, 7, STOP],  # stop at the end
        ]
    )
    out, mask, stopped = truncate_after_stop(responses, STOP, PAD)
    exp_out, exp_mask, exp_stopped = _naive_truncate(responses.tolist(), STOP)
    assert out.tolist() == exp_out
    assert mask.tolist() == exp_mask
    assert stopped.tolist() == exp_stopped
    assert out[0].tolist() == [3, 4, STOP, PAD, PAD, PAD]
    assert mask[1].tolist() == [1, 0, 0, 0, 0, 0]
    assert stopped.tolist() == [True, True, False, True]


def test_truncate_after_stop_random():
    torch.manual_seed(3)
    responses = torch.randint(1, 12, (8, 10))
    out, mask, stopped = truncate_after_stop(responses, STOP, PAD)
    exp_out, exp_mask, exp_stopped = _naive_truncate(responses.tolist(), STOP)
    assert (out.tolist(), mask.tolist(), stopped.tolist()) == (exp_out, exp_mask, exp_stopped)


def test_truncate_after_the_first_of_several_stop_tokens():
    """Llama 3 ends a turn with <|eot_id|> and a text with <|end_of_text|>: whichever comes first ends the row."""
    torch.manual_seed(4)
    responses = torch.randint(1, 12, (16, 10))
    out, mask, stopped = truncate_after_stop(responses, [STOP, 7], PAD)
    exp_out, exp_mask, exp_stopped = _naive_truncate(responses.tolist(), {STOP, 7})
    assert (out.tolist(), mask.tolist(), stopped.tolist()) == (exp_out, exp_mask, exp_stopped)
    assert any(exp_stopped) and not all(exp_stopped)
    single = truncate_after_stop(responses, STOP, PAD)
    assert [t.tolist() for t in truncate_after_stop(responses, (STOP,), PAD)] == [t.tolist() for t in single]


def test_stop_ids_read_transformers_eos_token_id():
    assert stop_ids(None) == ()
    assert stop_ids(5) == (5,)
    assert stop_ids([7, 5, 7]) == (7, 5)  # in order, once each


def test_truncate_without_stop_token():
    responses = torch.tensor([[3, STOP, 5], [STOP, 1, 2]])
    out, mask, stopped = truncate_after_stop(responses, None, PAD)
    assert out.tolist() == responses.tolist()
    assert mask.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert stopped.tolist() == [False, False]


def test_position_ids_from_mask_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1], [0, 1, 1, 1, 0]])
    expected = []
    for row in mask.tolist():
        seen, ids = 0, []  # valid tokens so far; a pad repeats the previous position (0 before any)
        for m in row:
            ids.append(seen if m else max(seen - 1, 0))
            seen += m
        expected.append(ids)
    out = position_ids_from_mask(mask)
    assert out.tolist() == expected
    assert out[0].tolist() == [0, 0, 0, 1, 2]  # valid tokens start at position 0
    assert out[2, 4].item() == 0


def test_last_valid_index():
    mask = torch.tensor(
        [
            [0, 0, 1, 1, 0, 0],  # padding on both sides
            [1, 1, 1, 1, 1, 1],
            [1, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 1],
            [0, 1, 0, 1, 1, 0],
        ]
    )
    expected = [max(t for t, m in enumerate(row) if m) for row in mask.tolist()]
    out = last_valid_index(mask)
    assert out.tolist() == expected == [3, 5, 0, 5, 4]


@pytest.mark.parametrize("pad", [None, 0, 2])
def test_reward_index_is_the_last_valid_non_pad_token(pad):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 4, (64, 7), generator=generator)  # (B, T), pad id 0 or 2 appears often
    attention_mask = (torch.rand(64, 7, generator=generator) > 0.3).long()
    attention_mask[0] = 0
    attention_mask[0, 3] = 1  # a row of one valid token
    expected = []
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
        valid = [t for t in range(7) if mask[t]]
        readable = [t for t in valid if ids[t] != pad]
        expected.append(readable[-1] if readable else (valid[-1] if valid else -1))
    assert reward_index(input_ids, attention_mask, pad).tolist() == expected
