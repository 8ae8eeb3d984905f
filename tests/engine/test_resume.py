"""Pause, resume and cancel: an interrupted and resumed job ends exactly like an uninterrupted one."""

import json
from pathlib import Path

import pytest
import torch

from engine.core.checkpoint import JOB_FILE
from engine.spec.config import JobSpec
from tests.engine.helpers import EVAL_DATASETS, Pretrained, is_timing, load_weights, make_spec, ppo_spec, train
from tests.recorder import Recorder

MODELS = {"sft": ("policy",), "rm": ("policy",), "ppo": ("policy", "value")}


def _spec(job_type: str, pretrained: Pretrained) -> JobSpec:
    if job_type == "ppo":
        # adaptive KL and score normalisation put controller state into the checkpoint too
        return ppo_spec(
            pretrained.sft, pretrained.rm, total_steps=6, adaptive_kl=True, kl_horizon=100, normalize_scores=True
        )
    if job_type == "rm":
        return make_spec(
            "rm", model=pretrained.sft, hyperparameters={"eval_every": 2}, eval_dataset=EVAL_DATASETS["rm"]
        )
    # warm-up and a linear decay, so the schedule's position matters too
    hyperparameters = {"warmup_steps": 2, "eval_every": 2}
    return make_spec("sft", hyperparameters=hyperparameters, eval_dataset=EVAL_DATASETS["sft"])


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys()
    different = [name for name in wa if not torch.equal(wa[name], wb[name])]
    assert not different, f"{len(different)} tensors differ after resume, e.g. {different[:3]}"


@pytest.mark.parametrize("job_type", ["sft", "rm", "ppo"])
def test_pause_and_resume_matches_an_uninterrupted_run(tmp_path, deterministic, pretrained, job_type):
    spec = _spec(job_type, pretrained)

    straight_result, straight = train(spec, tmp_path / "straight")
    assert straight_result.status == "succeeded" and straight_result.step == 6

    out = tmp_path / "resumed"
    paused_result, first = train(spec, out, Recorder(stop_after=3, stop="pause"))
    assert paused_result.status == "paused"
    assert paused_result.step == 3
    assert sorted(first.metrics) == [1, 2, 3]
    assert paused_result.checkpoint == out / "checkpoints" / "step-3"
    assert (out / "checkpoints" / "step-3" / "trainer_state.pt").is_file()
    assert [s for s, _ in first.checkpoints] == [3]
    assert not (out / JOB_FILE).exists(), "a paused job is not finished"

    resumed_result, second = train(spec, out)
    assert resumed_result.status == "succeeded" and resumed_result.step == 6
    assert second.starts == [(3, 6)]
    assert any(kind == "info" and "resumed from step 3" in message for kind, message, _ in second.events)
    assert sorted(second.metrics) == [4, 5, 6]

    for name in MODELS[job_type]:
        _assert_same_weights(
            tmp_path / "straight" / "checkpoints" / "step-6" / name, out / "checkpoints" / "step-6" / name
        )

    resumed_metrics = first.metrics | second.metrics
    for step in range(1, 7):
        expected, got = _without_timing(straight.metrics[step]), _without_timing(resumed_metrics[step])
        assert got.keys() == expected.keys()
        different = {k: (expected[k], got[k]) for k in expected if got[k] != expected[k]}
        assert not different, f"step {step} metrics differ after resume (straight, resumed): {different}"
    assert json.loads((out / JOB_FILE).read_text())["final_step"] == 6


def _without_timing(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not is_timing(k)}


def test_cancel_stops_without_checkpoint(tmp_path):
    out = tmp_path / "job"
    spec = make_spec("sft", hyperparameters={"max_steps": 6}, checkpoint_every=2)
    result, rec = train(spec, out, Recorder(stop_after=3, stop="cancel"))
    assert result.status == "cancelled"
    assert result.step == 3
    assert sorted(rec.metrics) == [1, 2, 3]
    # the regular checkpoint of step 2 stays; none is written for the cancelled step
    assert [s for s, _ in rec.checkpoints] == [2]
    assert result.checkpoint == out / "checkpoints" / "step-2"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    job_file = out / JOB_FILE
    assert not job_file.exists() or json.loads(job_file.read_text())["status"] != "succeeded"


def test_cancel_before_any_checkpoint(tmp_path):
    out = tmp_path / "job"
    result, rec = train(make_spec("sft", hyperparameters={"max_steps": 6}), out, Recorder(stop_after=1, stop="cancel"))
    assert result.status == "cancelled" and result.step == 1
    assert result.checkpoint is None and rec.checkpoints == []
    assert not list(out.glob("checkpoints/step-*"))
    assert not (out / JOB_FILE).exists()


def test_stop_is_not_asked_after_the_last_step(tmp_path):
    """A pause requested at the final step cannot leave the job paused: it finishes."""
    result, rec = train(make_spec("sft", hyperparameters={"max_steps": 3}), tmp_path / "job", Recorder(stop_after=3))
    assert result.status == "succeeded"
    assert rec.stop_requests == []


def test_resuming_a_finished_job_does_nothing(tmp_path):
    out = tmp_path / "job"
    spec = make_spec("sft", hyperparameters={"max_steps": 3})
    first_result, _ = train(spec, out)
    assert first_result.status == "succeeded"
    final = out / "checkpoints" / "step-3"
    before = {p: p.stat().st_mtime_ns for p in final.rglob("*")}
    job_before = (out / JOB_FILE).read_text()

    again, rec = train(spec, out)
    assert again.status == "succeeded"
    assert again.step == 3
    assert rec.metrics == {}, "no step may run again"
    assert rec.checkpoints == []
    assert rec.starts == [(3, 3)]
    assert {p: p.stat().st_mtime_ns for p in final.rglob("*")} == before
    assert (out / JOB_FILE).read_text() == job_before
