"""GRPO end to end (engine/methods/grpo_train.py): group sampling, learning on the verifiable digits task, the reward
sources giving the same curve (a rule, a Python function, an HTTP service on loopback), every estimator, exact
resume, gradient accumulation, LoRA on a Llama with chat prompts, a reward model, and the reward faults."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.builtin import digits
from engine.callbacks import VllmSettings
from engine.core.data import encode_prompts, load_rows
from engine.core.generate import sample
from engine.core.models import load_causal_lm, load_tokenizer, resolve_model_ref
from engine.core.vllm import VllmServer
from engine.demo import TASKS, evaluate_policy
from engine.rewards.graders import RewardFunctionError, RewardServiceError
from engine.spec.config import K1_LOSS_TERM_WARNING, JobSpec
from tests.engine.helpers import (
    COMMON_METRICS,
    Pretrained,
    assert_all_finite,
    assert_same_update,
    final_model_dir,
    is_timing,
    load_weights,
    train,
)
from tests.models import build_model, chat_rows, write_jsonl
from tests.recorder import Recorder
from tests.reward_service import RuleService

GRPO_METRICS = (
    *COMMON_METRICS,
    "reward/mean",
    "reward/std",
    "objective/kl",
    "groups/tied_fraction",
    "loss/policy",
    "loss/kl",
    "policy/clipfrac",
    "policy/approxkl",
    "response/length_mean",
    "response/eos_fraction",
    "time/rollout_s",
    "time/train_s",
)
EVAL_PROMPTS = 96


def grpo_spec(model: str | Path, *, hyperparameters: dict[str, Any] | None = None, **fields: Any) -> JobSpec:
    """A validated grpo spec on the digits task, rewarded by its rule: 8 prompts × 4 samples, 2 steps."""
    data: dict[str, Any] = {
        "type": "grpo",
        "model": str(model),
        "dataset": "builtin:digits-prompts",
        "reward": digits.GRADER,
        "hyperparameters": {
            "total_steps": 2,
            "batch_size": 8,
            "group_size": 4,
            "mini_batch_size": 16,
            "response_length": 4,
            "learning_rate": 5e-4,
            **(hyperparameters or {}),
        },
        "seed": 0,
        "checkpoint_every": 1000,
    }
    data.update(fields)
    return JobSpec.model_validate(data)


@pytest.fixture(scope="module")
def eval_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rows = load_rows("builtin:digits-prompts-eval", "prompts")[:EVAL_PROMPTS]
    return write_jsonl(rows, tmp_path_factory.mktemp("digits-data") / "prompts-eval.jsonl")


# 1. ---------------------------------------------------------------------------------------------------------


def test_group_sampling_prefills_each_prompt_once_and_samples_as_repeated_prompts() -> None:
    tokenizer = load_tokenizer("builtin:tiny")
    model = load_causal_lm("builtin:tiny", tokenizer, 0).eval()
    prompts = ["4 7 2 : last =", "we watched the film and it was", "1 2 3 : first ="]
    queries, mask = encode_prompts(tokenizer, prompts, 32)
    batch_sizes: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: batch_sizes.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    grouped = sample(model, queries, mask, 6, 1.0, generator=torch.Generator().manual_seed(3), group_size=4)
    hook.remove()
    assert batch_sizes[0] == (3, queries.shape[1])  # the prompts, once each
    assert all(shape == (12, 1) for shape in batch_sizes[1:])  # then one token per sample
    repeated = sample(
        model,
        queries.repeat_interleave(4, 0),
        mask.repeat_interleave(4, 0),
        6,
        1.0,
        generator=torch.Generator().manual_seed(3),
    )
    assert torch.equal(grouped[0], repeated[0])
    torch.testing.assert_close(grouped[1], repeated[1])


# 2. ---------------------------------------------------------------------------------------------------------


LEARNING_STEPS = 30


def learning_spec(digits_sft: Path, eval_prompts: Path, **hyperparameters: Any) -> JobSpec:
    return grpo_spec(
        digits_sft,
        eval_dataset=str(eval_prompts),
        hyperparameters={
            "total_steps": LEARNING_STEPS,
            "batch_size": 32,
            "group_size": 8,
            "mini_batch_size": 64,
            "learning_rate": 1e-3,  # the demo's 5e-4: 0.24 → 0.36-0.55 in one thread
            "eval_every": 15,
            **hyperparameters,
        },
    )


@pytest.fixture(scope="module")
def digits_learning(digits_sft: Path, eval_prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[
    float, Recorder
]:  # fmt: skip
    """The SFT policy's held-out accuracy, and the built-in sampler's GRPO run from it (30 steps)."""
    result, rec = train(learning_spec(digits_sft, eval_prompts), tmp_path_factory.mktemp("grpo") / "grpo")
    assert (result.status, result.step) == ("succeeded", LEARNING_STEPS)
    rows = load_rows(str(eval_prompts), "prompts")
    sft_dir = resolve_model_ref(str(digits_sft))
    return evaluate_policy(sft_dir, sft_dir, None, rows, TASKS["digits"]).success, rec


def assert_learns(before: float, rec: Recorder) -> float:
    """Held-out accuracy up by 0.15 at least, and the reward of the last 5 steps above the first 5's: the final
    accuracy."""
    after = rec.metrics[LEARNING_STEPS]["eval/reward"]
    assert after >= before + 0.15, (before, after)
    first = sum(rec.metrics[s]["reward/mean"] for s in range(1, 6)) / 5
    last = sum(rec.metrics[s]["reward/mean"] for s in range(LEARNING_STEPS - 4, LEARNING_STEPS + 1)) / 5
    assert last > first + 0.1, (first, last)
    return after


def test_grpo_raises_held_out_accuracy_on_the_digits_task(digits_learning: tuple[float, Recorder]) -> None:
    before, rec = digits_learning
    assert sorted(rec.metrics) == list(range(1, LEARNING_STEPS + 1))
    for step, values in rec.metrics.items():
        assert set(GRPO_METRICS) | {"reward/correct"} <= set(values), step
    assert_all_finite(rec.metrics)
    assert set(rec.metrics[15]) >= {"eval/reward", "eval/reward/correct", "eval/length_mean"}
    assert_learns(before, rec)


def test_on_vllm_grpo_learns_as_it_does_on_the_builtin_sampler(
    digits_learning: tuple[float, Recorder], digits_sft: Path, eval_prompts: Path, tiny_vllm: VllmServer, tmp_path
) -> None:
    """The same job with its rollouts (and its held-out evaluation) sampled by vLLM, weights synced every step:
    the same gain, and a final accuracy within the runs' noise of the built-in sampler's (the demo's seeds spread
    over 0.2)."""
    before, builtin = digits_learning
    spec = learning_spec(digits_sft, eval_prompts, rollout_engine="vllm")
    result, rec = train(spec, tmp_path / "grpo", Recorder(vllm=VllmSettings(server=tiny_vllm)))
    assert (result.status, result.step) == ("succeeded", LEARNING_STEPS)
    assert max(rec.series("rollout/sync_gap")) < 1e-3
    after = assert_learns(before, rec)
    on_builtin = builtin.metrics[LEARNING_STEPS]["eval/reward"]
    print(f"digits held-out accuracy: {before:.3f} before; after 30 steps {on_builtin:.3f} built-in, {after:.3f} vLLM")
    assert abs(after - on_builtin) <= 0.2


# 3. ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def rule_service() -> Iterator[RuleService]:
    service = RuleService()
    yield service
    service.close()


def http_grader(url: str, **fields: Any) -> dict[str, Any]:
    return {"type": "http", "name": "correct", "url": url, "label": "{{item.answer}}", "backoff_s": 0.01, **fields}


def test_a_rule_a_function_and_a_service_give_the_same_curve(
    digits_sft: Path, rule_service: RuleService, tmp_path, deterministic
) -> None:
    rewards = {
        "string_check": digits.GRADER,
        "python": {"type": "python", "name": "correct", "function": "engine.builtin.digits:exact_match"},
        "http": http_grader(rule_service.url, batch_size=20),
    }
    curves, weights = {}, {}
    for kind, reward in rewards.items():
        result, rec = train(grpo_spec(digits_sft, reward=reward), tmp_path / kind)  # 2 steps: step 2 samples the update
        assert result.status == "succeeded"
        curves[kind] = {s: {k: v for k, v in m.items() if not is_timing(k)} for s, m in rec.metrics.items()}
        weights[kind] = load_weights(final_model_dir(tmp_path / kind))
    assert curves["python"] == curves["string_check"]
    assert curves["http"] == curves["string_check"]
    assert 0 < curves["string_check"][1]["reward/correct"] < 1
    for kind in ("python", "http"):
        assert all(torch.equal(weights[kind][k], weights["string_check"][k]) for k in weights[kind])
    assert rule_service.requests == 2 * 2  # 32 samples a step, in batches of 20


# 4. ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("estimator", "options"),
    [
        ("grpo", {}),
        ("grpo", {"kl_in_reward": True, "kl_estimator": "k1", "loss_aggregation": "sequence_mean"}),
        ("dr_grpo", {"num_iterations": 2, "cliprange_high": 0.28}),
        ("rloo", {"kl_estimator": "k2"}),
        ("reinforce_pp", {"group_size": 1, "batch_size": 16}),
        ("reinforce_pp_baseline", {}),
    ],
)
def test_every_estimator_trains(digits_sft: Path, tmp_path, estimator: str, options: dict[str, Any]) -> None:
    spec = grpo_spec(digits_sft, hyperparameters={"advantage_estimator": estimator, **options})
    result, rec = train(spec, tmp_path / "job")
    assert (result.status, result.step) == ("succeeded", 2)
    assert_all_finite(rec.metrics)
    assert rec.metrics[1]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # step 1 samples the reference itself
    kl_in_reward = spec.config.kl_as_reward  # type: ignore[attr-defined]
    assert (rec.metrics[2]["loss/kl"] == 0.0) == kl_in_reward
    # the first update moved the policy (k1, the mean log-ratio, may come out either side of 0)
    assert abs(rec.metrics[2]["objective/kl"]) > 1e-6
    if options.get("num_iterations") == 2:  # the second pass is off-policy: ratios leave 1
        assert rec.metrics[2]["policy/approxkl"] > 0


def test_the_kl_in_the_reward_is_k1(digits_sft: Path, tmp_path) -> None:
    """reinforce_pp puts the KL in the reward, estimated by k1 (its policy gradient is the KL's): ``objective/kl``
    is then the mean summed log-ratio of the samples, as each logged sample's ``kl`` is (all 32 logged here)."""
    hyperparameters = {"advantage_estimator": "reinforce_pp", "log_samples": 32, "log_samples_every": 1}
    result, rec = train(grpo_spec(digits_sft, hyperparameters=hyperparameters), tmp_path / "job")
    assert result.status == "succeeded"
    kls = [sample["kl"] for sample in rec.samples[2]]
    assert len(kls) == 32 and any(abs(kl) > 1e-4 for kl in kls)  # the first update moved the policy
    assert rec.metrics[2]["objective/kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-5, abs=1e-7)
    assert rec.metrics[2]["loss/kl"] == 0.0  # no loss term
    assert not any(data and data.get("reason") == "k1_loss_term" for _, _, data in rec.events)


def test_k1_as_a_loss_term_warns_when_the_job_starts(tmp_path) -> None:
    hyperparameters = {"total_steps": 1, "kl_in_reward": False, "kl_estimator": "k1"}
    result, rec = train(grpo_spec("builtin:tiny", hyperparameters=hyperparameters), tmp_path / "job")
    assert result.status == "succeeded"
    warned = [(message, data) for kind, message, data in rec.events if kind == "warning"]
    assert (K1_LOSS_TERM_WARNING, {"reason": "k1_loss_term"}) in warned
    assert "expectation under π is 0" in K1_LOSS_TERM_WARNING and "use k3" in K1_LOSS_TERM_WARNING


def test_without_kl_no_reference_is_used(digits_sft: Path, tmp_path) -> None:
    result, rec = train(grpo_spec(digits_sft, hyperparameters={"kl_coef": 0.0}), tmp_path / "job")
    assert result.status == "succeeded"
    assert rec.metrics[2]["objective/kl"] == 0.0 and rec.metrics[2]["loss/kl"] == 0.0


def test_torch_compile_gives_the_eager_update(digits_sft: Path, tmp_path) -> None:
    """The policy's compiled training forward and backward make the eager one's update, up to fused rounding."""
    runs = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        spec = grpo_spec(digits_sft, hyperparameters={"total_steps": 1, "torch_compile": compiled})
        result, runs[name] = train(spec, tmp_path / name)
        assert result.status == "succeeded"
    eager, compiled_run = runs["eager"].metrics[1], runs["compiled"].metrics[1]
    assert compiled_run["reward/mean"] == eager["reward/mean"]  # the same rollout
    for name in ("loss/policy", "loss/kl", "policy/approxkl"):
        assert compiled_run[name] == pytest.approx(eager[name], rel=1e-4, abs=1e-6), name
    assert_same_update(final_model_dir(digits_sft), final_model_dir(tmp_path / "eager"),
                       final_model_dir(tmp_path / "compiled"))  # fmt: skip


def test_rollout_correction_with_an_exact_sampler_makes_the_uncorrected_update(digits_sft: Path, tmp_path) -> None:
    """On the CPU the sampler computes the training pass's numbers: with ``rollout_correction`` the trainer's
    recomputed log-probs are the sampler's up to rounding (``rollout/logprob_gap`` ~0), no weight reaches the cap,
    and the run moves the weights as the uncorrected one does (two passes: the second is off-policy)."""
    runs = {}
    for name, cap in (("plain", None), ("corrected", 2.0)):
        hyperparameters = {"num_iterations": 2, "rollout_correction": cap}
        result, runs[name] = train(grpo_spec(digits_sft, hyperparameters=hyperparameters), tmp_path / name)
        assert (result.status, result.step) == ("succeeded", 2)
    for step in (1, 2):
        corrected, plain = runs["corrected"].metrics[step], runs["plain"].metrics[step]
        assert corrected["rollout/logprob_gap"] < 1e-5
        assert corrected["rollout/correction_capped_fraction"] == 0.0
        assert "rollout/logprob_gap" not in plain and "rollout/correction_capped_fraction" not in plain
        assert corrected["reward/mean"] == plain["reward/mean"]  # the same samples
        for metric in ("loss/policy", "loss/kl", "policy/approxkl", "objective/kl"):
            assert corrected[metric] == pytest.approx(plain[metric], rel=1e-3, abs=1e-6), (step, metric)
    assert_same_update(final_model_dir(digits_sft), final_model_dir(tmp_path / "plain"),
                       final_model_dir(tmp_path / "corrected"))  # fmt: skip


# 5. ---------------------------------------------------------------------------------------------------------


def test_pause_and_resume_matches_an_uninterrupted_run(digits_sft: Path, tmp_path, deterministic) -> None:
    spec = grpo_spec(digits_sft, hyperparameters={"total_steps": 4})
    straight, reference = train(spec, tmp_path / "straight")
    paused, first = train(spec, tmp_path / "resumed", Recorder(stop_after=2, stop="pause"))
    assert (paused.status, paused.step) == ("paused", 2)
    resumed, second = train(spec, tmp_path / "resumed")
    assert (straight.status, resumed.status, second.starts) == ("succeeded", "succeeded", [(2, 4)])
    got = first.metrics | second.metrics
    for step in range(1, 5):
        expected = {k: v for k, v in reference.metrics[step].items() if not is_timing(k)}
        assert {k: v for k, v in got[step].items() if not is_timing(k)} == expected, step
    a, b = load_weights(final_model_dir(tmp_path / "straight")), load_weights(final_model_dir(tmp_path / "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gradient_accumulation_gives_the_same_update(digits_sft: Path, tmp_path, deterministic) -> None:
    runs = {}
    for steps in (1, 4):
        hyperparameters = {"gradient_accumulation_steps": steps, "adam_eps": 1e-3, "loss_aggregation": "sequence_mean"}
        result, rec = train(grpo_spec(digits_sft, hyperparameters=hyperparameters), tmp_path / f"acc{steps}")
        assert result.status == "succeeded"
        runs[steps] = (rec.metrics, load_weights(final_model_dir(tmp_path / f"acc{steps}")))
    (m1, w1), (m4, w4) = runs[1], runs[4]
    for name in ("reward/mean", "loss/policy", "loss/kl", "grad_norm", "objective/kl"):
        assert m4[2][name] == pytest.approx(m1[2][name], rel=1e-4, abs=1e-6), name
    for name in w1:
        torch.testing.assert_close(w4[name], w1[name], atol=1e-5, rtol=0)


# 6. ---------------------------------------------------------------------------------------------------------


def mentions_positive(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """A reward function in TRL's form for chat prompts: 1.0 when the assistant's reply has a positive word."""
    assert all(isinstance(p, list) for p in prompts) and columns["mood"] == ["positive"] * len(prompts)
    return [float(any(w in c[0]["content"] for w in ("great", "good", "fun"))) for c in completions]


def test_lora_on_a_llama_with_chat_prompts_and_a_reward_function(tmp_path: Path) -> None:
    llama = build_model("llama", tmp_path / "llama")
    rows = [{**row, "mood": "positive"} for row in chat_rows("prompts", 8)]
    data = write_jsonl(rows, tmp_path / "prompts.jsonl")
    spec = grpo_spec(
        llama,
        dataset=str(data),
        reward={"type": "python", "function": "tests.engine.test_grpo_train:mentions_positive"},
        lora={"r": 4, "alpha": 8},
        hyperparameters={"response_length": 8},
    )
    result, rec = train(spec, tmp_path / "job")
    assert (result.status, result.step) == ("succeeded", 2)
    assert rec.metrics[1]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # the reference: adapters off
    assert "reward/python" in rec.metrics[1]
    assert (tmp_path / "job" / "checkpoints" / "step-2" / "adapters" / "policy").is_dir()


def test_a_reward_model_scores_reviews(pretrained: Pretrained, tmp_path: Path) -> None:
    spec = JobSpec.model_validate(
        {
            "type": "grpo",
            "model": str(pretrained.sft),
            "reward_model": str(pretrained.rm),
            "dataset": "builtin:reviews-prompts",
            "eval_dataset": "builtin:reviews-prompts-eval",
            "eval_reward": {"type": "python", "name": "truth", "function": "tests.engine.test_grpo_train:is_positive"},
            "hyperparameters": {
                "total_steps": 2,
                "batch_size": 4,
                "group_size": 4,
                "mini_batch_size": 16,
                "response_length": 12,
                "eval_max_prompts": 8,
            },
            "checkpoint_every": 1000,
        }
    )
    result, rec = train(spec, tmp_path / "job")
    assert result.status == "succeeded"
    assert rec.metrics[1]["reward/std"] > 0
    assert rec.metrics[1]["reward/reward_model"] == rec.metrics[1]["reward/mean"]
    assert 0 <= rec.metrics[2]["eval/reward/truth"] <= 1 and "eval/reward/reward_model" not in rec.metrics[2]


def is_positive(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    from engine.builtin import reviews

    return [float(reviews.is_positive(c)) for c in completions]


# 7. ---------------------------------------------------------------------------------------------------------


def test_a_dead_reward_service_fails_the_job_and_keeps_the_newest_checkpoint(digits_sft: Path, tmp_path) -> None:
    service = RuleService(fail_after=3)
    try:
        spec = grpo_spec(
            digits_sft,
            reward=http_grader(service.url, retries=2),
            hyperparameters={"total_steps": 6},
            checkpoint_every=2,
        )
        with pytest.raises(RewardServiceError, match=r"reward service http://127\.0\.0\.1:\d+/score failed after 3"):
            train(spec, tmp_path / "job")
    finally:
        service.close()
    assert sorted(p.name for p in (tmp_path / "job" / "checkpoints").iterdir()) == ["step-2"]


def raises_on_seven(prompts: list[str], completions: list[str], answer: list[str], **columns: Any) -> list[float]:
    for prompt in prompts:
        if prompt.startswith("7 "):
            raise ZeroDivisionError("no sevens")
    return [1.0] * len(prompts)


def test_a_reward_function_that_raises_names_itself_and_the_row(digits_sft: Path, tmp_path) -> None:
    spec = grpo_spec(
        digits_sft,
        reward={"type": "python", "function": "tests.engine.test_grpo_train:raises_on_seven"},
        hyperparameters={"total_steps": 6},
    )
    with pytest.raises(RewardFunctionError, match=r"tests\.engine\.test_grpo_train:raises_on_seven.*row \d+.*'7 "):
        train(spec, tmp_path / "job")
