"""Reward sources that fail, through a worker: a reward service that goes down ends the job with
``reward_service_failed`` after its retries and keeps the checkpoints written before; a reward function that
raises ends it with ``reward_function_failed`` naming the function and the row; a reward the worker's own
allow-lists refuse (a spec stored before the operator narrowed them) is not run."""

from pathlib import Path
from typing import Any

from jobs import runner
from jobs.store.settings import Settings
from tests.factories import create_job, make_settings, new_project
from tests.jobs.helpers import checkpoint_steps, disk_checkpoint_steps, get_job
from tests.reward_service import RuleService

FUNCTION = "tests.jobs.test_reward_faults:raises_on_seven"


def grpo_spec(reward: dict[str, Any], **hyperparameters: Any) -> dict[str, Any]:
    return {
        "type": "grpo",
        "model": "builtin:tiny",
        "dataset": "builtin:digits-prompts",
        "reward": reward,
        "hyperparameters": {
            "total_steps": 6,
            "batch_size": 4,
            "group_size": 4,
            "mini_batch_size": 16,
            "response_length": 4,
            **hyperparameters,
        },
        "checkpoint_every": 2,
    }


def run(settings: Settings, spec: dict[str, Any]) -> tuple[str, str]:
    job_id = create_job(settings, new_project(settings).id, spec)
    return job_id, runner.run_job(job_id, settings=settings, worker="w:1")


def raises_on_seven(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    if any(prompt.startswith("7 ") for prompt in prompts):
        raise ZeroDivisionError("no sevens")
    return [0.5] * len(prompts)


def test_a_reward_service_that_goes_down_fails_the_job_keeping_its_checkpoints(sqlite_url: str, tmp_path: Path) -> None:
    settings = make_settings(tmp_path, sqlite_url)
    service = RuleService(fail_after=3)  # each step asks once: steps 1 to 3 are scored, step 4 is not
    try:
        reward = {"type": "http", "url": service.url, "label": "{{item.answer}}", "retries": 2, "backoff_s": 0.01}
        job_id, status = run(settings, grpo_spec(reward))
    finally:
        service.close()
    assert status == "failed"
    job = get_job(settings, job_id)
    assert job.error_code == "reward_service_failed"
    assert job.error_message is not None
    assert f"reward service {service.url} failed after 3 attempts" in job.error_message and "503" in job.error_message
    assert service.requests == 3 + 3
    assert checkpoint_steps(settings, job_id) == disk_checkpoint_steps(settings, job_id) == [2]


def test_a_reward_function_that_raises_fails_the_job_naming_it_and_the_row(sqlite_url: str, tmp_path: Path) -> None:
    settings = make_settings(tmp_path, sqlite_url, reward_functions=[FUNCTION])
    job_id, status = run(settings, grpo_spec({"type": "python", "function": FUNCTION}))
    assert status == "failed"
    job = get_job(settings, job_id)
    assert job.error_code == "reward_function_failed"
    assert job.error_message is not None
    assert FUNCTION in job.error_message and "ZeroDivisionError" in job.error_message
    assert "row " in job.error_message and "'7 " in job.error_message


def test_a_worker_does_not_run_a_reward_its_allow_lists_refuse(sqlite_url: str, tmp_path: Path) -> None:
    settings = make_settings(tmp_path, sqlite_url)  # no reward functions allowed, services on loopback only
    for reward in ({"type": "python", "function": FUNCTION}, {"type": "http", "url": "https://rewards.example/"}):
        job_id, status = run(settings, grpo_spec(reward))
        assert status == "failed"
        job = get_job(settings, job_id)
        assert job.error_code == "invalid_spec"
        assert job.error_message is not None and "not allowed" in job.error_message
        assert checkpoint_steps(settings, job_id) == []
