"""Running one training job on a worker: claim it, resolve its spec, call the engine, persist what it
reports, and record how it ended. The Celery task in tasks.py is a thin wrapper around :func:`run_job`.

Every database write goes through a transaction that first renews the job's lease (a heartbeat), so a
worker that lost its job — recovered by someone else after its lease ran out — writes nothing more.

A job resumed after its worker was lost starts again from its newest checkpoint: the metrics the lost
worker recorded for later steps are deleted and computed again, so the history holds every step once,
with the values of the run that produced the final weights.

A job with ``resources.num_processes > 1`` trains under torchrun (jobs/distributed.py); this worker still does
all of the above, answering rank 0's callbacks. A job across hosts (``resources.num_nodes > 1``) also invites
train workers of its queue to join as its other hosts (jobs/joiner.py). A process of the job that is lost (its
host died) loses the attempt, as a lost lease does: the job goes back to the queue, from its last checkpoint.

A worker asked to stop (SIGTERM, Ctrl-C: :data:`stopping`) does not hold its shutdown up until the job
ends: the job finishes its current step, checkpoints and goes back to the queue (``queued``, the same
attempt: nothing was lost), and the task sends it to another worker.
"""

import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch
from huggingface_hub import constants as hub_constants
from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session

from engine.callbacks import Callbacks, StopRequest, VllmSettings
from engine.core.checkpoint import list_checkpoints
from engine.core.data import DatasetError
from engine.core.health import TrainingCollapseError
from engine.core.loop import NonFiniteLossError
from engine.core.models import IncompleteSaveError, ModelNotFoundError
from engine.core.vllm import RolloutEngineError, RolloutEngineLost, RolloutOutOfSyncError
from engine.rewards.graders import RewardError, RewardFunctionError, RewardServiceError, model_refs, replace_models
from engine.rewards.judge import Endpoint
from engine.run import run_job as run_engine
from engine.spec.config import MODEL_FIELDS, JobSpec, format_errors
from engine.spec.hub import is_hub_id
from engine.spec.memory import Weights, builtin_weights, read_weights, refusal
from engine.spec.rows import ChatTemplateMissingError
from engine.tracking import Tracker, TrackingOptions, quiet_environment, switched_on
from jobs.celery_app import celery_app, send_invitation
from jobs.channel import node_secret
from jobs.distributed import LOST, Hosts, Invitation, RankFailure, run_distributed
from jobs.downloads import DownloadStopped, HubDownloadError, download
from jobs.store import crud, refs
from jobs.store.db import session_scope
from jobs.store.models import ACTIVE_STATUSES, SESSION_TYPE, utcnow
from jobs.store.settings import Settings
from jobs.store.storage import MESSAGES as STORAGE_MESSAGES
from jobs.store.storage import storage_error

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long a database write is retried before the worker gives up on it (for now)."""

    attempts: int = 5
    """Tries in all, the first included."""
    delay_s: float = 0.5
    """Wait before the second try; doubled before each further one (0.5 + 1 + 2 + 4 s by default)."""


DB_RETRY = RetryPolicy()
STATUS_MAX_AGE_S = 1.0
""":meth:`DbCallbacks.should_stop` reads the job's status again when what it knows is older than this: a cancel
or pause reaches a job waiting inside a step (an http grader calling its service) within about this long."""


def is_transient(error: BaseException) -> bool:
    """A database that is restarting, unreachable or briefly locked: worth trying again."""
    return isinstance(error, OperationalError) or (isinstance(error, DBAPIError) and error.connection_invalidated)


def in_transaction(url: str, work: Callable[[Session], T], retry: RetryPolicy | None = None) -> T:
    """``work(session)`` in one transaction, committed; retried from scratch on transient errors."""
    retry = retry or DB_RETRY
    for attempt in range(1, retry.attempts + 1):
        try:
            with session_scope(url) as session:
                result = work(session)
            return result
        except DBAPIError as e:
            if not is_transient(e) or attempt == retry.attempts:
                raise
            delay = retry.delay_s * 2 ** (attempt - 1)
            log.warning("database unavailable (%s); try %d of %d in %.1f s", e.orig, attempt + 1, retry.attempts, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


stopping = threading.Event()
"""Set when this worker process is asked to shut down (by tasks.py, on Celery's ``worker_shutting_down``):
the running job stops after its current step, with a checkpoint, and is handed back to the queue."""


class LeaseLostError(RuntimeError):
    """The job is no longer this worker's (its lease ran out and it was recovered, or it was taken away)."""


Write = Callable[[Session], object]
Outcome = tuple[tuple[str, ...], str, dict[str, Any]]
"""A guarded status change: (from statuses, to, other column values)."""


def succeeded(step: int) -> list[Outcome]:
    return [(ACTIVE_STATUSES, "succeeded", {"output_step": step, "finished_at": utcnow()})]


def paused() -> list[Outcome]:
    # A pause that crossed a cancel request ends cancelled.
    return [(("running", "pausing"), "paused", {}), (("cancelling",), "cancelled", {"finished_at": utcnow()})]


def cancelled() -> list[Outcome]:
    return [(ACTIVE_STATUSES, "cancelled", {"finished_at": utcnow()})]


def handed_back() -> list[Outcome]:
    """Back to the queue for another worker, the attempt unchanged; a pause or cancel asked meanwhile wins."""
    return [(("running",), "queued", {}), *paused()]


def failed(code: str, message: str) -> list[Outcome]:
    values = {"error_code": code, "error_message": message, "finished_at": utcnow()}
    return [(ACTIVE_STATUSES, "failed", values)]


def retried(attempt: int) -> list[Outcome]:
    """Back to the queue for its next attempt (a lost process lost this one); a pause or cancel asked meanwhile
    wins."""
    return [(("running",), "queued", {"attempt": attempt + 1, "sent_at": None}), *paused()]


class DbCallbacks(Callbacks):
    """Persists a running job's progress, and turns the job's status into the engine's stop requests.

    Each callback is one short transaction: heartbeat, then the writes. A write that keeps failing
    (database down longer than the retries) is kept and committed with the next one, so no metric is
    lost. A heartbeat that finds the job gone raises :class:`LeaseLostError` out of the engine.
    """

    def __init__(self, job_id: str, *, settings: Settings, worker: str, out_dir: Path) -> None:
        self.job_id = job_id
        self.judges = settings.judges
        self.vllm_settings = settings.vllm()
        """The vLLM this worker offers its jobs (``RLHF_VLLM_URL``, else ``RLHF_VLLM_PYTHON``), or None."""
        self.worker = worker
        self.url = settings.resolved_database_url
        self.lease_seconds = settings.lease_seconds
        self.artifacts = settings.resolved_artifacts_dir
        self.out_dir = out_dir
        self.status: str | None = "running"
        """The job's status at the last heartbeat (the API asks for a stop by changing it)."""
        self.status_at = time.monotonic()
        """When ``status`` was read, or last tried to be (``time.monotonic()``)."""
        self.lease_lost = threading.Event()
        self._pending: list[Write] = []
        """Writes not committed yet, oldest first."""
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        """Metric names already reported as non-finite."""
        self.handing_back = False
        """The engine was asked to stop because this worker is shutting down (see :data:`stopping`)."""

    # --- what the engine calls -----------------------------------------------------------------

    def on_start(self, start_step: int, total_steps: int) -> None:
        def write(session: Session) -> None:
            crud.set_job_progress(session, job_id=self.job_id, step=start_step, total_steps=total_steps)
            # Steps a lost worker got past its last checkpoint: computed again from here, so recorded again.
            discarded = crud.forget_metrics_after(session, job_id=self.job_id, step=start_step)
            crud.forget_samples_after(session, job_id=self.job_id, step=start_step)
            if discarded:
                message = (f"metrics of steps {discarded[0]}-{discarded[-1]} discarded: recorded after the last "
                           f"checkpoint (step {start_step}), they are computed again")  # fmt: skip
                data = {"from_step": discarded[0], "to_step": discarded[-1], "checkpoint_step": start_step}
                crud.add_event(session, job_id=self.job_id, kind="info", message=message, data=data)

        self._commit(write)

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        values = self._finite(step, metrics)
        self._commit(lambda s: crud.add_metrics(s, job_id=self.job_id, step=step, metrics=values))

    def on_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        kept = [dict(sample) for sample in samples]
        self._commit(lambda s: crud.add_samples(s, job_id=self.job_id, step=step, samples=kept))

    def on_event(self, kind: str, message: str, data: dict[str, object] | None = None) -> None:
        values = dict(data or {})
        self._commit(lambda s: crud.add_event(s, job_id=self.job_id, kind=kind, message=message, data=values))

    def on_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        relative = path.resolve().relative_to(self.artifacts).as_posix()
        kept = [s for s, _ in list_checkpoints(self.out_dir)]
        values = {name: value for name, value in metrics.items() if math.isfinite(value)}
        self._commit(
            lambda s: crud.record_checkpoint(
                s, job_id=self.job_id, step=step, path=relative, metrics=values, kept_steps=kept
            )
        )

    def judge(self, model: str) -> Endpoint | None:
        """This worker's judge of that name (``RLHF_JUDGES``)."""
        setting = self.judges.get(model)
        return setting.endpoint(model) if setting is not None else None

    def vllm(self) -> VllmSettings | None:
        return self.vllm_settings

    def should_stop(self) -> StopRequest | None:
        if time.monotonic() - self.status_at > STATUS_MAX_AGE_S:
            self.status_at = time.monotonic()  # a read that fails is tried again a second later, not at every ask
            self.renew()
        self._check_lease()
        if self.status == "cancelling":
            return "cancel"
        if self.status == "pausing":
            return "pause"
        if stopping.is_set():
            self.handing_back = True
            return "pause"  # a checkpoint now; the job goes back to the queue rather than to paused
        return None

    # --- lease and writes ----------------------------------------------------------------------

    def renew(self) -> None:
        """Heartbeat only (from the lease thread while the engine is busy); never raises."""
        try:
            with session_scope(self.url) as session:
                status = crud.heartbeat(
                    session, job_id=self.job_id, worker=self.worker, lease_seconds=self.lease_seconds
                )
        except Exception as e:
            log.warning("job %s: lease renewal failed: %s", self.job_id, e)
            return
        if status is None:
            log.warning("job %s: lost its lease", self.job_id)
            self.lease_lost.set()
        else:
            self.status, self.status_at = status, time.monotonic()

    def finish(self, outcomes: list[Outcome], event: tuple[str, str, dict[str, Any]] | None = None) -> str:
        """Commit what is pending, then the first of ``outcomes`` whose guard matches, and an optional
        event (kind, message, data), in one transaction; returns the job's status.

        The worker lets go of the job: ``worker`` and ``lease_until`` are cleared in the same transaction.
        """

        def write(session: Session) -> str:
            self._flush(session)
            for from_statuses, to, values in outcomes:
                free = {"worker": None, "lease_until": None}
                if crud.transition(session, job_id=self.job_id, from_statuses=from_statuses, to=to, **free, **values):
                    break
            if event is not None:
                crud.add_event(session, job_id=self.job_id, kind=event[0], message=event[1], data=event[2])
            return _status(session, self.job_id)

        with self._lock:
            status = in_transaction(self.url, write)
            self._pending.clear()
        return status

    def _finite(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """The finite metrics. NaN and infinity fit neither JSON columns nor JSON responses; the first of
        each name is reported in a warning event instead."""
        finite = {name: float(value) for name, value in metrics.items() if math.isfinite(value)}
        for name in sorted(metrics.keys() - finite.keys() - self._warned):
            self._warned.add(name)
            message = f"{name} is {metrics[name]} at step {step}; non-finite values are not recorded"
            self._pending.append(self._event(message, {"metric": name, "step": step}))
        return finite

    def _event(self, message: str, data: dict[str, Any]) -> Write:
        return lambda s: crud.add_event(s, job_id=self.job_id, kind="warning", message=message, data=data)

    def _commit(self, write: Write) -> None:
        """Heartbeat and ``write`` (after any writes still pending) in one transaction."""
        self._check_lease()
        with self._lock:
            self._pending.append(write)
            try:
                self.status, self.status_at = in_transaction(self.url, self._flush), time.monotonic()
            except LeaseLostError:
                self._pending.clear()
                self.lease_lost.set()
                raise
            except DBAPIError as e:
                if not is_transient(e):
                    self._pending.clear()
                    raise
                log.error("job %s: database unavailable, %d writes kept for later: %s", self.job_id,
                          len(self._pending), e.orig)  # fmt: skip
                return
            self._pending.clear()

    def _flush(self, session: Session) -> str:
        status = crud.heartbeat(session, job_id=self.job_id, worker=self.worker, lease_seconds=self.lease_seconds)
        if status is None:
            raise LeaseLostError(f"job {self.job_id} is no longer run by {self.worker}")
        for write in self._pending:
            write(session)
        return status

    def _check_lease(self) -> None:
        if self.lease_lost.is_set():
            raise LeaseLostError(f"job {self.job_id} is no longer run by {self.worker}")


class LeaseRenewer:
    """Renews the lease every ``lease_seconds / 3`` from a background thread, for the stretches where no
    callback runs (loading models, a step longer than the lease). Use as a context manager."""

    def __init__(self, callbacks: DbCallbacks, interval_s: float) -> None:
        self.callbacks = callbacks
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{callbacks.job_id}", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.callbacks.renew()
            if self.callbacks.lease_lost.is_set():
                return

    def __enter__(self) -> "LeaseRenewer":
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()


def error_code(error: BaseException) -> str:
    """The job's ``error_code`` for an exception out of the engine."""
    if isinstance(error, ChatTemplateMissingError):
        return "chat_template_missing"  # chat rows, and a tokenizer without a chat template
    if isinstance(error, DatasetError):
        return "dataset_invalid"
    if isinstance(error, ModelNotFoundError) or (isinstance(error, OSError) and _raised_in_from_pretrained(error)):
        return "model_not_found"
    if problem := storage_error(error):
        return problem  # disk_full or storage_not_writable
    if isinstance(error, IncompleteSaveError):
        return "model_save_failed"  # a saved model that would not load back whole: the message names the weights
    if isinstance(error, NonFiniteLossError):
        return "non_finite_loss"
    if isinstance(error, RewardServiceError):
        return "reward_service_failed"  # an http grader's service down or answering garbage after its retries
    if isinstance(error, RewardFunctionError):
        return "reward_function_failed"  # a python grader raised, or returned something other than numbers
    if isinstance(error, RewardError):
        return "reward_failed"  # e.g. a template naming a column the dataset lacks
    if isinstance(error, RolloutOutOfSyncError):
        return "rollout_out_of_sync"  # after a weight sync, vLLM's log-probs of the probe are not the trainer's
    if isinstance(error, RolloutEngineError):
        return "rollout_engine_failed"  # the job's vLLM server would not start, or refused a request
    if isinstance(error, TrainingCollapseError):
        return "training_collapse"  # a PPO collapse signal, with hyperparameters.collapse.action "stop"
    if isinstance(error, torch.cuda.OutOfMemoryError | MemoryError) or _cpu_out_of_memory(error):
        return "out_of_memory"
    if isinstance(error, ValueError):
        return "invalid_spec"  # e.g. prompts plus responses longer than the model's context
    return "internal_error"


def _cpu_out_of_memory(error: BaseException) -> bool:
    """torch's allocation failure on a CPU: a RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text)


def _raised_in_from_pretrained(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "from_pretrained":
            return True
        tb = tb.tb_next
    return False


def run_job(job_id: str, *, settings: Settings, worker: str) -> str:
    """Run job ``job_id`` if it is queued, as ``worker``; returns the job's status afterwards.

    Idempotent: a job that is not queued (running elsewhere, finished, cancelled) is left alone, so a
    redelivered task does nothing. A job resumes from the newest checkpoint in its folder. ``queued``
    afterwards means the job goes back to the queue (this worker is shutting down and handed it back, or a lost
    process lost the attempt): the caller sends it again.
    """
    url = settings.resolved_database_url
    artifacts = settings.resolved_artifacts_dir
    if stopping.is_set():  # received while shutting down: leave it queued, for the caller to send on
        return in_transaction(url, lambda s: _status(s, job_id))

    # 1. claim the job: queued → running, leased to this worker
    def claim(session: Session) -> tuple[bool, str]:
        claimed = crud.claim_job(session, job_id=job_id, worker=worker, lease_seconds=settings.lease_seconds)
        job = crud.get_job(session, job_id=job_id)
        if claimed and job is not None:
            crud.add_event(session, job_id=job_id, kind="info", message=f"running on {worker}, attempt {job.attempt}",
                           data={"worker": worker, "attempt": job.attempt})  # fmt: skip
        if job is None:
            return False, "missing"
        # Already ours: a retry of this claim, whose commit went through before the connection dropped.
        return claimed or (job.status == "running" and job.worker == worker), job.status

    claimed, status = in_transaction(url, claim)
    if not claimed:
        log.info("job %s is %s, not queued: nothing to do", job_id, status)
        return status

    out_dir = refs.job_dir(artifacts, job_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_dir.chmod(0o700)  # owner-only, also a folder an earlier version made readable by all
    callbacks = DbCallbacks(job_id, settings=settings, worker=worker, out_dir=out_dir)
    try:
        with LeaseRenewer(callbacks, settings.lease_seconds / 3):
            outcomes, event = _train(job_id, settings, out_dir, callbacks)
        # 4. record how it ended, and let go of the job
        return callbacks.finish(outcomes, event)
    except LeaseLostError:
        log.warning("job %s: lease lost; leaving the job to its new owner", job_id)
        return in_transaction(url, lambda s: _status(s, job_id))
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


Ending = tuple[list[Outcome], tuple[str, str, dict[str, Any]] | None]
"""How a job ended: its status transitions, and an event to add."""


def _train(job_id: str, settings: Settings, out_dir: Path, callbacks: DbCallbacks) -> Ending:
    if in_transaction(settings.resolved_database_url, lambda s: _job_type(s, job_id)) == SESSION_TYPE:
        from jobs.session import run_session  # it builds on this module's callbacks

        return run_session(job_id, settings, out_dir, callbacks)
    # 2. the spec, with job: and file- references turned into paths
    try:
        submitted, spec = in_transaction(settings.resolved_database_url, lambda s: _specs(s, job_id, settings))
    except refs.SpecReferenceError as e:  # a model folder gone since submit is still model_not_found
        return _failure("model_not_found" if e.code == "model_not_found" else "invalid_spec", str(e))
    except ValidationError as e:
        return _failure("invalid_spec", format_errors(e))
    log.info("job %s: %s job starting in %s", job_id, spec.type, out_dir)
    if settings.hub_downloads and not hub_constants.HF_HUB_OFFLINE:
        try:
            spec = _downloaded(spec, settings, callbacks)
        except DownloadStopped as e:
            return _stopped("cancelled" if e.request == "cancel" else "paused", 0, callbacks)
        except HubDownloadError as e:
            return _failure("hub_download_failed", str(e))
        except ModelNotFoundError as e:
            return _failure("model_not_found", str(e))

    # 3. train, resuming from the newest checkpoint in out_dir if there is one: in this process, or in
    #    resources.num_processes processes under torchrun, on this host or on resources.num_nodes
    processes = spec.resources.num_processes
    if processes > (available := processors()):
        where = f"{available} GPUs" if torch.cuda.is_available() else f"{available} CPU cores"
        return _failure("invalid_spec", f"resources.num_processes is {processes}, and this worker has {where}")
    try:
        why = _does_not_fit(spec, settings)
    except ModelNotFoundError as e:  # a weight file whose header does not read (engine.spec.memory)
        return _failure("model_not_found", str(e))
    if why is not None:  # before the models load: at once, with the figures
        return _failure("model_does_not_fit", why)
    attempt = in_transaction(settings.resolved_database_url, lambda s: _attempt(s, job_id))
    hosts = _hosts(job_id, attempt, spec, settings) if spec.resources.num_nodes > 1 else None
    tracker = _tracker(job_id, submitted, settings, out_dir, callbacks)
    status = "failed"
    try:
        # rank 0 of a job in several processes reports to this process's callbacks, the tracker among them
        if processes == 1 and hosts is None:
            result = run_engine(spec, out_dir, tracker or callbacks)
        else:
            result = run_distributed(spec, out_dir, tracker or callbacks, processes, hosts)
        status = result.status
    except LeaseLostError:
        raise
    except RolloutEngineLost as e:  # the job's vLLM server died: as a lost process, the job resumes
        return _lost(job_id, attempt, settings, str(e))
    except RankFailure as e:
        if e.code == LOST:
            return _lost(job_id, attempt, settings, e.message)
        log.error("job %s failed in one of its processes: %s", job_id, e)
        return _failure(e.code, e.message)
    except Exception as e:
        log.exception("job %s failed", job_id)
        return _failure(error_code(e), str(e) or type(e).__name__)
    finally:
        if tracker is not None:
            tracker.close(status)
    log.info("job %s: %s at step %d", job_id, result.status, result.step)
    if result.status == "succeeded":
        return succeeded(result.step), None
    return _stopped(result.status, result.step, callbacks)


def device_bytes() -> int | None:
    """The memory of one of this worker's GPUs; None without one (a job on CPU processes is not planned)."""
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _does_not_fit(spec: JobSpec, settings: Settings) -> str | None:
    """Why the job's models cannot fit this worker's GPUs as its resources hold them (engine/spec/memory.py), or
    None: they fit, there is no GPU, or the weight files are not at hand."""
    if (device := device_bytes()) is None:
        return None
    models = {}
    for field in ("model", "reward_model", "teacher"):
        ref = getattr(spec, field, None)
        if ref and (weights := _weights(ref)) is not None:
            models[field] = weights
    return refusal(spec, models, device, settings.max_processes) if "model" in models else None


def _weights(ref: str) -> Weights | None:
    if ref.startswith("builtin:"):
        return builtin_weights()
    folder = refs.model_folder(ref)
    return read_weights(folder) if folder is not None else None


def _hosts(job_id: str, attempt: int, spec: JobSpec, settings: Settings) -> Hosts:
    """How this worker takes the job across its hosts: it invites train workers of the job's queue."""
    queue, timeout = spec.resources.queue, settings.join_timeout_seconds

    def invite(invitation: Invitation) -> None:
        send_invitation(celery_app, invitation.to_message(), queue, expires_s=timeout)

    secret = node_secret(settings.resolved_artifacts_dir)
    return Hosts(spec.resources.num_nodes, settings.node_address, job_id, attempt, timeout, invite, secret=secret)


def _lost(job_id: str, attempt: int, settings: Settings, message: str) -> Ending:
    """A process of the job was lost: the attempt is, and the job runs again from its last checkpoint (past
    ``max_attempts``, it fails with ``worker_lost``)."""
    log.warning("job %s lost a process in attempt %d: %s", job_id, attempt, message)
    if attempt >= settings.max_attempts:
        return _failure(LOST, f"a process of the job was lost in each of its {attempt} attempts; the last: {message}")
    event = f"a process of the job was lost ({message}); it goes back to the queue for attempt {attempt + 1}"
    return retried(attempt), ("warning", event, {"code": LOST, "attempt": attempt})


def _tracker(job_id: str, spec: JobSpec, settings: Settings, out_dir: Path, callbacks: DbCallbacks) -> Tracker | None:
    """The job's callbacks writing to the experiment trackers that its spec or the server switch on; None if none
    is. Event files, W&B's offline runs and MLflow's store (without a tracking URI) go to the job's folder."""
    backends = switched_on(spec, settings.tracking)
    if not backends:
        return None
    # before the trackers' libraries start: nothing sent that the operator did not configure, nothing in ~/.cache
    os.environ.update(quiet_environment(settings.resolved_artifacts_dir / "trackers", os.environ))
    options = TrackingOptions(
        backends,
        run_name=job_id,
        mlflow_tracking_uri=settings.mlflow_tracking_uri,
        mlflow_experiment=settings.mlflow_experiment,
        wandb_mode=settings.wandb_mode,
        wandb_project=settings.wandb_project,
    )
    return Tracker(callbacks, spec, out_dir, options)


def _stopped(status: str, step: int, callbacks: DbCallbacks) -> Ending:
    """A job the engine (or a download) stopped on request at ``step``: ``paused`` or ``cancelled``."""
    if status == "paused" and callbacks.handing_back:
        message = f"{callbacks.worker} is shutting down: stopped at step {step} with a checkpoint; requeued"
        return handed_back(), ("info", message, {"step": step, "worker": callbacks.worker})
    if status == "paused":
        return paused(), None
    return cancelled(), None


def _downloaded(spec: JobSpec, settings: Settings, callbacks: DbCallbacks) -> JobSpec:
    """``spec`` with each hub id replaced by the folder it was downloaded to (jobs/downloads.py): the download can
    be stopped and is bounded in time, which loading from the hub inside this process is not."""

    def check() -> StopRequest | None:
        callbacks.renew()  # the job's status now, and the lease kept while nothing else runs
        return callbacks.should_stop()

    graders = [grader for grader in (spec.reward, spec.eval_reward) if grader is not None]
    named = [getattr(spec, field) for field in MODEL_FIELDS]  # reward_model, teacher
    wanted = [spec.model, *named, *(ref for grader in graders for ref in model_refs(grader))]
    folders: dict[str, str] = {}
    for ref in wanted:
        if ref is None or not is_hub_id(ref) or ref in folders:
            continue
        callbacks.on_event("info", f"downloading {ref} from the Hugging Face hub", {"model": ref})
        stall, timeout = settings.hub_stall_seconds, settings.hub_download_seconds
        folders[ref] = download(ref, stall_s=stall, timeout_s=timeout, check=check)
    if not folders:
        return spec
    data = spec.model_dump(mode="json")
    for field in ("model", *MODEL_FIELDS):
        data[field] = folders.get(data[field], data[field])
    for field in ("reward", "eval_reward"):
        if data[field]:
            data[field] = replace_models(data[field], lambda param, ref: folders.get(ref, ref), field)
    return JobSpec.model_validate(data)


def _failure(code: str, message: str) -> Ending:
    if code == "internal_error":  # not the user's to act on, and its text may hold SQL or paths: the log keeps it
        log.error("internal error: %s", message)
        message = "an unexpected error in the worker; the worker's log has the details"
    elif code in STORAGE_MESSAGES:  # e.g. torch's "unexpected pos 308864 vs 308752" for a full disk
        log.error("%s: %s", code, message)
        message = STORAGE_MESSAGES[code]
    return failed(code, message), ("error", message, {"code": code})


def _specs(session: Session, job_id: str, settings: Settings) -> tuple[JobSpec, JobSpec]:
    """The job's spec as submitted (what the trackers record), and with its references resolved (what trains)."""
    job = crud.get_job(session, job_id=job_id)
    assert job is not None, f"job {job_id} disappeared"
    return JobSpec.model_validate(job.spec), JobSpec.model_validate(refs.resolve_stored(session, job, settings))


def processors() -> int:
    """How many processes a job may train in on this machine: one per GPU, or per CPU core without one."""
    return torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count() or 1


def _attempt(session: Session, job_id: str) -> int:
    job = crud.get_job(session, job_id=job_id)
    assert job is not None, f"job {job_id} disappeared"
    return job.attempt


def _job_type(session: Session, job_id: str) -> str:
    job = crud.get_job(session, job_id=job_id)
    assert job is not None, f"job {job_id} disappeared"
    return job.type


def _status(session: Session, job_id: str) -> str:
    job = crud.get_job(session, job_id=job_id)
    return job.status if job is not None else "missing"
