"""A session job on runner.run_job, with no client: once its heartbeats stop, once it has sent no request for a
while, or once it lived its longest, it ends (saving its models' state) and frees the worker; a cancel ends it while
it waits for work, and interrupts a sample in progress; a first model that cannot be loaded ends it failed."""

import json
import re
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from engine.session.models import STATE_FILE
from jobs import runner
from jobs.recovery import end_abandoned_once
from jobs.store import db, sessions
from jobs.store.models import SessionRequest, TrainingSession, utcnow
from jobs.store.settings import Settings
from tests.factories import new_project
from tests.jobs.helpers import events, get_job, set_status
from tests.models import build_model


def session_with_a_request(
    settings: Settings, project_id: str, silent_s: float, kind: str = "optim_step", payload: bytes = b"{}"
) -> tuple[str, str]:
    """A queued session job whose client last beat ``silent_s`` ago, with a request waiting (an optimizer step of a
    model the worker does not hold, by default; seq_id 0 for a ``create_model``)."""
    with db.session_scope(settings.resolved_database_url) as session:
        job = sessions.create_session(session, project_id=project_id, sdk_version="0.38.0", tags=[], user_metadata={})
        target, seq_id = f"{job.id}:train:0", int(kind != "create_model")
        if kind == "create_model":
            sessions.add_model(
                session,
                session_id=job.id,
                project_id=project_id,
                seq=0,
                base_model="m",
                lora_rank=4,
                info={},
                user_metadata={},
            )
        request, _ = sessions.add_request(
            session, session_id=job.id, project_id=project_id, target=target, seq_id=seq_id, kind=kind, payload=payload
        )
        assert sessions.queue_session(session, job=job, base_model="m")
        session.execute(update(TrainingSession).where(TrainingSession.id == job.id)
                        .values(heartbeat_at=utcnow() - timedelta(seconds=silent_s)))  # fmt: skip
        return job.id, request.id


def tiny_model(resolved: str = "builtin:tiny") -> bytes:
    """A ``create_model`` request's payload: a LoRA model of ``resolved``."""
    return json.dumps({"resolved": resolved, "lora_config": {"rank": 4}}).encode()


def request_of(settings: Settings, request_id: str) -> SessionRequest:
    with db.session_scope(settings.resolved_database_url) as session:
        row = session.get(SessionRequest, request_id)
        assert row is not None
        session.expunge(row)
        return row


def test_a_session_whose_heartbeats_stopped_ends_abandoned_and_frees_the_worker(
    settings: Settings, project_id: str
) -> None:
    short = settings.model_copy(update={"session_timeout_seconds": 5})
    job_id, request_id = session_with_a_request(short, project_id, silent_s=30)
    assert runner.run_job(job_id, settings=short, worker="w1") == "cancelled"  # not a clean close: succeeded
    job = get_job(short, job_id)
    assert job.worker is None and job.lease_until is None
    assert job.error_code == "session_abandoned" and job.error_message is not None
    assert re.match(r"no heartbeat from the client for 3\d s: it exited without closing", job.error_message)
    request = request_of(short, request_id)
    assert (request.status, request.category) == ("failed", "user")
    assert request.error is not None and re.search(
        r"the session ended: no heartbeat from the client for 3\d s", request.error
    )
    assert any(e.data.get("code") == "session_abandoned" for e in events(short, job_id))


def test_a_session_not_taken_yet_whose_heartbeats_stopped_is_ended_by_the_sweep(
    settings: Settings, project_id: str
) -> None:
    job_id, request_id = session_with_a_request(settings, project_id, silent_s=300)
    beating, _ = session_with_a_request(settings, project_id, silent_s=0)
    with db.session_scope(settings.resolved_database_url) as session:
        waiting = sessions.create_session(
            session, project_id=project_id, sdk_version="0.38.0", tags=[], user_metadata={}
        ).id
        session.execute(
            update(TrainingSession)
            .where(TrainingSession.id == waiting)
            .values(heartbeat_at=utcnow() - timedelta(seconds=300))
        )
    assert set(end_abandoned_once(settings)) >= {job_id, waiting}
    for ended in (job_id, waiting):
        job = get_job(settings, ended)
        assert (job.status, job.error_code) == ("cancelled", "session_abandoned")
    assert get_job(settings, beating).status == "queued"
    assert request_of(settings, request_id).status == "failed"
    assert runner.run_job(job_id, settings=settings, worker="w1") == "cancelled"  # its message: nothing to do


@pytest.mark.parametrize(
    ("setting", "code"), [("session_idle_seconds", "session_idle"), ("session_max_seconds", "session_expired")]
)
def test_an_idle_or_old_session_saves_its_models_state_and_ends(
    sqlite_settings: Settings, setting: str, code: str
) -> None:
    """A forgotten notebook, still beating: no request for ``session_idle_seconds``; or a session past its
    ``session_max_seconds``. Either ends, its model's state saved first for create_training_client_from_state."""
    limited = sqlite_settings.model_copy(update={"session_idle_seconds": 0, setting: 1, "session_timeout_seconds": 60})
    project_id = new_project(limited).id
    job_id, request_id = session_with_a_request(
        limited, project_id, silent_s=0, kind="create_model", payload=tiny_model()
    )
    assert runner.run_job(job_id, settings=limited, worker="w1") == "cancelled"
    assert request_of(limited, request_id).status == "done"
    job = get_job(limited, job_id)
    assert job.worker is None and job.error_code == code and job.error_message is not None
    path = f"tinker://{job_id}:train:0/weights/ended-0"
    assert path in job.error_message
    with db.session_scope(limited.resolved_database_url) as session:
        saved = sessions.get_checkpoint(
            session, project_id=project_id, model_id=f"{job_id}:train:0", kind="weights", name="ended-0"
        )
        assert saved is not None and saved.size_bytes
        folder = limited.resolved_artifacts_dir / saved.path
    assert (folder / STATE_FILE).is_file()


def test_a_first_model_that_cannot_be_loaded_ends_the_session_failed(sqlite_settings: Settings, tmp_path: Path) -> None:
    """A worker is held only for a model it holds: a session whose only model cannot be loaded ends at once."""
    project_id = new_project(sqlite_settings).id
    job_id, request_id = session_with_a_request(
        sqlite_settings, project_id, silent_s=0, kind="create_model", payload=tiny_model(str(tmp_path))
    )
    finished: list[str] = []
    worker = threading.Thread(
        target=lambda: finished.append(runner.run_job(job_id, settings=sqlite_settings, worker="w1")), daemon=True
    )
    worker.start()
    worker.join(timeout=60)
    assert finished == ["failed"]
    job = get_job(sqlite_settings, job_id)
    assert job.worker is None and job.error_code == "model_not_found"
    assert job.error_message is not None and "has no tokenizer" in job.error_message
    request = request_of(sqlite_settings, request_id)
    assert request.category == "user" and request.error is not None and "has no tokenizer" in request.error


def test_a_cancel_interrupts_a_sample_in_progress(sqlite_settings: Settings, tmp_path: Path) -> None:
    """A sample of 200,000 tokens on a model of a long context (hours on this CPU): the client's cancel_future stops
    it, the worker takes the next request, and the job's cancel stops that one and ends the session."""
    folder = build_model("llama", tmp_path / "long", config={"max_position_embeddings": 1_000_000})
    bounded = sqlite_settings.model_copy(update={"session_max_sample_tokens": 10**6})
    project_id = new_project(bounded).id
    job_id, _ = session_with_a_request(bounded, project_id, silent_s=0)
    long = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "num_samples": 1,
        "sampling_params": {"max_tokens": 200_000, "stop": [], "temperature": 1.0},
    }
    with db.session_scope(bounded.resolved_database_url) as session:
        sampler = sessions.add_sampler(
            session,
            session_id=job_id,
            project_id=project_id,
            seq=0,
            base_model="long",
            model_path=None,
            folder=str(folder),
        ).id
        first, second = (
            sessions.add_request(
                session,
                session_id=job_id,
                project_id=project_id,
                target=sampler,
                seq_id=seq,
                kind="sample",
                payload=json.dumps(long).encode(),
            )[0].id
            for seq in (1, 2)
        )
    finished: list[str] = []
    worker = threading.Thread(
        target=lambda: finished.append(runner.run_job(job_id, settings=bounded, worker="w1")), daemon=True
    )
    worker.start()

    def running(request_id: str) -> None:
        deadline = time.monotonic() + 60
        while request_of(bounded, request_id).status == "pending":
            assert time.monotonic() < deadline
            time.sleep(0.05)

    running(first)
    with db.session_scope(bounded.resolved_database_url) as session:  # what cancel_future does
        sessions.fail_request(session, request_id=first, error="cancelled by the client", category="user")
    running(second)  # the worker let go of the first
    assert request_of(bounded, second).status == "running"
    set_status(bounded, job_id, ("running",), "cancelling")  # what /v1/jobs/{id}/cancel does
    worker.join(timeout=60)
    assert finished == ["cancelled"]
    request = request_of(bounded, second)
    assert (request.status, request.error) == ("failed", "the session was cancelled while the request ran")


def test_a_live_session_runs_until_cancelled(settings: Settings, project_id: str) -> None:
    job_id, request_id = session_with_a_request(settings, project_id, silent_s=0)  # beating (the default timeout)
    finished: list[str] = []
    worker = threading.Thread(target=lambda: finished.append(runner.run_job(job_id, settings=settings, worker="w1")))
    worker.start()
    deadline = time.monotonic() + 30
    while request_of(settings, request_id).status == "pending":  # the worker takes it: its model is not held
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert request_of(settings, request_id).category == "server"  # a model this worker does not hold: lost
    assert get_job(settings, job_id).status == "running" and not finished  # the session itself lives on
    set_status(settings, job_id, ("running",), "cancelling")  # what /v1/jobs/{id}/cancel does
    worker.join(timeout=30)
    assert finished == ["cancelled"]
    job = get_job(settings, job_id)
    assert job.worker is None and job.lease_until is None
