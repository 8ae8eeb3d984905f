"""Projects are isolated: project B's key walks every route at project A's job and file, and finds nothing.

A's objects are rows written through ``jobs.store.crud`` the way workers write them: a running PPO job with
metrics, events and a checkpoint, a succeeded SFT job, a paused job, and an uploaded file. Every route that
takes an id answers 404 — the same answer as for an id that exists nowhere — the lists show none of them,
references to them in a job spec are not found, and none of B's calls changes A's rows or reaches a worker.
Runs on SQLite and PostgreSQL.
"""

from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from jobs.store import crud
from jobs.store.settings import Settings
from tests.api.helpers import PPO_SPEC, SFT_SPEC, Calls, Db, error_of, jsonl
from tests.factories import Project, new_project
from tests.security.routes import DOCS, PUBLIC, TINKER, every_route

SFT_ROW = {"prompt": "p", "completion": "c"}


def snapshot(db: Db, job_ids: list[str], project: Project) -> dict[str, Any]:
    with db.session() as session:
        jobs = {job_id: crud.get_job(session, job_id=job_id) for job_id in job_ids}
        events = {job_id: crud.list_events(session, job_id=job_id, after=None, limit=1000)[0] for job_id in job_ids}
        return {
            "jobs": {job_id: (job.status, job.step, job.attempt) for job_id, job in jobs.items() if job},
            "events": {job_id: len(rows) for job_id, rows in events.items()},
            "checkpoints": {job_id: len(crud.list_checkpoints(session, job_id=job_id)) for job_id in job_ids},
            "files": len(crud.list_files(session, project_id=project.id, after=None, limit=100)[0]),
        }


def test_another_projects_objects_are_invisible_on_every_route(
    app: FastAPI, settings: Settings, db: Db, calls: Calls
) -> None:
    a, b = new_project(settings, "a"), new_project(settings, "b")
    running = db.job(a.id, spec=PPO_SPEC, status="running")
    db.metrics(running, 1, {"objective/kl": 0.1})
    db.event(running, "a secret warning", kind="warning")
    db.checkpoint(running, 1)
    succeeded = db.job(a.id, spec=SFT_SPEC, status="succeeded")
    db.checkpoint(succeeded, 2)
    paused = db.job(a.id, spec=SFT_SPEC, status="paused")
    with db.session() as session:
        file = crud.create_file(
            session, file_id="file-aaaaaaaaaaaa", project_id=a.id, filename="a.jsonl", purpose="sft", kind="sft",
            size=10, rows=1, path="files/file-aaaaaaaaaaaa.jsonl",
        )  # fmt: skip
    a_jobs = [running, succeeded, paused]
    before = snapshot(db, a_jobs, a)

    walked: set[tuple[str, str]] = set()
    with TestClient(app, headers=b.headers) as client:

        def missing(method: str, path: str, template: str, **kwargs: Any) -> None:
            """404 not_found, exactly as for an id that exists nowhere."""
            response = client.request(method, path, **kwargs)
            assert response.status_code == 404, (method, path, response.text)
            error = error_of(response)
            assert error["code"] == "not_found"
            assert "secret" not in response.text and a.id not in response.text
            for real in (*a_jobs, file.id):
                path = path.replace(real, "job_000000000000" if real.startswith("job_") else "file-000000000000")
            nowhere = client.request(method, path, **kwargs)
            assert nowhere.status_code == 404
            assert {**error_of(nowhere), "message": ""} == {**error, "message": ""}
            walked.add((method, template))

        for job_id in a_jobs:
            missing("GET", f"/v1/jobs/{job_id}", "/v1/jobs/{job_id}")
            for sub in ("metrics", "events", "checkpoints", "stream", "tensorboard", "samples", "model"):
                missing("GET", f"/v1/jobs/{job_id}/{sub}", f"/v1/jobs/{{job_id}}/{sub}")
            for action in ("cancel", "pause", "resume"):
                missing("POST", f"/v1/jobs/{job_id}/{action}", f"/v1/jobs/{{job_id}}/{action}")
            for step in (1, 2):
                path = f"/v1/jobs/{job_id}/checkpoints/{step}/model"
                missing("GET", path, "/v1/jobs/{job_id}/checkpoints/{step}/model")
            for checkpoint in ("latest", 1, 2):
                body = {"prompts": ["hi"], "checkpoint": checkpoint}
                missing("POST", f"/v1/jobs/{job_id}/generate", "/v1/jobs/{job_id}/generate", json=body)
        missing("GET", f"/v1/files/{file.id}", "/v1/files/{file_id}")
        # OpenAI's fine-tuning routes: the same jobs, as unknown.
        fine_tuning = "/v1/fine_tuning/jobs/{fine_tuning_job_id}"
        for job_id in a_jobs:
            missing("GET", f"/v1/fine_tuning/jobs/{job_id}", fine_tuning)
            for sub in ("events", "checkpoints"):
                missing("GET", f"/v1/fine_tuning/jobs/{job_id}/{sub}", f"{fine_tuning}/{sub}")
            for action in ("cancel", "pause", "resume"):
                missing("POST", f"/v1/fine_tuning/jobs/{job_id}/{action}", f"{fine_tuning}/{action}")
        for params in ({}, {"after": succeeded}):
            response = client.get("/v1/fine_tuning/jobs", params=params)
            assert response.json() == {"object": "list", "data": [], "has_more": False}, params
        response = client.post("/v1/fine_tuning/jobs", json={"model": "builtin:tiny", "training_file": file.id})
        assert (response.status_code, error_of(response)["code"], error_of(response)["param"]) == (
            422, "file_not_found", "training_file")  # fmt: skip
        walked |= {("GET", "/v1/fine_tuning/jobs"), ("POST", "/v1/fine_tuning/jobs")}

        # The OpenAI-compatible routes: A's models are unknown, answered as for models that exist nowhere.
        assert client.get("/v1/models").json() == {"object": "list", "data": []}
        chat = [{"role": "user", "content": "hi"}]
        for job_id, suffix in ((succeeded, ""), (succeeded, "@2"), (running, "@1"), (paused, "")):
            for model in (f"job:{job_id}{suffix}", f"job:job_000000000000{suffix}"):
                for response in (
                    client.get(f"/v1/models/{model}"),
                    client.post("/v1/completions", json={"model": model, "prompt": "hi"}),
                    client.post("/v1/chat/completions", json={"model": model, "messages": chat}),
                ):
                    assert response.status_code == 404, response.text
                    assert error_of(response) == {
                        "code": "model_not_found",
                        "message": f"the model {model!r} does not exist in this project; GET /v1/models lists them",
                        "param": "model",
                    }
        walked |= {("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"), ("POST", "/v1/completions"),
                   ("POST", "/v1/chat/completions")}  # fmt: skip

        # Lists: B sees none of A's objects, whatever the filters, and cannot page from A's ids.
        for params in ({}, {"status": "running"}, {"type": "ppo"}, {"after": running}, {"limit": 100}):
            response = client.get("/v1/jobs", params=params)
            assert response.json() == {"data": [], "has_more": False}, params
        assert client.get("/v1/files", params={"after": file.id}).json() == {"data": [], "has_more": False}
        assert client.get("/v1/files").json() == {"data": [], "has_more": False}
        walked |= {("GET", "/v1/jobs"), ("GET", "/v1/files")}
        # Checkpoint permissions are not kept: refused alike for A's checkpoints and for none at all.
        base = "/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions"
        for checkpoint in (f"job:{succeeded}@2", "job:job_000000000000@2"):
            for response in (
                client.post(f"/v1/fine_tuning/checkpoints/{checkpoint}/permissions", json={"project_ids": ["p"]}),
                client.get(f"/v1/fine_tuning/checkpoints/{checkpoint}/permissions"),
                client.delete(f"/v1/fine_tuning/checkpoints/{checkpoint}/permissions/perm-1"),
            ):
                assert (response.status_code, error_of(response)["code"]) == (400, "unsupported"), response.text
        walked |= {("POST", base), ("GET", base), ("DELETE", base + "/{permission_id}")}
        # The job types are the server's, not a project's: both projects see the same list.
        assert client.get("/v1/job_types").json() == client.get("/v1/job_types", headers=a.headers).json()
        walked.add(("GET", "/v1/job_types"))
        # The grader endpoints grade what the request holds, nothing of a project's: both get the same answer.
        grader = {"type": "string_check", "input": "{{ sample.output_text }}", "reference": "{{ item.a }}",
                  "operation": "eq"}  # fmt: skip
        validate = "/v1/fine_tuning/alpha/graders/validate"
        assert client.post(validate, json={"grader": grader}).json() == client.post(
            validate, json={"grader": grader}, headers=a.headers).json()  # fmt: skip
        run = "/v1/fine_tuning/alpha/graders/run"
        body = {"grader": grader, "model_sample": "x", "item": {"a": "x"}}
        assert client.post(run, json=body).json()["reward"] == client.post(run, json=body, headers=a.headers).json()[
            "reward"] == 1.0  # fmt: skip
        walked |= {("POST", validate), ("POST", run)}

        # Creating: A's jobs and files cannot be named, as a model, a reward model or a dataset.
        refs = [
            ({**SFT_SPEC, "model": f"job:{succeeded}"}, "model", "job_not_found"),
            ({**SFT_SPEC, "model": f"job:{running}@1"}, "model", "job_not_found"),
            ({**PPO_SPEC, "reward_model": f"job:{succeeded}"}, "reward_model", "job_not_found"),
            ({**SFT_SPEC, "dataset": file.id}, "dataset", "file_not_found"),
            ({**SFT_SPEC, "eval_dataset": file.id}, "eval_dataset", "file_not_found"),
        ]
        for spec, param, code in refs:
            response = client.post("/v1/jobs", json=spec)
            assert (response.status_code, error_of(response)["code"], error_of(response)["param"]) == (422, code, param)
            # nor as a pipeline's stage (A's running job is not one to wait for either)
            stages = {"first": {**spec, "model": spec["model"].replace(f"job:{succeeded}", f"job:{running}")}}
            response = client.post("/v1/pipelines", json={"stages": stages})
            assert (response.status_code, error_of(response)["code"], error_of(response)["param"]) == (
                422, code, f"stages.first.{param}")  # fmt: skip
        walked.add(("POST", "/v1/pipelines"))
        # B's own uploads and jobs are B's alone.
        upload = client.post("/v1/files", files={"file": ("b.jsonl", jsonl([SFT_ROW]))}, data={"purpose": "sft"})
        assert upload.status_code == 201
        own = client.post("/v1/jobs", json={**SFT_SPEC, "dataset": upload.json()["id"]})
        assert own.status_code == 201
        walked |= {("POST", "/v1/jobs"), ("POST", "/v1/files")}
        assert client.get(f"/v1/jobs/{own.json()['id']}", headers=a.headers).status_code == 404
        assert client.get(f"/v1/files/{upload.json()['id']}", headers=a.headers).status_code == 404

        # A still sees its own (the 404s above were about B, not about the rows).
        assert client.get(f"/v1/jobs/{running}", headers=a.headers).json()["status"] == "running"
        assert client.get(f"/v1/files/{file.id}", headers=a.headers).status_code == 200

    # The Tinker routes (another key header, their own objects) are walked in tests/api/routes/test_tinker.py.
    routes = {(method, path) for method, path in every_route(app) if path not in PUBLIC | DOCS}
    assert walked == {(method, path) for method, path in routes if not path.startswith(TINKER)}  # a new route
    # must be added to this walk
    assert snapshot(db, a_jobs, a) == before
    assert calls.generated == []
    assert calls.enqueued == [own.json()["id"]]


def test_another_projects_id_as_a_list_cursor_tells_nothing(app: FastAPI, settings: Settings, db: Db) -> None:
    """``?after=`` is resolved inside the caller's project: another project's job or file id is an unknown
    cursor, answered exactly as an id that exists nowhere (an empty page), not a page cut at its creation time."""
    a, b = new_project(settings, "a"), new_project(settings, "b")
    b_jobs = [db.job(b.id) for _ in range(3)]
    a_job = db.job(a.id)
    with db.session() as session:
        for project, file_id in ((b, "file-cursorbbbbbb"), (a, "file-cursoraaaaaa")):
            crud.create_file(session, file_id=file_id, project_id=project.id, filename="d.jsonl", purpose="sft",
                             kind="sft", size=1, rows=1, path=f"files/{file_id}.jsonl")  # fmt: skip
    with TestClient(app, headers=b.headers) as client:
        for path, foreign, own in (("/v1/jobs", a_job, b_jobs[1]), ("/v1/files", "file-cursoraaaaaa", None)):
            nowhere = client.get(path, params={"after": "job_000000000000"}).json()
            assert client.get(path, params={"after": foreign}).json() == nowhere == {"data": [], "has_more": False}
            if own is not None:  # the caller's own cursor pages as before
                assert [j["id"] for j in client.get(path, params={"after": own}).json()["data"]] == [b_jobs[0]]
