"""Reward sources that fail, through a worker: a reward service that goes down ends the job with
``reward_service_failed`` after its retries and keeps the checkpoints written before; a cancel or a pause
reaches a job waiting out a reward service's backoff; a reward function that raises ends it with
``reward_function_failed`` naming the function and the row; a reward the worker's own allow-lists refuse (a
spec stored before the operator narrowed them) is not run."""

import threading
import time
from pathlib import Path
from typing import Any

from jobs import runner
from jobs.store.settings import Settings
from tests.factories import create_job, make_settings, new_project
from tests.jobs.helpers import checkpoint_steps, disk_checkpoint_steps, events, get_job, metric_series, set_status
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
    settings = make_settings(tmp_path, sqlite_url, reward_urls=["loopback"])
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


def ask_once_in_backoff(settings: Settings, job_id: str, service: RuleService, to: str) -> threading.Thread:
    """A thread that asks for ``to`` (cancelling, pausing) once the service has refused its first request."""
    failed = service.fail_after

    def ask() -> None:
        for _ in range(1200):  # a minute at most
            if failed is not None and service.requests > failed:
                set_status(settings, job_id, ("running",), to)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread


def test_a_cancel_reaches_a_job_waiting_out_a_reward_services_backoff(sqlite_url: str, tmp_path: Path) -> None:
    settings = make_settings(tmp_path, sqlite_url, reward_urls=["loopback"])
    service = RuleService(fail_after=3)  # step 4's request fails, and the grader waits 60 s before the next
    reward = {"type": "http", "url": service.url, "label": "{{item.answer}}", "retries": 2, "backoff_s": 60}
    job_id = create_job(settings, new_project(settings).id, grpo_spec(reward))
    try:
        asking = ask_once_in_backoff(settings, job_id, service, "cancelling")
        status = runner.run_job(job_id, settings=settings, worker="w:1")
        asking.join()
    finally:
        service.close()
    assert status == "cancelled"
    job = get_job(settings, job_id)
    assert (job.status, job.error_code, job.worker) == ("cancelled", None, None)
    assert service.requests == 4  # the retries never came
    assert checkpoint_steps(settings, job_id) == disk_checkpoint_steps(settings, job_id) == [2]


def test_a_pause_in_a_reward_services_backoff_resumes_from_the_newest_checkpoint(
    sqlite_url: str, tmp_path: Path
) -> None:
    settings = make_settings(tmp_path, sqlite_url, reward_urls=["loopback"])
    service = RuleService(fail_after=3)
    reward = {"type": "http", "url": service.url, "label": "{{item.answer}}", "retries": 2, "backoff_s": 60}
    job_id = create_job(settings, new_project(settings).id, grpo_spec(reward))
    try:
        asking = ask_once_in_backoff(settings, job_id, service, "pausing")
        assert runner.run_job(job_id, settings=settings, worker="w:1") == "paused"
        asking.join()
        job = get_job(settings, job_id)
        assert (job.status, job.step, job.finished_at) == ("paused", 3, None)  # step 4 was being scored
        assert checkpoint_steps(settings, job_id) == disk_checkpoint_steps(settings, job_id) == [2]
        info = [e.message for e in events(settings, job_id) if e.kind == "info"]
        assert "while the reward waited for a service; a resume starts from the newest checkpoint: step 2" in info[-1]

        service.fail_after = None  # the service is back
        set_status(settings, job_id, ("paused",), "queued")
        assert runner.run_job(job_id, settings=settings, worker="w:2") == "succeeded"
    finally:
        service.close()
    assert all(steps == [1, 2, 3, 4, 5, 6] for steps in metric_series(settings, job_id).values())
    assert checkpoint_steps(settings, job_id) == [2, 4, 6]


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
    settings = make_settings(tmp_path, sqlite_url)  # no reward service nor function allowed
    for reward in ({"type": "python", "function": FUNCTION}, {"type": "http", "url": "https://rewards.example/"}):
        job_id, status = run(settings, grpo_spec(reward))
        assert status == "failed"
        job = get_job(settings, job_id)
        assert job.error_code == "invalid_spec"
        assert job.error_message is not None and "not allowed" in job.error_message
        assert checkpoint_steps(settings, job_id) == []
