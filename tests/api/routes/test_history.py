"""GET /v1/jobs/{id}/metrics, /events and /checkpoints: what workers recorded, read back."""

from fastapi.testclient import TestClient

from tests.api.helpers import Db, error_of
from tests.factories import Project


def test_metric_history_filters_and_downsampling(client: TestClient, project: Project, db: Db) -> None:
    job_id = db.job(project.id, status="running")
    for step in range(1, 11):
        db.metrics(job_id, step, {"loss/sft": 1.0 / step, "lr": 0.001, "grad_norm": float(step)})
    url = f"/v1/jobs/{job_id}/metrics"

    everything = client.get(url).json()["data"]
    assert set(everything) == {"loss/sft", "lr", "grad_norm"}
    assert everything["grad_norm"] == [{"step": s, "value": float(s)} for s in range(1, 11)]

    two = client.get(url, params={"names": "grad_norm, lr", "start_step": 3, "end_step": 6}).json()["data"]
    assert set(two) == {"grad_norm", "lr"}
    assert [p["step"] for p in two["grad_norm"]] == [3, 4, 5, 6]

    sampled = client.get(url, params={"names": "grad_norm", "max_points": 4}).json()["data"]["grad_norm"]
    steps = [p["step"] for p in sampled]
    assert len(steps) == 4
    assert (steps[0], steps[-1]) == (1, 10)  # first and last are kept
    assert steps == sorted(set(steps))
    assert client.get(url, params={"names": "nothing/like/this"}).json() == {"data": {}}

    bad = client.get(url, params={"max_points": 0})
    assert bad.status_code == 422
    assert error_of(bad)["param"] == "max_points"


def test_events_paginate_by_cursor(client: TestClient, project: Project, db: Db) -> None:
    job_id = db.job(project.id)
    for i in range(5):
        db.event(job_id, f"note {i}", data={"i": i})
    url = f"/v1/jobs/{job_id}/events"
    first = client.get(url, params={"limit": 3}).json()
    assert first["has_more"] is True
    rest = client.get(url, params={"after": first["data"][-1]["id"], "limit": 3}).json()
    assert rest["has_more"] is False
    events = first["data"] + rest["data"]
    assert [e["message"] for e in events] == [f"note {i}" for i in range(5)]
    assert [e["data"] for e in events] == [{"i": i} for i in range(5)]
    assert [e["id"] for e in events] == sorted({e["id"] for e in events})
    assert set(events[0]) == {"id", "kind", "message", "data", "created_at"}
    assert events[0]["created_at"].endswith(("Z", "+00:00"))
    assert client.get(url, params={"after": events[-1]["id"]}).json() == {"data": [], "has_more": False}


def test_checkpoints(client: TestClient, project: Project, db: Db) -> None:
    job_id = db.job(project.id, status="running")
    url = f"/v1/jobs/{job_id}/checkpoints"
    assert client.get(url).json() == {"data": [], "has_more": False}
    db.checkpoint(job_id, 2)
    db.checkpoint(job_id, 4, kept=(2,))
    db.checkpoint(job_id, 6, kept=(4,))  # retention dropped step 2
    body = client.get(url).json()
    assert body["has_more"] is False
    assert [c["step"] for c in body["data"]] == [4, 6]
    assert body["data"][0]["path"] == f"jobs/{job_id}/checkpoints/step-4"
    assert body["data"][0]["metrics"] == {"loss/sft": 0.25}
    assert body["data"][0]["created_at"].endswith(("Z", "+00:00"))
