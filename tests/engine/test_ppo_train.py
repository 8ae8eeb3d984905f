"""PPO end to end from the session's SFT model and reward model: learning, metrics, options."""

import pytest
import torch
from torch.testing import assert_close

from tests.engine.helpers import (
    PPO_METRICS,
    Pretrained,
    assert_all_finite,
    assert_same_update,
    final_model_dir,
    load_weights,
    make_spec,
    ppo_spec,
    train,
)


def _run(tmp_path, pretrained: Pretrained, name: str = "job", **hyperparameters):
    result, rec = train(ppo_spec(pretrained.sft, pretrained.rm, **hyperparameters), tmp_path / name)
    assert result.status == "succeeded"
    assert sorted(rec.metrics) == list(range(1, result.step + 1))
    assert_all_finite(rec.metrics)
    return result, rec


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_ppo_raises_the_reward(tmp_path, pretrained):
    _, rec = _run(
        tmp_path,
        pretrained,
        total_steps=10,
        batch_size=16,
        mini_batch_size=8,
        response_length=16,
        learning_rate=3e-4,
        lr_scheduler="constant",
    )
    scores = rec.series("objective/scores")
    assert _mean(scores[-3:]) > _mean(scores[:3]) + 0.5, scores
    # the policy moved away from the reference while doing so
    assert rec.metrics[10]["objective/kl"] > 0


def test_every_ppo_metric_every_step(tmp_path, pretrained):
    _, rec = _run(tmp_path, pretrained, total_steps=3)
    for step, values in rec.metrics.items():
        missing = set(PPO_METRICS) - set(values)
        assert not missing, f"step {step} lacks {missing}"
        assert "loss/ptx" not in values  # only with a ptx dataset
        assert 0 <= values["response/eos_fraction"] <= 1
        assert 1 <= values["response/length_mean"] <= 8
        assert 0 <= values["policy/clipfrac"] <= 1 and 0 <= values["val/clipfrac"] <= 1
        assert values["policy/approxkl"] >= 0 and values["response/perplexity"] >= 1
        assert values["objective/kl_coef"] == 0.05  # fixed controller
        assert values["objective/rlhf_reward"] == pytest.approx(
            values["objective/scores"] + values["objective/non_score_reward"]
        )
        assert values["time/step_s"] == pytest.approx(values["time/rollout_s"] + values["time/train_s"])
    assert rec.warnings() == []  # no early stop without target_approxkl
    # step 1 samples from the policy that is also the reference: the k1 KL is exactly 0
    assert rec.metrics[1]["objective/kl"] == pytest.approx(0.0, abs=1e-5)
    assert rec.metrics[1]["objective/non_score_reward"] == pytest.approx(0.0, abs=1e-5)


def test_training_forward_matches_the_rollout(tmp_path, pretrained):
    """Before any real update the PPO ratio is exactly 1: the training forward sees the same tokens, positions,
    mask and temperature as the rollout did (a mismatch shows up as approx-KL and clipping at step 1)."""
    _, rec = _run(tmp_path, pretrained, total_steps=1, learning_rate=1e-12, temperature=0.7, ppo_epochs=2)
    first = rec.metrics[1]
    assert first["policy/approxkl"] < 1e-10
    assert first["policy/clipfrac"] == 0
    assert first["val/clipfrac"] == 0


def test_rollout_correction_reports_the_sync_check(tmp_path, pretrained):
    """With ``rollout_correction`` the rollout takes the trainer's log-probs again: on the CPU they are the
    sampler's up to rounding, so the gap is about 0 and no token's weight reaches the cap."""
    _, rec = _run(tmp_path, pretrained, total_steps=2, rollout_correction=2.0)
    for metrics in rec.metrics.values():
        assert metrics["rollout/logprob_gap"] < 1e-5
        assert metrics["rollout/correction_capped_fraction"] == 0.0


def test_value_model_checkpointed_next_to_policy(tmp_path, pretrained):
    _run(tmp_path, pretrained, total_steps=1)
    policy, value = final_model_dir(tmp_path / "job"), final_model_dir(tmp_path / "job", "value")
    assert "transformer.wte.weight" in load_weights(policy) and "score.weight" not in load_weights(policy)
    assert "score.weight" in load_weights(value)
    # the critic starts as the reward model and is trained
    rm_weights = load_weights(final_model_dir(pretrained.rm))
    assert not torch.equal(load_weights(value)["score.weight"], rm_weights["score.weight"])


def test_adaptive_kl_changes_the_coefficient(tmp_path, pretrained):
    _, rec = _run(tmp_path, pretrained, total_steps=3, adaptive_kl=True, kl_target=1.0, kl_horizon=20)
    coefs = rec.series("objective/kl_coef")
    # KL is ~0 at first, far below the target: β shrinks by (1 - 0.2·8/20) per step. Each step logs the β its
    # rewards were computed with (the first step's is the initial one), so β × KL is the non-score reward.
    assert coefs[0] == 0.05 and coefs[1] == pytest.approx(0.05 * (1 - 0.2 * 8 / 20))
    assert len(set(coefs)) == 3
    for kl_coef, kl, non_score in zip(coefs, rec.series("objective/kl"), rec.series("objective/non_score_reward"),
                                      strict=True):  # fmt: skip
        assert non_score == pytest.approx(-kl_coef * kl, rel=1e-5, abs=1e-8)


@pytest.mark.parametrize(
    ("options", "expected_returns_mean"),
    [
        ({}, "raw"),  # returns = the raw score
        ({"normalize_scores": True}, 0.0),  # first batch normalised by its own mean and std
        ({"normalize_scores": True, "score_clip": 0.5}, "clipped"),
        ({"score_clip": 0.01}, "clipped"),
    ],
)
def test_score_shaping(tmp_path, pretrained, options, expected_returns_mean):
    """Step 1 isolates the score: KL to the reference is 0 (up to rounding), every response is full length (no
    stop token), and with λ = γ = 1 the return of every token is its sequence's shaped score, so returns/mean is
    their mean."""
    _, rec = _run(tmp_path, pretrained, total_steps=2, stop_token=None, lam=1.0, response_length=6, **options)
    first = rec.metrics[1]
    assert first["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # sampled vs full-forward logprobs: rounding
    if expected_returns_mean == "raw":
        assert first["returns/mean"] == pytest.approx(first["objective/scores"], abs=1e-5)
    elif expected_returns_mean == "clipped":
        clip = options["score_clip"]
        assert abs(first["returns/mean"]) <= clip + 1e-6
        assert abs(first["objective/scores"]) > clip  # objective/scores stays the raw score
    else:
        assert first["returns/mean"] == pytest.approx(expected_returns_mean, abs=1e-5)
        assert abs(first["objective/scores"]) > 0.1


def test_entropy_bonus(tmp_path, pretrained):
    _, plain = _run(tmp_path, pretrained, "plain", total_steps=2)
    _, bonus = _run(tmp_path, pretrained, "bonus", total_steps=2, entropy_coef=0.1)
    # same rollout at step 1, but the bonus changes the updates after the first minibatch
    assert bonus.metrics[1]["objective/scores"] == plain.metrics[1]["objective/scores"]
    assert bonus.metrics[1]["loss/policy"] != plain.metrics[1]["loss/policy"]


def test_ptx_loss(tmp_path, pretrained):
    _, rec = _run(tmp_path, pretrained, total_steps=2, ptx_coef=0.5, ptx_dataset="builtin:reviews-sft")
    for values in rec.metrics.values():
        assert "loss/ptx" in values
        # the SFT model was trained on these rows: its completion loss is small but positive
        assert 0 < values["loss/ptx"] < 3


def test_critic_warmup_freezes_the_policy(tmp_path, pretrained):
    spec = ppo_spec(pretrained.sft, pretrained.rm, total_steps=3, critic_warmup_steps=2)
    spec = spec.model_copy(update={"checkpoint_every": 1, "keep_checkpoints": 10})
    out = tmp_path / "job"
    result, rec = train(spec, out)
    assert result.status == "succeeded"
    assert_all_finite(rec.metrics)
    sft = load_weights(final_model_dir(pretrained.sft))
    rm = load_weights(final_model_dir(pretrained.rm))
    for step in (1, 2):
        policy = load_weights(out / "checkpoints" / f"step-{step}" / "policy")
        different = [k for k in sft if not torch.equal(policy[k], sft[k])]
        assert not different, f"policy changed during critic warm-up at step {step}: {different[:3]}"
        value = load_weights(out / "checkpoints" / f"step-{step}" / "value")
        assert not torch.equal(value["score.weight"], rm["score.weight"]), "the critic trains during warm-up"
    policy = load_weights(out / "checkpoints" / "step-3" / "policy")
    assert any(not torch.equal(policy[k], sft[k]) for k in sft), "the policy trains after warm-up"


def test_target_approxkl_cuts_epochs_short(tmp_path, pretrained):
    _, rec = _run(tmp_path, pretrained, total_steps=2, target_approxkl=1e-9, learning_rate=3e-4)
    warnings = rec.warnings()
    assert warnings, "an early stop must be reported as a warning event"
    assert any("approx-KL" in w for w in warnings)


def test_no_stop_token_samples_full_length(tmp_path, pretrained):
    _, rec = _run(tmp_path, pretrained, total_steps=2, stop_token=None, response_length=6)
    for values in rec.metrics.values():
        assert values["response/length_mean"] == 6
        assert values["response/eos_fraction"] == 0


@pytest.mark.parametrize("accumulation", [2, 4])
def test_gradient_accumulation_gives_the_same_update(tmp_path, deterministic, pretrained, accumulation):
    runs = {}
    for steps in (1, accumulation):
        # adam_eps 1e-6: see tests/engine/test_sft.py (Adam's first step magnifies rounding noise)
        _, rec = _run(
            tmp_path,
            pretrained,
            f"acc{steps}",
            total_steps=1,
            batch_size=8,
            mini_batch_size=4,
            gradient_accumulation_steps=steps,
            learning_rate=1e-4,
            adam_eps=1e-6,
            entropy_coef=0.01,
            ptx_coef=0.5,
            ptx_dataset="builtin:reviews-sft",
        )
        runs[steps] = rec
    for name in ("loss/policy", "loss/value", "loss/ptx", "policy/clipfrac", "grad_norm", "objective/scores"):
        assert runs[accumulation].metrics[1][name] == pytest.approx(runs[1].metrics[1][name], rel=1e-4, abs=1e-7)
    for model in ("policy", "value"):
        w1 = load_weights(final_model_dir(tmp_path / "acc1", model))
        wn = load_weights(final_model_dir(tmp_path / f"acc{accumulation}", model))
        for name in w1:
            assert_close(wn[name], w1[name], atol=1e-6, rtol=0, msg=lambda m, key=f"{model}.{name}": f"{key}: {m}")
    # and the update is not trivially zero
    sft = load_weights(final_model_dir(pretrained.sft))
    w1 = load_weights(final_model_dir(tmp_path / "acc1"))
    assert any(not torch.equal(w1[k], sft[k]) for k in sft)


def test_sizes_beyond_the_model_context_fail_before_training(pretrained, tmp_path):
    # builtin:tiny has 128 positions.
    too_long = ppo_spec(pretrained.sft, pretrained.rm, max_prompt_length=120, response_length=16)
    with pytest.raises(ValueError, match="max_prompt_length \\+ response_length"):
        train(too_long, tmp_path / "ppo")
    sft = make_spec("sft", hyperparameters={"max_length": 256})
    with pytest.raises(ValueError, match="max_length"):
        train(sft, tmp_path / "sft")
    assert not (tmp_path / "ppo" / "checkpoints").exists()


def test_eval_dataset_reports_eval_metrics_without_changing_training(pretrained, tmp_path):
    plain = ppo_spec(pretrained.sft, pretrained.rm, total_steps=3)
    with_eval = plain.model_copy(
        update={
            "eval_dataset": "builtin:reviews-prompts-eval",
            "hyperparameters": {**plain.hyperparameters, "eval_every": 2, "eval_max_prompts": 16},
        }
    )
    _, rec_plain = train(plain, tmp_path / "plain")
    _, rec_eval = train(with_eval, tmp_path / "eval")
    assert sorted(s for s, m in rec_eval.metrics.items() if "eval/scores" in m) == [2, 3]
    assert all(k not in rec_plain.metrics[3] for k in ("eval/scores", "eval/kl", "eval/length_mean"))
    assert 1 <= rec_eval.metrics[3]["eval/length_mean"] <= 8
    # Evaluation samples from its own generator: the training trajectory is unchanged.
    for step in (1, 2, 3):
        assert rec_eval.metrics[step]["objective/scores"] == rec_plain.metrics[step]["objective/scores"]


def test_torch_compile_gives_the_eager_update(tmp_path, pretrained):
    """The compiled training forward and backward (policy and critic) make the eager one's update, up to the
    rounding of fused kernels: same rollout, same losses (the critic's too), the same change of the policy."""
    options = {"total_steps": 1, "batch_size": 8, "mini_batch_size": 4, "response_length": 8, "learning_rate": 1e-4}
    _, eager = _run(tmp_path, pretrained, "eager", **options)
    _, compiled = _run(tmp_path, pretrained, "compiled", torch_compile=True, **options)
    assert compiled.metrics[1]["objective/scores"] == eager.metrics[1]["objective/scores"]
    assert eager.metrics[1]["policy/approxkl"] > 0  # the second minibatch saw the first one's update
    for name in ("loss/policy", "loss/value", "objective/entropy", "policy/approxkl", "val/mean"):
        assert compiled.metrics[1][name] == pytest.approx(eager.metrics[1][name], rel=1e-4, abs=1e-6), name
    assert_same_update(final_model_dir(pretrained.sft), final_model_dir(tmp_path / "eager"),
                       final_model_dir(tmp_path / "compiled"))  # fmt: skip
