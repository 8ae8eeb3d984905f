"""Recovery of jobs whose worker stopped renewing its lease, and release of jobs waiting for others, run by every
worker and by the API.

:func:`recover_once` requeues the lost jobs in one transaction and, after the commit, sends each requeued job to
its train queue with the caller's ``enqueue`` (the API's, or a worker's Celery app); :func:`release_once` does the
same for waiting jobs whose dependencies succeeded (and fails those whose dependencies cannot).
:class:`RecoveryThread` repeats both every ``interval`` seconds from a daemon thread.
"""

import logging
import threading
from collections.abc import Callable

from jobs.store import crud
from jobs.store.db import session_scope
from jobs.store.pipelines import release_waiting
from jobs.store.settings import Settings

log = logging.getLogger(__name__)


def recover_once(settings: Settings, enqueue: Callable[[str, str], None]) -> list[str]:
    """One sweep: requeue the jobs whose lease expired, then send each with ``enqueue(job id, queue)``; returns
    the ids requeued. A job that cannot be sent is logged, and the others are still sent."""
    with session_scope(settings.resolved_database_url) as session:
        requeued = crud.recover_expired(session, max_attempts=settings.max_attempts)
    return _send(requeued, enqueue, "lost its worker; requeued", "recovered", logging.WARNING)


def release_once(settings: Settings, enqueue: Callable[[str, str], None]) -> list[str]:
    """One pass of :func:`jobs.store.pipelines.release_waiting`, then send each job it queued with ``enqueue``;
    returns their ids. Called after a job ends, and by the sweeps."""
    with session_scope(settings.resolved_database_url) as session:
        queued = release_waiting(session)
    return _send(queued, enqueue, "the jobs it waited for succeeded; queued", "released", logging.INFO)


def _send(
    jobs: list[tuple[str, str]], enqueue: Callable[[str, str], None], logged: str, which: str, level: int
) -> list[str]:
    """Send each (job id, queue), after the commit that queued them; one the broker refuses is logged and the others
    are still sent. Returns the ids."""
    for job_id, queue in jobs:
        log.log(level, "job %s %s", job_id, logged)
        try:
            enqueue(job_id, queue)
        except Exception:
            log.exception("could not enqueue %s job %s", which, job_id)
    return [job_id for job_id, _ in jobs]


class RecoveryThread(threading.Thread):
    """Calls :func:`recover_once` and :func:`release_once` every ``interval`` seconds (the first time after one
    interval) until stopped."""

    def __init__(self, settings: Settings, enqueue: Callable[[str, str], None], interval: float) -> None:
        super().__init__(name="rlhf-lease-recovery", daemon=True)
        self.settings, self.enqueue, self.interval = settings, enqueue, interval
        self.stopping = threading.Event()

    def sweep(self) -> None:
        """One :func:`recover_once` and one :func:`release_once`; a failure is logged, and the next sweep tries
        again."""
        try:
            recover_once(self.settings, self.enqueue)
            release_once(self.settings, self.enqueue)
        except Exception:
            log.exception("lease recovery failed; retrying in %s s", self.interval)

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            self.sweep()

    def stop(self) -> None:
        """Ask the thread to stop, and wait up to 10 s for a sweep in progress."""
        self.stopping.set()
        self.join(timeout=10)
