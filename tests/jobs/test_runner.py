"""runner.run_job against real databases with the tiny built-in model: claim, persist, stop, resume,
lose the lease, and map failures to error codes."""

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
import torch
from sqlalchemy.exc import OperationalError

from engine.callbacks import VllmSettings
from engine.core.data import DatasetError
from engine.core.health import TrainingCollapseError
from engine.core.loop import NonFiniteLossError
from engine.core.models import IncompleteSaveError, ModelNotFoundError
from engine.core.vllm import RolloutEngineError, RolloutEngineLost, RolloutOutOfSyncError
from engine.spec.rows import ChatTemplateMissingError
from jobs import runner
from jobs.distributed import LOST, RankFailure
from jobs.store import crud, db
from jobs.store.models import utcnow
from jobs.store.settings import Settings
from tests.factories import create_job, make_settings, new_project
from tests.hf_cache import use_cache
from tests.jobs.helpers import (
    LEASE_SECONDS,
    checkpoint_steps,
    disk_checkpoint_steps,
    events,
    get_job,
    metric_series,
    set_status,
    sft_spec,
    status_changes,
)
from tests.services import PG_ADMIN_URL

SFT_METRICS = {"loss/sft", "lr", "grad_norm", "time/step_s", "throughput/tokens_per_s", "memory/state_bytes"}


def hooked(monkeypatch: pytest.MonkeyPatch, after_step: int, action: Callable[[], None]) -> list[int]:
    """Make the runner's callbacks call ``action`` once step ``after_step`` is done (before its metrics
    are written, as if another session acted while the step ran); returns the steps reported."""
    reported: list[int] = []

    class Hooked(runner.DbCallbacks):
        def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
            reported.append(step)
            if step == after_step:
                action()
            super().on_metrics(step, metrics)

    monkeypatch.setattr(runner, "DbCallbacks", Hooked)
    return reported


def test_sft_job_succeeds_and_a_second_run_is_a_no_op(settings: Settings, project_id: str) -> None:
    job_id = create_job(settings, project_id, sft_spec())

    assert runner.run_job(job_id, settings=settings, worker="w1:1") == "succeeded"

    job = get_job(settings, job_id)
    assert (job.status, job.step, job.total_steps, job.output_step) == ("succeeded", 4, 4, 4)
    assert job.worker is None and job.lease_until is None and job.finished_at is not None
    assert job.error_code is None
    series = metric_series(settings, job_id)
    assert set(series) == SFT_METRICS
    assert all(steps == [1, 2, 3, 4] for steps in series.values())
    assert set(job.latest_metrics) == SFT_METRICS
    assert checkpoint_steps(settings, job_id) == disk_checkpoint_steps(settings, job_id) == [2, 4]
    assert status_changes(settings, job_id) == ["running", "succeeded"]
    kinds = [e.kind for e in events(settings, job_id)]
    assert kinds.count("checkpoint") == 2

    # A redelivered task: nothing runs, nothing is written twice.
    before = len(events(settings, job_id))
    assert runner.run_job(job_id, settings=settings, worker="w2:2") == "succeeded"
    assert metric_series(settings, job_id) == series
    assert len(events(settings, job_id)) == before
    assert get_job(settings, job_id).worker is None


def test_cancel_between_steps(settings: Settings, project_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = create_job(settings, project_id, sft_spec(hyperparameters={"max_steps": 6}))
    hooked(monkeypatch, 2, lambda: set_status(settings, job_id, ("running",), "cancelling"))

    assert runner.run_job(job_id, settings=settings, worker="w:1") == "cancelled"

    job = get_job(settings, job_id)
    assert (job.status, job.step, job.worker, job.output_step) == ("cancelled", 2, None, None)
    assert job.finished_at is not None
    assert all(steps == [1, 2] for steps in metric_series(settings, job_id).values())
    assert status_changes(settings, job_id) == ["running", "cancelling", "cancelled"]


def test_pause_then_resume_continues_from_the_checkpoint(
    settings: Settings, project_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = create_job(settings, project_id, sft_spec(checkpoint_every=100))
    hooked(monkeypatch, 2, lambda: set_status(settings, job_id, ("running",), "pausing"))

    assert runner.run_job(job_id, settings=settings, worker="w:1") == "paused"
    job = get_job(settings, job_id)
    assert (job.status, job.step, job.worker, job.finished_at) == ("paused", 2, None, None)
    assert checkpoint_steps(settings, job_id) == disk_checkpoint_steps(settings, job_id) == [2]

    # Resume (the API's paused → queued); the step reported at start is the checkpoint's, never 0.
    set_status(settings, job_id, ("paused",), "queued")
    steps_seen: list[int] = []

    class Watching(runner.DbCallbacks):
        def on_start(self, start_step: int, total_steps: int) -> None:
            super().on_start(start_step, total_steps)
            steps_seen.append(get_job(settings, job_id).step)

        def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
            steps_seen.append(get_job(settings, job_id).step)
            super().on_metrics(step, metrics)

    monkeypatch.setattr(runner, "DbCallbacks", Watching)
    assert runner.run_job(job_id, settings=settings, worker="w:2") == "succeeded"

    assert steps_seen == [2, 2, 3]  # at start, then before the metrics of steps 3 and 4
    job = get_job(settings, job_id)
    assert (job.status, job.step, job.output_step, job.attempt) == ("succeeded", 4, 4, 1)
    series = metric_series(settings, job_id)
    assert set(series) == SFT_METRICS
    assert all(steps == [1, 2, 3, 4] for steps in series.values())
    assert checkpoint_steps(settings, job_id) == disk_checkpoint_steps(settings, job_id) == [2, 4]
    assert any(e.message == "resumed from step 2" for e in events(settings, job_id))
    assert status_changes(settings, job_id) == ["running", "pausing", "paused", "queued", "running", "succeeded"]


def test_a_worker_that_lost_its_lease_writes_nothing_more(
    settings: Settings, project_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = create_job(settings, project_id, sft_spec(hyperparameters={"max_steps": 6}))
    plain = runner.DbCallbacks

    def expire_and_recover() -> None:
        with db.session_scope(settings.resolved_database_url) as session:
            later = utcnow() + timedelta(seconds=settings.lease_seconds + 1)
            assert crud.recover_expired(session, max_attempts=3, now=later) == [(job_id, "train")]

    reported = hooked(monkeypatch, 3, expire_and_recover)
    assert runner.run_job(job_id, settings=settings, worker="w:1") == "queued"

    assert reported == [1, 2, 3]
    job = get_job(settings, job_id)
    assert (job.status, job.attempt, job.worker, job.error_code) == ("queued", 2, None, None)
    assert all(steps == [1, 2] for steps in metric_series(settings, job_id).values())
    assert "failed" not in status_changes(settings, job_id)

    # The requeued job's next run resumes from step 2 and ends with every step recorded once.
    monkeypatch.setattr(runner, "DbCallbacks", plain)
    assert runner.run_job(job_id, settings=settings, worker="w:2") == "succeeded"
    assert all(steps == [1, 2, 3, 4, 5, 6] for steps in metric_series(settings, job_id).values())


def test_only_one_of_two_workers_claims_a_job(settings: Settings, project_id: str) -> None:
    job_id = create_job(settings, project_id, sft_spec())
    barrier = threading.Barrier(2)
    results: dict[str, bool] = {}

    def claim(worker: str) -> None:
        with db.session_scope(settings.resolved_database_url) as session:
            barrier.wait()
            results[worker] = crud.claim_job(session, job_id=job_id, worker=worker, lease_seconds=30)

    threads = [threading.Thread(target=claim, args=(w,)) for w in ("a:1", "b:2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results.values()) == [False, True]
    winner = next(w for w, won in results.items() if won)
    assert get_job(settings, job_id).worker == winner

    # The loser's task finds the job running and leaves it alone.
    loser = next(w for w, won in results.items() if not won)
    assert runner.run_job(job_id, settings=settings, worker=loser) == "running"
    assert get_job(settings, job_id).worker == winner
    assert metric_series(settings, job_id) == {}


def test_lease_is_renewed_while_the_engine_is_busy(sqlite_settings: Settings) -> None:
    settings = sqlite_settings
    job_id = create_job(settings, new_project(settings).id, sft_spec())
    with db.session_scope(settings.resolved_database_url) as session:
        assert crud.claim_job(session, job_id=job_id, worker="w:1", lease_seconds=1)
    callbacks = runner.DbCallbacks(job_id, settings=settings, worker="w:1", out_dir=Path("unused"))
    callbacks.lease_seconds = 1
    with runner.LeaseRenewer(callbacks, interval_s=0.2):
        time.sleep(1.5)  # longer than the lease: a long model load
        lease_until = get_job(settings, job_id).lease_until
        assert lease_until is not None and lease_until.replace(tzinfo=utcnow().tzinfo) > utcnow()
        set_status(settings, job_id, ("running",), "pausing")
        time.sleep(0.5)
        assert callbacks.should_stop() == "pause"
        with db.session_scope(settings.resolved_database_url) as session:  # taken away
            crud.transition(session, job_id=job_id, from_statuses=("pausing",), to="queued", worker=None)
        time.sleep(0.5)
    assert callbacks.lease_lost.is_set()
    with pytest.raises(runner.LeaseLostError):
        callbacks.should_stop()


def test_metrics_survive_a_database_outage(sqlite_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 2's write fails through every retry; it is kept and committed with step 3's."""
    settings = sqlite_settings
    job_id = create_job(settings, new_project(settings).id, sft_spec())
    monkeypatch.setattr(runner, "DB_RETRY", runner.RetryPolicy(attempts=2, delay_s=0.01))
    add_metrics = crud.add_metrics
    failures: list[int] = []

    def flaky(session: object, *, job_id: str, step: int, metrics: dict[str, float]) -> None:
        if step == 2 and len(failures) < 3:  # two tries in step 2's transaction, one in step 3's
            failures.append(step)
            raise OperationalError("INSERT INTO metrics", {}, Exception("the database is restarting"))
        add_metrics(session, job_id=job_id, step=step, metrics=metrics)  # type: ignore[arg-type]

    monkeypatch.setattr(crud, "add_metrics", flaky)
    assert runner.run_job(job_id, settings=settings, worker="w:1") == "succeeded"
    assert failures == [2, 2, 2]
    series = metric_series(settings, job_id)
    assert set(series) == SFT_METRICS
    assert all(steps == [1, 2, 3, 4] for steps in series.values())


def test_a_job_survives_postgresql_dropping_its_connections(
    postgresql_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As after a database restart: every connection of the pool is gone between two steps."""
    settings = make_settings(tmp_path, postgresql_url, lease_seconds=LEASE_SECONDS)
    job_id = create_job(settings, new_project(settings).id, sft_spec())

    def drop_connections() -> None:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            name = postgresql_url.rsplit("/", 1)[1]
            dropped = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
            ).fetchall()
        assert dropped

    hooked(monkeypatch, 2, drop_connections)
    assert runner.run_job(job_id, settings=settings, worker="w:1") == "succeeded"
    assert all(steps == [1, 2, 3, 4] for steps in metric_series(settings, job_id).values())


def test_non_finite_metrics_become_one_warning(settings: Settings, project_id: str) -> None:
    """NaN fits neither PostgreSQL's JSON nor a JSON response: the finite metrics are kept, the rest reported."""
    job_id = create_job(settings, project_id, sft_spec())
    with db.session_scope(settings.resolved_database_url) as session:
        assert crud.claim_job(session, job_id=job_id, worker="w:1", lease_seconds=30)
    callbacks = runner.DbCallbacks(job_id, settings=settings, worker="w:1", out_dir=Path("unused"))

    callbacks.on_metrics(1, {"loss/sft": 1.5, "response/perplexity": float("inf")})
    callbacks.on_metrics(2, {"loss/sft": 1.25, "response/perplexity": float("nan")})

    assert metric_series(settings, job_id) == {"loss/sft": [1, 2]}
    assert get_job(settings, job_id).latest_metrics == {"loss/sft": 1.25}
    warnings = [e for e in events(settings, job_id) if e.kind == "warning"]
    assert [(e.data["metric"], e.data["step"]) for e in warnings] == [("response/perplexity", 1)]


def test_a_missing_dataset_file_fails_with_dataset_invalid(sqlite_settings: Settings) -> None:
    settings = sqlite_settings
    project_id = new_project(settings).id
    with db.session_scope(settings.resolved_database_url) as session:
        file = crud.create_file(
            session, file_id=f"file-{project_id[-8:]}", project_id=project_id, filename="gone.jsonl",
            purpose="sft", kind="sft", size=10, rows=1, path="files/gone.jsonl",
        )  # fmt: skip
    job_id = create_job(settings, project_id, sft_spec(dataset=file.id))

    assert runner.run_job(job_id, settings=settings, worker="w:1") == "failed"

    job = get_job(settings, job_id)
    assert job.error_code == "dataset_invalid"
    assert job.error_message is not None and "gone.jsonl" in job.error_message
    assert (job.worker, job.lease_until) == (None, None)
    errors = [e for e in events(settings, job_id) if e.kind == "error"]
    assert [e.data["code"] for e in errors] == ["dataset_invalid"]


def test_an_unexpected_errors_text_stays_in_the_log(
    sqlite_settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def crash(*_args: object) -> None:
        raise RuntimeError("(psycopg.OperationalError) server closed [SQL: UPDATE jobs SET ...]")

    monkeypatch.setattr(runner, "run_engine", crash)
    job_id = create_job(sqlite_settings, new_project(sqlite_settings).id, sft_spec())
    assert runner.run_job(job_id, settings=sqlite_settings, worker="w:1") == "failed"
    job = get_job(sqlite_settings, job_id)
    assert job.error_code == "internal_error" and job.error_message is not None
    assert "SQL" not in job.error_message and "worker's log" in job.error_message
    assert "[SQL: UPDATE jobs" in caplog.text


def test_an_unknown_local_model_fails_with_model_not_found(sqlite_url: str, tmp_path: Path) -> None:
    settings = make_settings(tmp_path, sqlite_url, lease_seconds=LEASE_SECONDS, model_root=tmp_path / "models")
    (tmp_path / "models").mkdir()
    job_id = create_job(settings, new_project(settings).id, sft_spec(model=str(tmp_path / "models" / "nope")))

    assert runner.run_job(job_id, settings=settings, worker="w:1") == "failed"
    assert get_job(settings, job_id).error_code == "model_not_found"


def test_a_hub_id_the_worker_does_not_have_fails_at_once(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Accepted while the API's cache had it, gone from the worker's: it fails before anything loads.
    use_cache(monkeypatch, tmp_path / "hf-cache")
    settings = make_settings(tmp_path, sqlite_url, lease_seconds=LEASE_SECONDS, hub_downloads=False)
    job_id = create_job(settings, new_project(settings).id, sft_spec(model="org/not-cached"))

    start = time.monotonic()
    assert runner.run_job(job_id, settings=settings, worker="w:1") == "failed"
    assert time.monotonic() - start < 10
    job = get_job(settings, job_id)
    assert job.error_code == "invalid_spec"
    assert job.error_message is not None and "RLHF_HUB_DOWNLOADS" in job.error_message


def test_a_job_reference_to_an_unfinished_job_fails_with_invalid_spec(sqlite_settings: Settings) -> None:
    settings = sqlite_settings
    project_id = new_project(settings).id
    unfinished = create_job(settings, project_id, sft_spec())
    job_id = create_job(settings, project_id, sft_spec(model=f"job:{unfinished}"))

    assert runner.run_job(job_id, settings=settings, worker="w:1") == "failed"
    job = get_job(settings, job_id)
    assert job.error_code == "invalid_spec"
    assert job.error_message is not None and unfinished in job.error_message
    assert get_job(settings, unfinished).status == "queued"


def from_pretrained() -> None:
    raise OSError("no such model")


def raised(f: Callable[[], None]) -> BaseException:
    try:
        f()
    except BaseException as e:
        return e
    raise AssertionError("did not raise")


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (DatasetError("line 3: field 'prompt' must be a non-empty string"), "dataset_invalid"),
        (
            ChatTemplateMissingError("dataset: the rows are chat messages, and ... no chat template"),
            "chat_template_missing",
        ),
        (ModelNotFoundError("cannot load 'x'"), "model_not_found"),
        (raised(from_pretrained), "model_not_found"),
        (IncompleteSaveError("the qwen3_moe model saved in policy would not load back whole"), "model_save_failed"),
        (NonFiniteLossError("loss/sft is nan at step 3"), "non_finite_loss"),
        (TrainingCollapseError("training collapse at step 8 (kl_jump); on_collapse is stop"), "training_collapse"),
        (torch.cuda.OutOfMemoryError("CUDA out of memory"), "out_of_memory"),
        (MemoryError(), "out_of_memory"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 6 GB"), "out_of_memory"),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory"), "out_of_memory"),
        (ValueError("max_new_tokens + a one-token prompt (200 tokens) exceeds the model's context"), "invalid_spec"),
        (OSError(28, "No space left on device"), "disk_full"),
        (RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 308864 vs 308752"), "disk_full"),
        (OSError(30, "Read-only file system"), "storage_not_writable"),
        (RuntimeError("boom"), "internal_error"),
    ],
)
def test_error_codes(error: BaseException, code: str) -> None:
    assert runner.error_code(error) == code


def test_a_lost_process_loses_the_attempt_and_requeues_the_job(
    settings: Settings, project_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that was lost (its host died) is the attempt's end, as a lost lease is: back to the queue with the
    next attempt, until the last, which fails ``worker_lost``."""
    job_id = create_job(settings, project_id, sft_spec(resources={"num_processes": 2}))

    def lose(*args: object, **kwargs: object) -> None:
        raise RankFailure(LOST, "rank 1 lost its connection to another: Connection reset by peer")

    monkeypatch.setattr(runner, "run_distributed", lose)
    monkeypatch.setattr(runner, "processors", lambda: 2)
    for attempt in range(1, settings.max_attempts):
        assert runner.run_job(job_id, settings=settings, worker="w:1") == "queued"
        job = get_job(settings, job_id)
        assert (job.attempt, job.worker, job.sent_at) == (attempt + 1, None, None)
    assert runner.run_job(job_id, settings=settings, worker="w:1") == "failed"
    job = get_job(settings, job_id)
    assert (job.error_code, job.attempt) == ("worker_lost", settings.max_attempts)
    assert job.error_message is not None and "each of its 3 attempts" in job.error_message
    warnings = [e.message for e in events(settings, job_id) if e.kind == "warning"]
    assert len(warnings) == settings.max_attempts - 1 and "goes back to the queue for attempt 2" in warnings[0]


def test_a_job_that_cannot_fit_the_workers_gpu_fails_before_it_loads(
    sqlite_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU worker plans the job's memory against its own GPU (here a 4 MiB one: the built-in model's full
    fine-tune holds 4 values a parameter) and fails it at once with the figures and the setting that fits."""
    job_id = create_job(sqlite_settings, new_project(sqlite_settings).id, sft_spec())
    monkeypatch.setattr(runner, "device_bytes", lambda: 4 * 1024 * 1024)
    assert runner.run_job(job_id, settings=sqlite_settings, worker="w:1") == "failed"
    job = get_job(sqlite_settings, job_id)
    assert job.error_code == "model_does_not_fit" and job.error_message is not None
    assert (
        "do not fit a 4.00 MiB device as they are held (one process): each rank would hold 1.86 MiB"
        in job.error_message
    )
    assert (
        'it fits with {"resources": {"sharding": "fsdp", "num_processes": 4}}' in job.error_message
    )  # 8 rows: 4, not 3
    assert disk_checkpoint_steps(sqlite_settings, job_id) == []


def test_a_lost_vllm_server_loses_the_attempt_and_requeues_the_job(
    settings: Settings, project_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's vLLM server that dies mid-job (``RolloutEngineLost``) ends the attempt as a lost process does: back
    to the queue with the next attempt, which resumes from the last checkpoint."""
    job_id = create_job(settings, project_id, sft_spec())

    def lose(*args: object, **kwargs: object) -> None:
        raise RolloutEngineLost("the vLLM server at http://127.0.0.1:9 is gone (it exited with code -9: killed)")

    monkeypatch.setattr(runner, "run_engine", lose)
    assert runner.run_job(job_id, settings=settings, worker="w:1") == "queued"
    job = get_job(settings, job_id)
    assert (job.attempt, job.worker) == (2, None)
    warnings = [e.message for e in events(settings, job_id) if e.kind == "warning"]
    assert "vLLM server" in warnings[0] and "goes back to the queue for attempt 2" in warnings[0]


def test_a_worker_offers_its_vllm_to_jobs(sqlite_settings: Settings, tmp_path: Path) -> None:
    """``RLHF_VLLM_URL`` / ``RLHF_VLLM_PYTHON`` are what a ``rollout_engine: vllm`` job samples on; none: None."""

    def offered(**fields: object) -> VllmSettings | None:
        worker_settings = sqlite_settings.model_copy(update=fields)
        return runner.DbCallbacks("job_x", settings=worker_settings, worker="w:1", out_dir=tmp_path).vllm()

    assert offered() is None
    assert offered(vllm_python="/opt/vllm/bin/python", vllm_start_timeout_seconds=90) == VllmSettings(
        python="/opt/vllm/bin/python", start_timeout=90
    )
    assert offered(vllm_url="http://127.0.0.1:8000") == VllmSettings(url="http://127.0.0.1:8000")
    assert runner.error_code(RolloutOutOfSyncError("gap")) == "rollout_out_of_sync"
    assert runner.error_code(RolloutEngineError("refused")) == "rollout_engine_failed"
