"""Recovery of jobs whose worker stopped renewing its lease, run by every worker and by the API.

:func:`recover_once` requeues them in one transaction and, after the commit, sends each requeued job to its
train queue with the caller's ``enqueue`` (the API's, or a worker's Celery app). :class:`RecoveryThread`
repeats it every ``interval`` seconds from a daemon thread.
"""

import logging
import threading
from collections.abc import Callable

from jobs.store import crud
from jobs.store.db import session_scope
from jobs.store.settings import Settings

log = logging.getLogger(__name__)


def recover_once(settings: Settings, enqueue: Callable[[str, str], None]) -> list[str]:
    """One sweep: requeue the jobs whose lease expired, then send each with ``enqueue(job id, queue)``; returns
    the ids requeued. A job that cannot be sent is logged, and the others are still sent."""
    with session_scope(settings.resolved_database_url) as session:
        requeued = crud.recover_expired(session, max_attempts=settings.max_attempts)
    for job_id, queue in requeued:  # after the commit
        log.warning("job %s lost its worker; requeued", job_id)
        try:
            enqueue(job_id, queue)
        except Exception:
            log.exception("could not enqueue recovered job %s", job_id)
    return [job_id for job_id, _ in requeued]


class RecoveryThread(threading.Thread):
    """Calls :func:`recover_once` every ``interval`` seconds (the first time after one interval) until stopped."""

    def __init__(self, settings: Settings, enqueue: Callable[[str, str], None], interval: float) -> None:
        super().__init__(name="rlhf-lease-recovery", daemon=True)
        self.settings, self.enqueue, self.interval = settings, enqueue, interval
        self.stopping = threading.Event()

    def sweep(self) -> None:
        """One :func:`recover_once`; a failure is logged, and the next sweep tries again."""
        try:
            recover_once(self.settings, self.enqueue)
        except Exception:
            log.exception("lease recovery failed; retrying in %s s", self.interval)

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            self.sweep()

    def stop(self) -> None:
        """Ask the thread to stop, and wait up to 10 s for a sweep in progress."""
        self.stopping.set()
        self.join(timeout=10)
