"""Jobs that wait for jobs: ``POST /v1/pipelines`` (stages naming earlier stages), a spec naming an unfinished
job (stored ``waiting``), and their release (jobs.recovery.release_once): queued once every job they name has
succeeded, failed with ``dependency_failed`` (naming it) when one fails or is cancelled."""

from typing import Any

from fastapi.testclient import TestClient

from jobs.recovery import release_once
from jobs.store.settings import Settings
from tests.api.helpers import PPO_SPEC, RM_SPEC, SFT_SPEC, Calls, Db, error_of
from tests.factories import Project

STAGES: dict[str, dict[str, Any]] = {
    "sft": SFT_SPEC,
    "rm": {**RM_SPEC, "model": "stage:sft"},
    "ppo": {**PPO_SPEC, "model": "stage:sft", "reward_model": "stage:rm"},
}


def submit(client: TestClient, stages: dict[str, Any], key: str | None = None) -> Any:
    headers = {"Idempotency-Key": key} if key else {}
    return client.post("/v1/pipelines", json={"stages": stages}, headers=headers)


def statuses(client: TestClient, jobs: dict[str, Any]) -> dict[str, str]:
    return {name: client.get(f"/v1/jobs/{job['id']}").json()["status"] for name, job in jobs.items()}


def test_a_pipeline_is_stored_whole_and_later_stages_wait(client: TestClient, calls: Calls) -> None:
    response = submit(client, STAGES)
    assert response.status_code == 201, response.text
    jobs = response.json()["stages"]
    assert list(jobs) == ["sft", "rm", "ppo"]
    assert {name: job["status"] for name, job in jobs.items()} == {"sft": "queued", "rm": "waiting", "ppo": "waiting"}
    assert calls.enqueued == [jobs["sft"]["id"]]
    ppo = jobs["ppo"]["spec"]
    assert (ppo["model"], ppo["reward_model"]) == (f"job:{jobs['sft']['id']}", f"job:{jobs['rm']['id']}")
    events = client.get(f"/v1/jobs/{jobs['ppo']['id']}/events").json()["data"]
    assert any(f"waiting for job {jobs['sft']['id']}, {jobs['rm']['id']}" in e["message"] for e in events)
    listed = client.get("/v1/jobs", params={"status": "waiting"}).json()["data"]
    assert {job["id"] for job in listed} == {jobs["rm"]["id"], jobs["ppo"]["id"]}


def test_a_refused_stage_stores_no_stage(client: TestClient, calls: Calls) -> None:
    cases = [
        ({**STAGES, "rm": {**RM_SPEC, "model": "stage:ppo"}}, "stage_not_found", "stages.rm.model"),
        ({"rm": {**RM_SPEC, "model": "stage:sft"}}, "stage_not_found", "stages.rm.model"),
        ({**STAGES, "ppo": {**STAGES["ppo"], "hyperparameters": {"kl_coef": -1}}}, "invalid_request",
         "stages.ppo.hyperparameters.kl_coef"),
        ({**STAGES, "ppo": {**STAGES["ppo"], "reward_model": "stage:sft"}}, "wrong_job_type",
         "stages.ppo.reward_model"),
    ]  # fmt: skip
    for stages, code, param in cases:
        response = submit(client, stages)
        assert response.status_code == 422, response.text
        assert (error_of(response)["code"], error_of(response)["param"]) == (code, param)
    assert client.get("/v1/jobs").json()["data"] == []
    assert calls.enqueued == []
    assert submit(client, {"BAD NAME": SFT_SPEC}).status_code == 422


def test_the_same_idempotency_key_returns_the_same_jobs(client: TestClient, calls: Calls) -> None:
    first = submit(client, STAGES, key="pipe-1")
    again = submit(client, STAGES, key="pipe-1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert {n: j["id"] for n, j in first.json()["stages"].items()} == {
        n: j["id"] for n, j in again.json()["stages"].items()
    }
    assert len(calls.enqueued) == 1
    changed = submit(client, {**STAGES, "sft": {**SFT_SPEC, "seed": 7}}, key="pipe-1")
    assert (changed.status_code, error_of(changed)["code"]) == (409, "conflict")


def test_stages_are_queued_as_the_jobs_they_name_succeed(
    client: TestClient, settings: Settings, db: Db, calls: Calls
) -> None:
    jobs = submit(client, STAGES).json()["stages"]
    ids = {name: job["id"] for name, job in jobs.items()}
    assert release_once(settings, calls.enqueue) == []  # nothing has finished
    db.status(ids["sft"], "succeeded")
    assert release_once(settings, calls.enqueue) == [ids["rm"]]  # the PPO still waits for the reward model
    assert statuses(client, jobs) == {"sft": "succeeded", "rm": "queued", "ppo": "waiting"}
    db.status(ids["rm"], "succeeded")
    assert release_once(settings, calls.enqueue) == [ids["ppo"]]
    assert calls.enqueued == [ids["sft"], ids["rm"], ids["ppo"]]
    assert release_once(settings, calls.enqueue) == []


def test_a_failing_first_stage_fails_the_rest_naming_it(
    client: TestClient, settings: Settings, db: Db, calls: Calls
) -> None:
    jobs = submit(client, STAGES).json()["stages"]
    db.status(jobs["sft"]["id"], "failed")
    assert release_once(settings, calls.enqueue) == []
    assert statuses(client, jobs) == {"sft": "failed", "rm": "failed", "ppo": "failed"}  # in one pass
    for name in ("rm", "ppo"):  # the PPO names the SFT first (its model), then the reward model: both ended
        error = client.get(f"/v1/jobs/{jobs[name]['id']}").json()["error"]
        assert error["code"] == "dependency_failed"
        assert (
            error["message"] == f"job {jobs['sft']['id']}, which this job starts from or is rewarded by, ended failed"
        )
    assert calls.enqueued == [jobs["sft"]["id"]]


def test_cancelling_a_stage_fails_the_stages_that_wait_for_it_at_once(client: TestClient, calls: Calls) -> None:
    jobs = submit(client, STAGES).json()["stages"]
    cancelled = client.post(f"/v1/jobs/{jobs['sft']['id']}/cancel")
    assert cancelled.json()["status"] == "cancelled"
    assert statuses(client, jobs) == {"sft": "cancelled", "rm": "failed", "ppo": "failed"}
    message = client.get(f"/v1/jobs/{jobs['rm']['id']}").json()["error"]["message"]
    assert f"job {jobs['sft']['id']}" in message and "cancelled" in message


def test_a_waiting_job_can_be_cancelled_not_paused(client: TestClient, project: Project, db: Db) -> None:
    running = db.job(project.id, status="running")
    response = client.post("/v1/jobs", json={**RM_SPEC, "model": f"job:{running}"})
    assert response.status_code == 201, response.text
    waiting = response.json()
    assert waiting["status"] == "waiting"
    paused = client.post(f"/v1/jobs/{waiting['id']}/pause")
    assert (paused.status_code, error_of(paused)["code"]) == (409, "conflict")
    assert client.post(f"/v1/jobs/{waiting['id']}/cancel").json()["status"] == "cancelled"


def test_a_dependency_that_finished_before_the_commit_is_noticed(
    client: TestClient, project: Project, db: Db, calls: Calls
) -> None:
    """The job a new spec names succeeded already: no waiting at all. (The race — it succeeds between the check
    and the commit — is closed by the release after every create.)"""
    done = db.job(project.id, status="succeeded")
    response = client.post("/v1/jobs", json={**RM_SPEC, "model": f"job:{done}"})
    assert response.json()["status"] == "queued"
    assert calls.enqueued == [response.json()["id"]]


def test_a_pipeline_key_retried_with_other_stages_is_a_conflict(client: TestClient, project: Project) -> None:
    first = submit(client, STAGES, key="pipe-2")
    assert first.status_code == 201
    fewer = {name: STAGES[name] for name in ("sft", "rm")}
    more = {**STAGES, "extra": {**SFT_SPEC, "seed": 3}}
    others = {"x": SFT_SPEC, "y": {**RM_SPEC, "model": "stage:x"}}
    for stages in (fewer, more, others, {"rm": STAGES["rm"], "sft": SFT_SPEC, "ppo": STAGES["ppo"]}):
        response = submit(client, stages, key="pipe-2")
        assert (response.status_code, error_of(response)["code"]) == (409, "conflict"), stages
        assert error_of(response)["param"] == "Idempotency-Key"
    assert len(client.get("/v1/jobs").json()["data"]) == 3  # nothing was added
    again = submit(client, STAGES, key="pipe-2")
    assert again.status_code == 200 and again.json() == {**first.json(), "stages": again.json()["stages"]}
    assert {n: j["id"] for n, j in again.json()["stages"].items()} == {
        n: j["id"] for n, j in first.json()["stages"].items()
    }


def test_pipeline_keys_and_job_keys_never_meet(client: TestClient, calls: Calls) -> None:
    job = client.post("/v1/jobs", json=SFT_SPEC, headers={"Idempotency-Key": "k/sft"})
    pipeline = submit(client, {"sft": SFT_SPEC}, key="k")
    assert (job.status_code, pipeline.status_code) == (201, 201)
    assert pipeline.json()["stages"]["sft"]["id"] != job.json()["id"]
    staged = submit(client, {"sft": SFT_SPEC}, key="p")
    job_again = client.post("/v1/jobs", json=SFT_SPEC, headers={"Idempotency-Key": "p/sft"})
    assert job_again.status_code == 201 and job_again.json()["id"] != staged.json()["stages"]["sft"]["id"]
    assert len(set(calls.enqueued)) == 4


def test_a_teacher_may_name_an_earlier_stage(client: TestClient, calls: Calls) -> None:
    distill_spec = {"type": "distill", "model": "stage:student", "teacher": "stage:teacher"}
    stages = {
        "teacher": SFT_SPEC,
        "student": {**SFT_SPEC, "hyperparameters": {"max_steps": 2}},
        "distill": {**distill_spec, "dataset": "builtin:digits-prompts"},
    }
    response = submit(client, stages)
    assert response.status_code == 201, response.text
    jobs = response.json()["stages"]
    distill = jobs["distill"]
    assert (distill["status"], distill["spec"]["teacher"]) == ("waiting", f"job:{jobs['teacher']['id']}")
    events = client.get(f"/v1/jobs/{distill['id']}/events").json()["data"]
    assert any(f"waiting for job {jobs['student']['id']}, {jobs['teacher']['id']}" in e["message"] for e in events)
    refused = submit(client, {**stages, "distill": {**stages["distill"], "teacher": "stage:later"}})
    assert (error_of(refused)["code"], error_of(refused)["param"]) == ("stage_not_found", "stages.distill.teacher")
