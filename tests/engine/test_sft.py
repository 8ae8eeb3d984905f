"""SFT end to end on builtin:tiny: learning, metrics, gradient accumulation, checkpoint layout."""

import itertools
import json
import math

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.core.checkpoint import JOB_FILE, STATE_FILE
from tests.engine.helpers import (
    EVAL_DATASETS,
    SFT_METRICS,
    Pretrained,
    assert_all_finite,
    final_model_dir,
    load_weights,
    make_spec,
    train,
)


def test_loss_falls_and_eval_loss_reported(pretrained: Pretrained):
    metrics = pretrained.sft_metrics
    assert sorted(metrics) == list(range(1, 61))
    losses = [metrics[s]["loss/sft"] for s in sorted(metrics)]
    assert sum(losses[-5:]) / 5 < 0.4 * losses[0], losses
    # eval/loss only when due: no eval_every, so only at the last step
    assert [s for s in metrics if "eval/loss" in metrics[s]] == [60]
    eval_loss = metrics[60]["eval/loss"]
    assert math.isfinite(eval_loss) and eval_loss < 0.5 * losses[0]


def test_every_sft_metric_every_step(pretrained: Pretrained):
    for step, values in pretrained.sft_metrics.items():
        missing = set(SFT_METRICS) - set(values)
        assert not missing, f"step {step} lacks {missing}"
        assert values["time/step_s"] > 0 and values["throughput/tokens_per_s"] > 0
        assert values["grad_norm"] >= 0
    assert_all_finite(pretrained.sft_metrics)


def test_lr_follows_warmup_then_linear_decay(pretrained: Pretrained):
    lrs = [pretrained.sft_metrics[s]["lr"] for s in sorted(pretrained.sft_metrics)]
    # warmup_steps 5, peak 3e-3, 60 steps: step 1 is 1/6 of the peak, step 6 is the peak, then linear to 0
    assert lrs[0] == pytest.approx(3e-3 / 6)
    assert lrs[5] == pytest.approx(3e-3)
    assert lrs[-1] == pytest.approx(3e-3 * (1 - 54 / 55))
    assert all(a >= b for a, b in itertools.pairwise(lrs[5:]))


def test_eval_every(tmp_path):
    spec = make_spec("sft", hyperparameters={"max_steps": 5, "eval_every": 2}, eval_dataset=EVAL_DATASETS["sft"])
    _, rec = train(spec, tmp_path / "job")
    assert [s for s in sorted(rec.metrics) if "eval/loss" in rec.metrics[s]] == [2, 4, 5]


@pytest.mark.parametrize("accumulation", [2, 4])
def test_gradient_accumulation_gives_the_same_update(tmp_path, deterministic, accumulation):
    """batch 8 in one micro-batch and in ``accumulation`` micro-batches: same losses, same weights."""
    runs = {}
    for steps in (1, accumulation):
        # adam_eps 1e-6: with the default 1e-8, Adam's first step turns rounding noise in near-zero
        # gradients into weight differences of a few 1e-6 (update ≈ lr·g/|g|); 1e-6 keeps them below 3e-7
        hyperparameters = {"max_steps": 2, "batch_size": 8, "gradient_accumulation_steps": steps, "adam_eps": 1e-6}
        spec = make_spec("sft", hyperparameters=hyperparameters)
        _, rec = train(spec, tmp_path / f"acc{steps}")
        runs[steps] = (rec, load_weights(final_model_dir(tmp_path / f"acc{steps}")))
    (rec1, weights1), (rec_n, weights_n) = runs[1], runs[accumulation]
    for step in (1, 2):
        assert rec_n.metrics[step]["loss/sft"] == pytest.approx(rec1.metrics[step]["loss/sft"], rel=1e-5)
        assert rec_n.metrics[step]["grad_norm"] == pytest.approx(rec1.metrics[step]["grad_norm"], rel=1e-4)
    assert weights1.keys() == weights_n.keys()
    for name in weights1:
        assert_close(weights_n[name], weights1[name], atol=1e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    # and the weights did move (the invariant is not trivially true)
    initial = make_spec("sft", hyperparameters={"max_steps": 1, "learning_rate": 1e-9})
    train(initial, tmp_path / "initial")
    moved = load_weights(final_model_dir(tmp_path / "initial"))
    assert not torch.allclose(moved["transformer.h.0.mlp.c_fc.weight"], weights1["transformer.h.0.mlp.c_fc.weight"])


def test_checkpoint_layout_and_job_file(tmp_path):
    out = tmp_path / "job"
    spec = make_spec("sft", hyperparameters={"max_steps": 5}, checkpoint_every=2, keep_checkpoints=2)
    result, rec = train(spec, out)
    assert result.status == "succeeded" and result.step == 5
    assert result.checkpoint == out / "checkpoints" / "step-5"
    # written at steps 2, 4 and the final 5; retention keeps the newest two
    assert [s for s, _ in rec.checkpoints] == [2, 4, 5]
    entries = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert entries == ["step-4", "step-5"], entries  # no leftover temporary .step-* folders either

    job = json.loads((out / JOB_FILE).read_text())
    assert job["status"] == "succeeded"
    assert job["final_step"] == 5
    assert job["type"] == "sft"

    final = out / "checkpoints" / "step-5"
    assert (final / STATE_FILE).is_file()
    state = torch.load(final / STATE_FILE, weights_only=False)
    assert state["step"] == 5
    assert {"optimizer", "scheduler", "rng"} <= set(state)

    policy = final / "policy"
    assert list(policy.glob("*.safetensors")), "weights must be safetensors"
    model = AutoModelForCausalLM.from_pretrained(policy)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    saved = load_weights(policy)
    for name, tensor in model.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    ids = tokenizer("we watched the film and it was", return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape[-1] >= len(tokenizer) and torch.isfinite(logits).all()


def test_retention_keeps_newest_only(tmp_path):
    out = tmp_path / "job"
    spec = make_spec("sft", hyperparameters={"max_steps": 6}, checkpoint_every=1, keep_checkpoints=3)
    _, rec = train(spec, out)
    assert [s for s, _ in rec.checkpoints] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4", "step-5", "step-6"]
    assert not list(out.rglob(".step-*"))
