"""Reward model training from the session's SFT model: accuracy, metrics, options, saved format."""

import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from engine.core.data import load_rows
from engine.core.models import load_scalar_model, load_tokenizer, resolve_model_ref
from engine.methods.rm import encode_pairs, evaluate_pairs
from tests.engine.helpers import (
    RM_FIXTURE_STEPS,
    RM_METRICS,
    Pretrained,
    assert_all_finite,
    final_model_dir,
    load_weights,
    make_spec,
    train,
)

PAIRS = [
    {"prompt": "we watched the film and it was", "chosen": " wonderful . i loved it .", "rejected": " awful ."},
    {"prompt": "i streamed this drama and it was", "chosen": " great . highly recommended .", "rejected": " dull ."},
]


def test_reward_model_learns_preferences(pretrained: Pretrained):
    metrics = pretrained.rm_metrics
    evaluated = [s for s in sorted(metrics) if "eval/accuracy" in metrics[s]]
    assert evaluated == list(range(10, RM_FIXTURE_STEPS + 1, 10))
    final = metrics[RM_FIXTURE_STEPS]
    assert final["eval/accuracy"] >= 0.9, [metrics[s]["eval/accuracy"] for s in evaluated]
    assert final["eval/margin"] > 0
    assert metrics[RM_FIXTURE_STEPS]["loss/rm"] < 0.5 * metrics[1]["loss/rm"]
    first, last = metrics[1], [metrics[s] for s in range(RM_FIXTURE_STEPS - 4, RM_FIXTURE_STEPS + 1)]
    assert sum(m["rm/accuracy"] for m in last) / len(last) > first["rm/accuracy"]


def test_eval_metrics_match_an_independent_evaluation(pretrained: Pretrained):
    """eval/accuracy and eval/margin are what the saved model scores on the eval pairs."""
    path = resolve_model_ref(str(pretrained.rm))
    tokenizer = load_tokenizer(path)
    model = load_scalar_model(path, tokenizer, seed=0)

    rows = load_rows("builtin:reviews-prefs-eval", "rm")
    batches = [encode_pairs(tokenizer, rows[i : i + 64], 128) for i in range(0, len(rows), 64)]
    accuracy, margin = evaluate_pairs(model, batches)
    final = pretrained.rm_metrics[RM_FIXTURE_STEPS]
    assert accuracy == pytest.approx(final["eval/accuracy"], abs=1e-6)
    assert margin == pytest.approx(final["eval/margin"], rel=1e-4)


def test_every_rm_metric_every_step(pretrained: Pretrained):
    for step, values in pretrained.rm_metrics.items():
        missing = set(RM_METRICS) - set(values)
        assert not missing, f"step {step} lacks {missing}"
        assert 0.0 <= values["rm/accuracy"] <= 1.0
    assert_all_finite(pretrained.rm_metrics)


def test_margin_and_lm_loss_add_to_the_loss(tmp_path, sft_dir):
    """At step 1 (same pairs, same weights) a margin makes -log σ(Δ - m) larger; an LM loss adds a positive term."""
    losses = {}
    runs = {
        "plain": {},
        "margin": {"margin": 1.0},
        "lm": {"lm_loss_coef": 0.5},
        "both": {"margin": 1.0, "lm_loss_coef": 0.5},
    }
    for name, options in runs.items():
        result, rec = train(
            make_spec("rm", model=sft_dir, hyperparameters={"max_steps": 1, **options}), tmp_path / name
        )
        assert result.status == "succeeded"
        assert_all_finite(rec.metrics)
        losses[name] = rec.metrics[1]
    # the step-1 margins are read before the update, so they agree across options
    assert losses["margin"]["rm/margin"] == pytest.approx(losses["plain"]["rm/margin"], rel=1e-5)
    assert losses["lm"]["rm/margin"] == pytest.approx(losses["plain"]["rm/margin"], rel=1e-5)
    assert losses["margin"]["loss/rm"] > losses["plain"]["loss/rm"]
    # an LM loss of a trained SFT backbone through the tied embeddings is positive, well below a random model's
    lm_part = (losses["lm"]["loss/rm"] - losses["plain"]["loss/rm"]) / 0.5
    assert 0 < lm_part < math.log(1000)
    both = losses["both"]["loss/rm"] - losses["plain"]["loss/rm"]
    assert both == pytest.approx(losses["margin"]["loss/rm"] - losses["plain"]["loss/rm"] + 0.5 * lm_part, rel=1e-4)


@pytest.mark.parametrize("accumulation", [2, 4])
def test_gradient_accumulation_gives_the_same_update(tmp_path, deterministic, sft_dir, accumulation):
    """Micro-batches are encoded (padded) separately, so only float rounding may differ.

    adam_eps 1e-3 keeps Adam's first steps close to linear in the gradient: with a tiny eps, rounding noise
    in near-zero gradients becomes a full ±lr update (see test_sft.py).
    """
    runs = {}
    for steps in (1, accumulation):
        hyperparameters = {
            "max_steps": 2,
            "batch_size": 8,
            "gradient_accumulation_steps": steps,
            "learning_rate": 1e-2,
            "adam_eps": 1e-3,
            "lm_loss_coef": 0.5,
        }
        _, rec = train(make_spec("rm", model=sft_dir, hyperparameters=hyperparameters), tmp_path / f"acc{steps}")
        runs[steps] = (rec.metrics, load_weights(final_model_dir(tmp_path / f"acc{steps}")))
    (m1, w1), (mn, wn) = runs[1], runs[accumulation]
    for step in (1, 2):
        for name in ("loss/rm", "rm/accuracy", "rm/margin", "grad_norm"):
            # abs 1e-6 as for the weights: rm/margin, a difference of two rewards, keeps their absolute rounding
            # (one torch thread: 0.0184654 vs 0.0184650)
            assert mn[step][name] == pytest.approx(m1[step][name], rel=1e-5, abs=1e-6), (step, name)
    for name in w1:
        torch.testing.assert_close(wn[name], w1[name], atol=1e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    initial = load_weights(final_model_dir(sft_dir))
    assert not torch.equal(w1["transformer.h.0.mlp.c_fc.weight"], initial["transformer.h.0.mlp.c_fc.weight"])


def test_saved_reward_model_loads_with_plain_transformers(rm_dir):
    path = final_model_dir(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.num_labels == 1
    assert model.config.pad_token_id == tokenizer.pad_token_id
    saved = load_weights(path)
    assert "score.weight" in saved
    assert torch.equal(model.state_dict()["score.weight"], saved["score.weight"])

    # right-padded batch: plain transformers reads the score at the last non-pad token
    tokenizer.padding_side = "right"
    eos = tokenizer.eos_token  # training pairs end with EOS, where the reward is read
    texts = [p["prompt"] + p["chosen"] + eos for p in PAIRS] + [p["prompt"] + p["rejected"] + eos for p in PAIRS]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        scores = model(**inputs).logits.squeeze(-1)  # (4,)
    assert scores.shape == (4,) and torch.isfinite(scores).all()
    chosen, rejected = scores.chunk(2)
    assert (chosen > rejected).all(), scores
