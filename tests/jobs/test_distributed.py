"""One job in two processes (torchrun, gloo on the CPU) against the same job in one: SFT, the reward model and
DPO train to the same losses and weights with the same global batch, a pause and resume in two processes lands on
the same weights, a rank's failure or a callback's error ends the job as it would in one process, and a cancel
reaching rank 0 inside a reward call ends every rank."""

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine.callbacks import StopRequest
from engine.run import run_job
from engine.spec.config import JobSpec
from jobs.distributed import RankFailure, run_distributed
from tests.recorder import Recorder
from tests.reward_service import RuleService

TIMING = ("time/", "throughput/")
GLOBAL_BATCH = {"max_steps": 4, "batch_size": 8, "gradient_accumulation_steps": 2}


def spec(job_type: str, processes: int, **hyperparameters: Any) -> JobSpec:
    datasets = {"sft": "builtin:reviews-sft", "rm": "builtin:reviews-prefs", "dpo": "builtin:reviews-prefs"}
    return JobSpec.model_validate(
        {
            "type": job_type,
            "model": "builtin:tiny",
            "dataset": datasets[job_type],
            "hyperparameters": {**GLOBAL_BATCH, **hyperparameters},
            "seed": 5,
            "checkpoint_every": 2,
            "resources": {"num_processes": processes},
        }
    )


def one_process(job_type: str, out_dir: Path, **hyperparameters: Any) -> Recorder:
    recorder = Recorder()
    result = run_job(spec(job_type, 1, **hyperparameters), out_dir, recorder, torch.device("cpu"))
    assert (result.status, result.step) == ("succeeded", 4)
    return recorder


def assert_same_metrics(got: dict[int, dict[str, float]], expected: dict[int, dict[str, float]]) -> None:
    assert sorted(got) == sorted(expected)
    for step, metrics in expected.items():
        assert got[step]["dist/weight_spread"] == 0, f"the ranks' weights differ after step {step}"
        for name, value in metrics.items():
            if not name.startswith(TIMING):
                assert got[step][name] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, name)


def assert_same_weights(got: Path, expected: Path, lr: float) -> None:
    """Equal up to float rounding. Gradients summed in another order differ in their last bits, and AdamW
    normalises every gradient element: in a near-zero one (an attention key bias has none but rounding), that
    rounding can move the update by a sizeable part of it. So: no weight off by more than 5% of one update
    (``lr``), and all of them on average by less than 1e-4 of one (a batch split wrongly moves most weights by
    a good part of an update). AdamW hides a gradient's scale: the metrics compared alongside hold ``grad_norm``.
    """
    files = sorted((expected / "checkpoints" / "step-4" / "policy").glob("*.safetensors"))
    assert files
    total, count, largest = 0.0, 0, 0.0
    for file in files:
        a, b = load_file(got / "checkpoints" / "step-4" / "policy" / file.name), load_file(file)
        assert a.keys() == b.keys()
        for name in b:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0.05 * lr, msg=name)
            total, count = total + (a[name] - b[name]).abs().sum().item(), count + b[name].numel()
            largest = max(largest, (a[name] - b[name]).abs().max().item())
    print(f"weights of {got.name} against {expected.name}: largest difference {largest:.2e}, mean {total / count:.2e}")
    assert total / count < 1e-4 * lr


def test_sft_in_two_processes_trains_as_one_and_resumes_alike(tmp_path: Path) -> None:
    """Paused after step 2 and resumed, both times in two processes: the metrics and final weights of one
    process training on the same global batches without a pause."""
    reference = one_process("sft", tmp_path / "one")
    two = tmp_path / "two"

    first = Recorder(stop_after=2)
    paused = run_distributed(spec("sft", 2), two, first, 2)
    assert (paused.status, paused.step, first.checkpoint_steps()) == ("paused", 2, [2])
    second = Recorder()
    done = run_distributed(spec("sft", 2), two, second, 2)
    assert (done.status, done.step, second.checkpoint_steps(), second.starts) == ("succeeded", 4, [4], [(2, 4)])
    assert done.checkpoint == two / "checkpoints" / "step-4"

    assert_same_metrics({**first.metrics, **second.metrics}, reference.metrics)
    assert_same_weights(two, tmp_path / "one", lr=1e-3)


def test_reward_model_in_two_processes_trains_as_one(tmp_path: Path) -> None:
    """Pairwise loss, accuracy and margin gathered over the ranks; the LM loss normalised by the whole batch's
    tokens."""
    reference = one_process("rm", tmp_path / "one", lm_loss_coef=0.5)
    recorder = Recorder()
    result = run_distributed(spec("rm", 2, lm_loss_coef=0.5), tmp_path / "two", recorder, 2)
    assert (result.status, result.step, recorder.checkpoint_steps()) == ("succeeded", 4, [2, 4])
    assert_same_metrics(recorder.metrics, reference.metrics)
    assert_same_weights(tmp_path / "two", tmp_path / "one", lr=5e-4)


def test_dpo_in_two_processes_trains_as_one(tmp_path: Path) -> None:
    """Each rank scores its share of the pairs against its own frozen reference; rewards and log-probs gathered
    over the ranks, the SFT term normalised by the whole batch's chosen tokens."""
    options = {"learning_rate": 1e-3, "sft_loss_coef": 0.5}
    reference = one_process("dpo", tmp_path / "one", **options)
    recorder = Recorder()
    result = run_distributed(spec("dpo", 2, **options), tmp_path / "two", recorder, 2)
    assert (result.status, result.step, recorder.checkpoint_steps()) == ("succeeded", 4, [2, 4])
    assert_same_metrics(recorder.metrics, reference.metrics)
    assert_same_weights(tmp_path / "two", tmp_path / "one", lr=1e-3)


def test_grpo_in_two_processes_scores_every_group_and_keeps_the_ranks_in_step(tmp_path: Path) -> None:
    """Each rank samples and scores its share of the prompts (its own sampling generator, so the samples are not
    one process's); the groups are gathered whole, so advantages, rewards and tied groups are of the whole batch,
    and every rank takes the same update (its weights stay equal to the others')."""
    grpo = JobSpec.model_validate(
        {
            "type": "grpo",
            "model": "builtin:tiny",
            "dataset": "builtin:digits-prompts",
            "reward": {"type": "python", "function": "engine.builtin.digits:exact_match"},
            "hyperparameters": {
                "total_steps": 4,
                "batch_size": 4,
                "group_size": 4,
                "mini_batch_size": 8,
                "gradient_accumulation_steps": 2,
                "response_length": 4,
            },
            "checkpoint_every": 2,
            "resources": {"num_processes": 2},
        }
    )
    recorder = Recorder()
    result = run_distributed(grpo, tmp_path / "two", recorder, 2)
    assert (result.status, result.step, recorder.checkpoint_steps()) == ("succeeded", 4, [2, 4])
    for step, metrics in recorder.metrics.items():
        assert metrics["dist/weight_spread"] == 0, step
        assert metrics["groups/tied_fraction"] * 4 == round(metrics["groups/tied_fraction"] * 4)  # of 4 groups
        assert metrics["reward/mean"] * 16 == pytest.approx(round(metrics["reward/mean"] * 16))  # of 16 samples
    # rank 0 reports the samples of the whole gathered batch (both ranks' groups) over the worker's socket
    assert list(recorder.samples) == [1] and len(recorder.samples[1]) == 16
    totals = [sample["rewards"]["total"] for sample in recorder.samples[1]]
    assert sum(totals) / 16 == pytest.approx(recorder.metrics[1]["reward/mean"])


def test_a_cancel_inside_a_reward_call_ends_every_rank(tmp_path: Path) -> None:
    """Rank 0 alone sees the stop, waiting out its service's backoff; rank 1, in its own backoff or in a
    collective waiting for rank 0, is stopped with it, and the job ends cancelled rather than failed."""
    service = RuleService(fail_after=4)  # each rank asks once a step: steps 1 and 2 are scored, step 3 is not

    class CancelInBackoff(Recorder):
        def should_stop(self) -> StopRequest | None:
            return "cancel" if service.requests > 4 else None

    reward = {"type": "http", "url": service.url, "label": "{{item.answer}}", "retries": 2, "backoff_s": 60}
    grpo = JobSpec.model_validate(
        {
            "type": "grpo",
            "model": "builtin:tiny",
            "dataset": "builtin:digits-prompts",
            "reward": reward,
            "hyperparameters": {
                "total_steps": 4,
                "batch_size": 4,
                "group_size": 2,
                "mini_batch_size": 8,
                "response_length": 4,
            },
            "checkpoint_every": 2,
            "resources": {"num_processes": 2},
        }
    )
    recorder = CancelInBackoff()
    try:
        result = run_distributed(grpo, tmp_path / "job", recorder, 2)
    finally:
        service.close()
    assert (result.status, result.step, recorder.checkpoint_steps()) == ("cancelled", 2, [2])
    assert sorted(recorder.metrics) == [1, 2]


def test_a_failing_rank_fails_the_job_with_its_error_code(tmp_path: Path) -> None:
    broken = spec("sft", 2).model_copy(update={"dataset": str(tmp_path / "missing.jsonl")})
    with pytest.raises(RankFailure) as failure:
        run_distributed(broken, tmp_path / "job", Recorder(), 2)
    assert failure.value.code == "dataset_invalid"
    assert "dataset not found" in failure.value.message


class LostDatabase(RuntimeError):
    pass


def test_an_error_of_the_workers_callbacks_ends_every_rank(tmp_path: Path) -> None:
    """As in one process, what a callback raises (a lost lease, a database error) is the job's error."""

    class Failing(Recorder):
        def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
            if step == 2:
                raise LostDatabase("the database went away")
            super().on_metrics(step, metrics)

    recorder = Failing()
    with pytest.raises(LostDatabase, match="went away"):
        run_distributed(spec("sft", 2), tmp_path / "job", recorder, 2)
    assert sorted(recorder.metrics) == [1]
    assert not (tmp_path / "job" / "checkpoints").exists()  # the ranks stopped before step 2's checkpoint
