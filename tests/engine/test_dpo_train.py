"""DPO end to end (engine/methods/dpo_train.py) from the session's SFT model: metrics, learning, the saved policy, exact
resume against the starting model as reference, gradient accumulation, LoRA (the reference is the policy with
its adapters off), the loss variants, a Llama with chat preference rows, and the spec's refusals.

At step 1 the policy is the reference, so every implicit reward is 0 and each loss has a known value: log 2
(sigmoid, with or without label smoothing), 1 (hinge), (1/(2β))² (ipo).
"""

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.core.data import load_rows
from engine.core.loop import JobResult
from engine.core.ops import logprobs_from_logits
from engine.methods.dpo import sequence_logps
from engine.methods.dpo_train import encode_preference_batch
from engine.spec.config import JobSpec
from tests.engine.helpers import (
    COMMON_METRICS,
    Pretrained,
    assert_all_finite,
    final_model_dir,
    is_timing,
    load_weights,
    train,
)
from tests.models import build_model, chat_rows, write_jsonl
from tests.recorder import Recorder

PAIR_METRICS = (
    "loss/dpo",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
DPO_METRICS = (*COMMON_METRICS, *PAIR_METRICS)
EVAL_METRICS = tuple(f"eval/{name}" for name in PAIR_METRICS)
LOG2 = math.log(2)
BETA = 0.1
STEPS = 6
EVAL_EVERY = 3
EVAL_PAIRS = 64
LORA = {"r": 4, "alpha": 8}


def dpo_spec(
    model: str | Path,
    *,
    dataset: str | Path = "builtin:reviews-prefs",
    hyperparameters: dict[str, Any] | None = None,
    **fields: Any,
) -> JobSpec:
    """A validated dpo spec with small settings (batch 8, 2 steps, lr 1e-3, β 0.1); ``hyperparameters`` override."""
    return JobSpec.model_validate(
        {
            "type": "dpo",
            "model": str(model),
            "dataset": str(dataset),
            "hyperparameters": {
                "batch_size": 8,
                "max_steps": 2,
                "learning_rate": 1e-3,
                "beta": BETA,
                **(hyperparameters or {}),
            },
            "seed": 0,
            "checkpoint_every": 1000,
            **fields,
        }
    )


def main_spec(sft: Path, eval_dataset: Path) -> JobSpec:
    return dpo_spec(sft, hyperparameters={"max_steps": STEPS, "eval_every": EVAL_EVERY}, eval_dataset=str(eval_dataset))


def assert_every_metric(metrics: dict[int, dict[str, float]], steps: int) -> None:
    assert sorted(metrics) == list(range(1, steps + 1))
    for step, values in metrics.items():
        missing = set(DPO_METRICS) - set(values)
        assert not missing, f"step {step} lacks {missing}"
    assert_all_finite(metrics)


def assert_policy_is_reference_at_step_1(metrics: dict[str, float], loss: float = LOG2) -> None:
    assert metrics["loss/dpo"] == pytest.approx(loss, abs=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert metrics[name] == pytest.approx(0.0, abs=1e-6), name


@pytest.fixture(scope="module")
def eval_prefs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first EVAL_PAIRS pairs of builtin:reviews-prefs-eval (evaluating all 400 would dominate the runs)."""
    rows = load_rows("builtin:reviews-prefs-eval", "preference")[:EVAL_PAIRS]
    return write_jsonl(rows, tmp_path_factory.mktemp("dpo-data") / "prefs-eval.jsonl")


@pytest.fixture(scope="module")
def straight(
    pretrained: Pretrained, eval_prefs: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, JobResult, Recorder]:
    """6 uninterrupted DPO steps from the session's SFT model (deterministic algorithms, for the resume test)."""
    out = tmp_path_factory.mktemp("dpo") / "straight"
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        result, recorder = train(main_spec(pretrained.sft, eval_prefs), out)
    finally:
        torch.use_deterministic_algorithms(was)
    return out, result, recorder


# 1. ---------------------------------------------------------------------------------------------------------


def test_dpo_learns_the_preferences_and_reports_every_metric(straight) -> None:
    _, result, rec = straight
    assert (result.status, result.step) == ("succeeded", STEPS)
    assert_every_metric(rec.metrics, STEPS)
    m = rec.metrics
    for step, values in m.items():
        assert values["lr"] > 0 and values["grad_norm"] > 0
        assert values["time/step_s"] > 0 and values["throughput/tokens_per_s"] > 0
        assert 0.0 <= values["rewards/accuracies"] <= 1.0
        assert values["logps/chosen"] < 0 and values["logps/rejected"] < 0
        margin = values["rewards/chosen"] - values["rewards/rejected"]
        assert values["rewards/margins"] == pytest.approx(margin, abs=1e-6), step
    # eval when due: every EVAL_EVERY steps (and the last)
    assert [s for s in sorted(m) if "eval/loss/dpo" in m[s]] == [EVAL_EVERY, STEPS]
    for step in (EVAL_EVERY, STEPS):
        assert set(EVAL_METRICS) <= set(m[step])

    # step 1: the policy is the reference, every implicit reward 0 and no pair ranked right
    assert_policy_is_reference_at_step_1(m[1])
    assert m[1]["rewards/accuracies"] == 0.0
    # then the chosen completions gain on the rejected ones
    losses, accuracies = rec.series("loss/dpo"), rec.series("rewards/accuracies")
    assert all(loss < LOG2 for loss in losses[1:]), losses
    assert sum(losses[-3:]) / 3 < LOG2 - 0.05, losses
    assert sum(accuracies[1:]) / (STEPS - 1) > 0.6, accuracies
    assert all(margin > 0 for margin in rec.series("rewards/margins")[1:])
    # held out likewise: from log 2 and no pair ranked right (policy == reference) to most pairs ranked right
    first, last = m[EVAL_EVERY], m[STEPS]
    assert last["eval/loss/dpo"] < first["eval/loss/dpo"] < LOG2
    assert last["eval/rewards/margins"] > first["eval/rewards/margins"] > 0
    assert last["eval/rewards/accuracies"] >= first["eval/rewards/accuracies"] > 0.6


def test_eval_rewards_are_the_saved_policy_against_the_sft_model(
    straight, pretrained: Pretrained, eval_prefs: Path
) -> None:
    """eval/ metrics recomputed with plain transformers: the saved final policy against the starting model."""
    out, _, rec = straight
    policy_dir, sft_dir = final_model_dir(out), final_model_dir(pretrained.sft)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    rows = load_rows(str(eval_prefs), "preference")
    assert len(rows) == EVAL_PAIRS
    logps: dict[Path, list[torch.Tensor]] = {policy_dir: [], sft_dir: []}
    for path, parts in logps.items():
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        for i in range(0, len(rows), 32):
            batch = encode_preference_batch(tokenizer, rows[i : i + 32], 128)
            mask = batch["attention_mask"]
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"], attention_mask=mask).logits
            token_logps = logprobs_from_logits(logits[:, :-1], batch["input_ids"][:, 1:])
            parts.append(sequence_logps(token_logps, batch["labels"]).view(2, -1))
    policy, sft = torch.cat(logps[policy_dir], 1), torch.cat(logps[sft_dir], 1)  # (2, pairs): chosen, rejected
    rewards = BETA * (policy - sft)
    final = rec.metrics[STEPS]
    assert final["eval/logps/chosen"] == pytest.approx(policy[0].mean().item(), rel=1e-4)
    assert final["eval/logps/rejected"] == pytest.approx(policy[1].mean().item(), rel=1e-4)
    assert final["eval/rewards/chosen"] == pytest.approx(rewards[0].mean().item(), rel=1e-3, abs=1e-5)
    assert final["eval/rewards/rejected"] == pytest.approx(rewards[1].mean().item(), rel=1e-3, abs=1e-5)
    assert final["eval/rewards/accuracies"] == pytest.approx((rewards[0] > rewards[1]).float().mean().item())


def test_the_final_policy_loads_and_generates_with_plain_transformers(straight, pretrained: Pretrained) -> None:
    out, result, _ = straight
    policy = final_model_dir(out)
    assert result.checkpoint == out / "checkpoints" / f"step-{STEPS}" and policy.parent == result.checkpoint
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    tokenizer = AutoTokenizer.from_pretrained(policy)
    ids = tokenizer("we watched the film and it was", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(
            **ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id, min_new_tokens=6
        )
    assert generated.shape == (1, ids["input_ids"].shape[1] + 6)
    assert tokenizer.decode(generated[0, ids["input_ids"].shape[1] :])
    # the policy trained; the reference it was measured against is the SFT model, which stays as it was
    trained, sft = load_weights(policy), load_weights(final_model_dir(pretrained.sft))
    assert trained.keys() == sft.keys()
    assert not torch.equal(trained["transformer.h.0.mlp.c_fc.weight"], sft["transformer.h.0.mlp.c_fc.weight"])


# 2. ---------------------------------------------------------------------------------------------------------


def test_pause_and_resume_matches_an_uninterrupted_run(
    straight, pretrained: Pretrained, eval_prefs: Path, tmp_path, deterministic
) -> None:
    """Resumed from step 3, the reference is still the SFT model (not the checkpoint): a wrong reference would
    show in every reward and loss of steps 4 to 6 and in the step-6 eval."""
    straight_dir, _, reference = straight
    spec = main_spec(pretrained.sft, eval_prefs)
    out = tmp_path / "resumed"
    paused, first = train(spec, out, Recorder(stop_after=3, stop="pause"))
    assert (paused.status, paused.step, first.checkpoint_steps()) == ("paused", 3, [3])
    resumed, second = train(spec, out)
    assert (resumed.status, resumed.step, second.starts) == ("succeeded", STEPS, [(3, STEPS)])
    assert any(kind == "info" and "resumed from step 3" in message for kind, message, _ in second.events)
    assert sorted(second.metrics) == [4, 5, 6]

    a, b = load_weights(final_model_dir(straight_dir)), load_weights(final_model_dir(out))
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} tensors differ after resume, e.g. {different[:3]}"
    got = first.metrics | second.metrics
    for step in range(1, STEPS + 1):
        expected = {k: v for k, v in reference.metrics[step].items() if not is_timing(k)}
        values = {k: v for k, v in got[step].items() if not is_timing(k)}
        assert values.keys() == expected.keys()
        differ = {k: (expected[k], values[k]) for k in expected if values[k] != expected[k]}
        assert not differ, f"step {step} metrics differ after resume (straight, resumed): {differ}"


# 3. ---------------------------------------------------------------------------------------------------------


def test_gradient_accumulation_gives_the_same_update(pretrained: Pretrained, tmp_path, deterministic) -> None:
    """Batch 8 in one micro-batch and in two (padded separately): the same losses, rewards and weights up to
    float rounding. The SFT term is normalised by the whole batch's chosen tokens, not each micro-batch's.
    adam_eps 1e-3 keeps Adam's first steps close to linear in the gradient (see test_rm.py)."""
    runs = {}
    for steps in (1, 2):
        hyperparameters = {"gradient_accumulation_steps": steps, "adam_eps": 1e-3, "sft_loss_coef": 0.5}
        out = tmp_path / f"acc{steps}"
        result, rec = train(dpo_spec(pretrained.sft, hyperparameters=hyperparameters), out)
        assert result.status == "succeeded"
        runs[steps] = (rec.metrics, load_weights(final_model_dir(out)))
    (m1, w1), (m2, w2) = runs[1], runs[2]
    for step in (1, 2):
        for name in (*PAIR_METRICS, "grad_norm"):
            assert m2[step][name] == pytest.approx(m1[step][name], rel=1e-5, abs=1e-6), (step, name)
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    initial = load_weights(final_model_dir(pretrained.sft))
    assert not torch.equal(w1["transformer.h.0.mlp.c_fc.weight"], initial["transformer.h.0.mlp.c_fc.weight"])


# 4. ---------------------------------------------------------------------------------------------------------


def test_lora_reference_is_the_adapter_disabled_policy(pretrained: Pretrained, eval_prefs: Path, tmp_path) -> None:
    out = tmp_path / "lora"
    spec = dpo_spec(
        pretrained.sft,
        hyperparameters={"max_steps": 3, "learning_rate": 1e-2, "eval_every": 3},
        eval_dataset=str(eval_prefs),
        lora=LORA,
    )
    result, rec = train(spec, out)
    assert (result.status, result.step) == ("succeeded", 3)
    assert_every_metric(rec.metrics, 3)
    # fresh adapters are zero: at step 1 the policy is its adapter-disabled self; after an update it is not
    assert_policy_is_reference_at_step_1(rec.metrics[1])
    assert rec.metrics[3]["rewards/margins"] != 0 and rec.metrics[3]["eval/rewards/margins"] != 0

    step_dir = out / "checkpoints" / "step-3"
    adapters = load_file(step_dir / "adapters" / "policy" / "adapter_model.safetensors")
    assert adapters and all("lora_" in key for key in adapters)
    assert any(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)  # B starts at 0: it trained
    # the merged policy: only adapted (linear) weights moved; embeddings and layer norms are the SFT model's
    merged, sft = load_weights(step_dir / "policy"), load_weights(final_model_dir(pretrained.sft))
    assert set(sft) <= set(merged) and not any("lora" in key for key in merged)  # (+ the tied lm_head)
    for name in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"):
        assert torch.equal(merged[name], sft[name]), name
    assert not torch.equal(merged["transformer.h.0.attn.c_attn.weight"], sft["transformer.h.0.attn.c_attn.weight"])
    model = AutoModelForCausalLM.from_pretrained(step_dir / "policy").eval()
    tokenizer = AutoTokenizer.from_pretrained(step_dir / "policy")
    ids = tokenizer("the film was", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**ids, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    assert generated.shape[1] == ids["input_ids"].shape[1] + 3


# 5. ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "step1_loss"),
    [
        ({"loss_type": "ipo"}, (1 / (2 * BETA)) ** 2),  # (h - 1/(2β))² at h = 0
        ({"loss_type": "hinge"}, 1.0),  # relu(1 - βh) at h = 0
        ({"label_smoothing": 0.2}, LOG2),  # -(1-ε)·log σ(0) - ε·log σ(0)
        ({"sft_loss_coef": 0.5}, None),  # log 2 + 0.5 × the chosen completions' per-token NLL
    ],
    ids=["ipo", "hinge", "label_smoothing", "sft_loss_coef"],
)
def test_loss_variants(pretrained: Pretrained, tmp_path, options: dict[str, Any], step1_loss: float | None) -> None:
    spec = dpo_spec(pretrained.sft, hyperparameters={"batch_size": 4, **options})
    result, rec = train(spec, tmp_path / "job")
    assert result.status == "succeeded"
    assert_every_metric(rec.metrics, 2)
    if step1_loss is not None:
        assert_policy_is_reference_at_step_1(rec.metrics[1], step1_loss)
    else:
        # larger than the same step without the SFT term (log 2: policy == reference), by a per-token NLL of a
        # trained SFT model: positive, and well below a uniform guess over the vocabulary
        for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert rec.metrics[1][name] == pytest.approx(0.0, abs=1e-6)
        nll = (rec.metrics[1]["loss/dpo"] - LOG2) / options["sft_loss_coef"]
        assert 0.05 < nll < math.log(1000), nll
    assert rec.metrics[2]["rewards/margins"] != 0


# 6. ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("llama") / "model")


@pytest.mark.parametrize("kind", ["preference", "preference_implicit"])
def test_a_llama_trains_on_chat_preference_rows(llama: Path, tmp_path: Path, kind: str) -> None:
    data = write_jsonl(chat_rows(kind, 8), tmp_path / "prefs.jsonl")
    eval_data = write_jsonl(chat_rows(kind, 4, seed=1), tmp_path / "prefs-eval.jsonl")
    spec = dpo_spec(llama, dataset=data, eval_dataset=str(eval_data), hyperparameters={"batch_size": 4})
    result, rec = train(spec, tmp_path / "job")
    assert (result.status, result.step) == ("succeeded", 2)
    assert_every_metric(rec.metrics, 2)
    assert_policy_is_reference_at_step_1(rec.metrics[1])
    assert set(EVAL_METRICS) <= set(rec.metrics[2])
    model = AutoModelForCausalLM.from_pretrained(final_model_dir(tmp_path / "job"))
    assert type(model).__name__ == "LlamaForCausalLM"


# 7. ---------------------------------------------------------------------------------------------------------


def test_label_smoothing_is_for_the_sigmoid_loss_only() -> None:
    with pytest.raises(ValidationError, match="label_smoothing"):
        dpo_spec("builtin:tiny", hyperparameters={"loss_type": "ipo", "label_smoothing": 0.1})
    with pytest.raises(ValidationError, match="label_smoothing"):
        dpo_spec("builtin:tiny", hyperparameters={"loss_type": "hinge", "label_smoothing": 0.1})
    assert dpo_spec("builtin:tiny", hyperparameters={"label_smoothing": 0.1}).config.label_smoothing == 0.1
    assert dpo_spec("builtin:tiny", hyperparameters={"loss_type": "ipo"}).config.loss_type == "ipo"


def test_a_reward_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="reward_model applies to ppo, grpo and distill jobs only, not dpo"):
        dpo_spec("builtin:tiny", reward_model=str(tmp_path / "rm"))


@pytest.mark.parametrize("field", ["dataset", "eval_dataset"])
def test_a_prompts_dataset_is_refused(field: str) -> None:
    with pytest.raises(ValidationError, match="reviews-prompts holds prompts rows, but a preference dataset is needed"):
        dpo_spec("builtin:tiny", **{field: "builtin:reviews-prompts"})
    with pytest.raises(ValidationError, match="preference"):
        dpo_spec("builtin:tiny", **{field: "builtin:reviews-sft"})
