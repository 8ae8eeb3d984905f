"""Training-health alerts (MOSS-RLHF's collapse signals): the collapse monitor on hand-made metric sequences, and
a real PPO run driven into collapse that warns, pauses before its anomalous step, or fails."""

import json
import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.core.health import CollapseMonitor, TrainingCollapseError
from engine.spec.config import JobSpec, PPOConfig
from tests.engine.helpers import Pretrained, make_spec, train
from tests.recorder import Recorder

# The builtin demo's PPO (python -m engine.cli demo: 40 steps of 64 prompts, lr 3e-5, kl_coef 0.05): a healthy
# run whose reward and KL climb steadily, with the odd noisy step (KL 2.141 at step 35).
DEMO = {
    "objective/scores": [
        -0.6846, -0.678, -0.1053, 0.8642, 1.055, 1.336, 2.119, 1.431, 2.128, 2.526, 3.86, 3.495, 3.119, 3.893,
        4.814, 4.257, 5.04, 5.144, 4.928, 5.15, 4.918, 5.04, 5.194, 5.428, 5.207, 5.668, 5.55, 6.019, 5.539,
        5.586, 5.203, 5.784, 5.602, 5.456, 5.995, 5.06, 5.896, 5.464, 5.401, 5.856,
    ],
    "objective/kl": [
        -3.8e-07, 0.002425, -0.003757, 0.05816, 0.1319, 0.1053, 0.1626, 0.04752, 0.2529, 0.2649, 0.4368, 0.4805,
        0.432, 0.5815, 0.7677, 0.6647, 0.9131, 0.949, 0.9816, 0.9516, 0.9924, 1.246, 1.214, 1.401, 1.219, 1.107,
        1.252, 1.566, 1.304, 1.438, 1.263, 1.527, 1.508, 1.37, 2.141, 1.235, 1.629, 1.431, 1.214, 1.499,
    ],
    "response/perplexity": [
        2.663, 2.42, 2.49, 2.511, 2.437, 2.498, 2.584, 2.559, 2.589, 2.603, 2.524, 2.491, 2.615, 2.449, 2.477,
        2.53, 2.61, 2.506, 2.538, 2.548, 2.52, 2.621, 2.602, 2.573, 2.596, 2.565, 2.487, 2.479, 2.513, 2.597,
        2.615, 2.54, 2.555, 2.504, 2.589, 2.663, 2.483, 2.622, 2.607, 2.511,
    ],
    "response/length_mean": [
        12.92, 12.38, 11.62, 13.55, 13.81, 12.36, 13.62, 12.73, 13.78, 14.28, 13.67, 14.42, 14.41, 15.02, 15.23,
        14.5, 15.05, 15.39, 15.66, 15.05, 15.14, 15.97, 15.97, 16.88, 16.09, 15.84, 16.5, 16.83, 16.23, 15.8,
        16.52, 16.67, 16.77, 16.64, 17.5, 16.23, 17.42, 16.17, 15.97, 17.05,
    ],
}  # fmt: skip
MAX_LENGTH = 24


def healthy(step: int, rng: random.Random) -> dict[str, float]:
    """A noisy but healthy step: reward and KL rising slowly, perplexity and length steady."""
    return {
        "objective/scores": 0.05 * step + rng.gauss(0, 0.3),
        "objective/kl": 0.02 * step + abs(rng.gauss(0, 0.1)),
        "response/perplexity": 2.5 + rng.gauss(0, 0.1),
        "response/length_mean": 12 + rng.gauss(0, 1.0),
        "time/step_s": rng.uniform(0.1, 10.0),  # never read: it differs between the ranks of a job
    }


def demo_steps() -> list[dict[str, float]]:
    return [{name: values[i] for name, values in DEMO.items()} for i in range(len(DEMO["objective/kl"]))]


def feed(monitor: CollapseMonitor, steps: list[dict[str, float]], first: int = 1) -> list[tuple[int, str]]:
    return [(alert.step, alert.signal) for i, m in enumerate(steps) for alert in monitor.update(first + i, m)]


def test_the_demo_run_and_a_noisy_healthy_run_raise_nothing() -> None:
    assert feed(CollapseMonitor(max_length=MAX_LENGTH), demo_steps()) == []
    rng = random.Random(0)
    assert feed(CollapseMonitor(max_length=MAX_LENGTH), [healthy(s, rng) for s in range(1, 301)]) == []


@pytest.mark.parametrize(
    ("signal", "change"),
    [
        ("reward_jump", {"objective/scores": 15.0}),  # the demo climbs from -0.7 to 3.9 in steps 1-14
        ("kl_jump", {"objective/kl": 6.0}),
        ("perplexity_collapse", {"response/perplexity": 1.2}),
        ("length_blowup", {"response/length_mean": 21.0}),
        ("length_blowup", {"response/length_mean": float(MAX_LENGTH)}),
    ],
)
def test_each_signal_fires_on_its_pattern_at_its_step(signal: str, change: dict[str, float]) -> None:
    steps = demo_steps()[:20]
    steps[14] = steps[14] | change  # step 15
    alerts = CollapseMonitor(max_length=MAX_LENGTH).update
    fired = [(s, a.signal) for s, m in enumerate(steps, 1) for a in alerts(s, m)]
    assert fired[:1] == [(15, signal)]
    assert all(s == 15 or s > 15 for s, _ in fired) and {name for _, name in fired} == {signal}


def test_an_alert_carries_step_value_baseline_and_a_message() -> None:
    monitor = CollapseMonitor()
    for step in range(1, 7):
        assert monitor.update(step, {"objective/kl": 1.0 + 0.01 * step}) == []
    (alert,) = monitor.update(7, {"objective/kl": 20.0})
    assert alert.data() == {"alert": "kl_jump", "step": 7, "value": 20.0, "baseline": pytest.approx(1.035)}
    assert "step 7" in alert.message and "KL" in alert.message and "20" in alert.message


def test_nothing_is_judged_during_the_warm_up() -> None:
    jump = {"objective/scores": 50.0, "objective/kl": 40.0, "response/perplexity": 1.01, "response/length_mean": 24}
    calm = {"objective/scores": 0.0, "objective/kl": 2.0, "response/perplexity": 3.0, "response/length_mean": 10}
    # 3 calm steps, then the jump at step 4: only 3 steps of history, warm-up 4
    assert feed(CollapseMonitor(warmup=4, max_length=24), [calm] * 3 + [jump]) == []
    assert {s for s, _ in feed(CollapseMonitor(warmup=3, max_length=24), [calm] * 3 + [jump])} == {4}


def test_small_kl_and_full_length_from_the_start_raise_nothing() -> None:
    # a KL jump below kl_min (early steps grow from 0); responses pinned at the maximum from the first step
    steps = [{"objective/kl": 0.01, "response/length_mean": 8.0}] * 8 + [{"objective/kl": 0.5}]
    assert feed(CollapseMonitor(max_length=8), steps) == []


def test_responses_near_the_cap_from_the_start_reaching_it_raise_nothing() -> None:
    # every step close to the maximum (a tiny model that rarely stops), then one step with all of them at it
    steps = [{"response/length_mean": 15.81 + 0.01 * (i % 3)} for i in range(10)] + [{"response/length_mean": 16.0}]
    assert feed(CollapseMonitor(max_length=16), steps) == []


def test_a_threshold_of_none_turns_its_signal_off() -> None:
    steps = demo_steps()[:20]
    steps[14] = steps[14] | {"objective/kl": 6.0, "objective/scores": 15.0}
    assert feed(CollapseMonitor(kl_factor=None, reward_z=None), steps) == []


def test_state_round_trips_and_the_restored_monitor_decides_alike() -> None:
    steps = demo_steps()
    steps[25] = steps[25] | {"objective/kl": 9.0, "response/perplexity": 1.1}  # step 26
    straight = CollapseMonitor(max_length=MAX_LENGTH)
    expected = feed(straight, steps)
    assert expected[:2] == [(26, "kl_jump"), (26, "perplexity_collapse")]

    first = CollapseMonitor(max_length=MAX_LENGTH)
    feed(first, steps[:20])
    state = json.loads(json.dumps(first.state_dict()))  # plain data
    resumed = CollapseMonitor(max_length=MAX_LENGTH)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == first.state_dict()
    assert feed(resumed, steps[20:], first=21) == expected
    assert resumed.state_dict() == straight.state_dict()


def test_config_fields_are_validated() -> None:
    assert PPOConfig().collapse.action == "warn"
    with pytest.raises(ValidationError, match=r"warmup \(11\) must be at most window \(10\)"):
        PPOConfig.model_validate({"collapse": {"warmup": 11, "window": 10}})
    with pytest.raises(ValidationError):
        PPOConfig.model_validate({"collapse": {"action": "explode"}})
    with pytest.raises(ValidationError):
        PPOConfig.model_validate({"collapse": {"perplexity_ratio": 1.5}})
    with pytest.raises(ValidationError, match=r"collapse\.bogus"):
        PPOConfig.model_validate({"collapse": {"bogus": 1}})
    with pytest.raises(ValueError, match="warmup"):
        CollapseMonitor(window=3, warmup=4)


FLAT = {
    "on_collapse": ("action", "pause"),
    "collapse_window": ("window", 8),
    "collapse_warmup": ("warmup", 3),
    "collapse_reward_z": ("reward_z", None),
    "collapse_kl_factor": ("kl_factor", 2.0),
    "collapse_kl_min": ("kl_min", 1.0),
    "collapse_perplexity_ratio": ("perplexity_ratio", 0.25),
    "collapse_length_factor": ("length_factor", 3.0),
}


def test_the_flat_names_of_the_collapse_settings_are_moved_into_the_group() -> None:
    flat = PPOConfig.model_validate({name: value for name, (_, value) in FLAT.items()})
    nested = PPOConfig.model_validate({"collapse": dict(FLAT.values())})
    assert flat == nested and flat.collapse.model_dump() == dict(FLAT.values())
    assert "on_collapse" not in flat.model_dump() and flat.model_dump()["collapse"]["action"] == "pause"
    # flat and nested settings mix, each setting given once
    mixed = PPOConfig.model_validate({"collapse_window": 8, "collapse": {"warmup": 3}})
    assert (mixed.collapse.window, mixed.collapse.warmup, mixed.collapse.action) == (8, 3, "warn")
    with pytest.raises(ValidationError, match="warmup"):  # the warmup ≤ window check sees the flat names too
        PPOConfig.model_validate({"collapse_warmup": 11, "collapse_window": 10})
    with pytest.raises(ValidationError):
        PPOConfig.model_validate({"on_collapse": "explode"})


@pytest.mark.parametrize("flat", list(FLAT))
def test_a_collapse_setting_given_flat_and_nested_is_an_error(flat) -> None:
    name, value = FLAT[flat]
    with pytest.raises(ValidationError, match=rf"{flat} and collapse\.{name} are the same setting"):
        PPOConfig.model_validate({flat: value, "collapse": {name: value}})


def test_a_stored_spec_holds_the_group_and_reads_back_alike() -> None:
    spec = make_spec("ppo", reward_model="job:rm", hyperparameters={"on_collapse": "stop", "collapse_kl_min": 2.0})
    stored = spec.model_dump(mode="json")
    assert not any(key.startswith(("on_collapse", "collapse_")) for key in stored["hyperparameters"])
    assert stored["hyperparameters"]["collapse"]["action"] == "stop"
    assert stored["hyperparameters"]["collapse"]["kl_min"] == 2.0
    assert JobSpec.model_validate(stored).config == spec.config


# --- a real PPO run driven into collapse ------------------------------------------------------------------------

WARMUP = 5
"""Critic-only steps: the policy is frozen (a calm history), then trains with no KL penalty at a high rate."""


def collapsing_spec(pretrained: Pretrained, on_collapse: str, total_steps: int = 10):
    return make_spec(
        "ppo",
        model=pretrained.sft,
        reward_model=pretrained.rm,
        hyperparameters={
            "total_steps": total_steps,
            "batch_size": 16,
            "mini_batch_size": 8,
            "response_length": 12,
            "learning_rate": 3e-3,
            "lr_scheduler": "constant",
            "kl_coef": 0.0,
            "missing_eos_penalty": 0.0,
            "critic_warmup_steps": WARMUP,
            "collapse": {"action": on_collapse},
        },
        checkpoint_every=2,
    )


def alerts_of(rec: Recorder) -> list[dict[str, object]]:
    return [data for kind, _, data in rec.events if kind == "warning" and data and "alert" in data]


def checkpoint_steps(out: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (out / "checkpoints").glob("step-*"))


def test_a_collapsing_run_warns_and_trains_on(tmp_path, pretrained) -> None:
    result, rec = train(collapsing_spec(pretrained, "warn", total_steps=WARMUP + 2), tmp_path / "job")
    assert result.status == "succeeded" and result.step == WARMUP + 2
    alerts = alerts_of(rec)
    assert alerts, f"no collapse alert; KL per step: {rec.series('objective/kl')}"
    first = min(int(a["step"]) for a in alerts)  # type: ignore[call-overload]
    assert first > WARMUP, "the calm critic-only steps raise nothing"
    assert "kl_jump" in {a["alert"] for a in alerts if a["step"] == first}
    for a in alerts:
        assert a.keys() == {"alert", "step", "value", "baseline"}
        assert a["value"] == pytest.approx(rec.metrics[int(a["step"])][METRIC[str(a["alert"])]])  # type: ignore[call-overload]
    messages = [m for kind, m, data in rec.events if kind == "warning" and data and data.get("step") == first]
    assert any(f"step {first}" in m and "KL" in m for m in messages)


METRIC = {
    "reward_jump": "objective/scores",
    "kl_jump": "objective/kl",
    "perplexity_collapse": "response/perplexity",
    "length_blowup": "response/length_mean",
}


@pytest.mark.parametrize("on_collapse", ["pause", "stop"])
def test_a_collapse_pauses_or_stops_before_checkpointing_its_step(tmp_path, pretrained, on_collapse) -> None:
    out = tmp_path / "job"
    spec = collapsing_spec(pretrained, on_collapse)
    rec = Recorder()
    if on_collapse == "stop":
        with pytest.raises(TrainingCollapseError, match="training collapse at step"):
            train(spec, out, rec)
    else:
        result, _ = train(spec, out, rec)
        assert result.status == "paused"
    alerts = alerts_of(rec)
    assert alerts
    step = int(alerts[0]["step"])  # type: ignore[call-overload]
    assert {int(a["step"]) for a in alerts} == {step}, "the job ends at its first alert"  # type: ignore[call-overload]
    assert max(rec.metrics) == step, "the anomalous step's metrics are reported"
    # the newest checkpoint is from before the anomaly, on disk and as reported
    assert step not in checkpoint_steps(out)
    assert checkpoint_steps(out) and max(checkpoint_steps(out)) < step
    assert [s for s, _ in rec.checkpoints] == [s for s in range(2, step, 2)]
    if on_collapse == "pause":
        newest = max(checkpoint_steps(out))
        assert result.step == step and result.checkpoint == out / "checkpoints" / f"step-{newest}"
        assert ("info", {"step": step, "checkpoint_step": newest}) in [(kind, data) for kind, _, data in rec.events]


def test_a_resumed_job_keeps_its_history_and_warns_alike(tmp_path, pretrained) -> None:
    """Paused at step 3 and resumed: without its restored history the warm-up would hide the alert at step 7."""
    spec = collapsing_spec(pretrained, "warn", total_steps=WARMUP + 2)
    _, straight = train(spec, tmp_path / "straight")
    out = tmp_path / "resumed"
    paused, first = train(spec, out, Recorder(stop_after=3, stop="pause"))
    assert paused.status == "paused" and paused.step == 3
    resumed, second = train(spec, out)
    assert resumed.status == "succeeded" and second.starts == [(3, WARMUP + 2)]
    assert alerts_of(straight), "the straight run warns"
    assert alerts_of(first) + alerts_of(second) == alerts_of(straight)
