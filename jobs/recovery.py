"""Recovery of jobs whose worker stopped renewing its lease, and release of jobs waiting for others, run by every
worker and by the API.

:func:`recover_once` requeues the lost jobs in one transaction and, after the commit, sends each requeued job to
its train queue with the caller's ``enqueue`` (the API's, or a worker's Celery app); :func:`release_once` does the
same for waiting jobs whose dependencies succeeded (and fails those whose dependencies cannot); :func:`resend_once`
sends again the queued jobs whose message was lost (see ``crud.claim_unsent``); :func:`end_abandoned_once` ends the
training sessions no worker holds whose client went away. Every send is recorded in the job's ``sent_at`` once the
broker took it. :class:`RecoveryThread` repeats the four every ``interval`` seconds from a
daemon thread, after one sweep when the process starts.
"""

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

from jobs.store import crud, sessions
from jobs.store.db import session_scope
from jobs.store.pipelines import release_waiting
from jobs.store.settings import Settings

log = logging.getLogger(__name__)

UNSENT_GRACE_S = 10.0
"""A job queued this long without its message having gone out is taken as lost by the periodic sweeps: the
sender (an API request, a worker) sends within moments of its commit. The sweep at a process's start does not
wait (a duplicate is a no-op)."""


def recover_once(settings: Settings, enqueue: Callable[[str, str], None]) -> list[str]:
    """One sweep: requeue the jobs whose lease expired, then send each with ``enqueue(job id, queue)``; returns
    the ids requeued. A job that cannot be sent is logged, and the others are still sent."""
    with session_scope(settings.resolved_database_url) as session:
        requeued = crud.recover_expired(session, max_attempts=settings.max_attempts)
    return send(settings, requeued, enqueue, "lost its worker; requeued", "recovered", logging.WARNING)


def end_abandoned_once(settings: Settings) -> list[str]:
    """End the sessions that no worker holds yet whose client stopped beating (a running one is ended by its
    worker); returns their ids."""
    with session_scope(settings.resolved_database_url) as session:
        ended = sessions.end_abandoned(session, timeout_s=settings.session_timeout_seconds)
    for job_id in ended:
        log.info("session %s ended before a worker took it: its client stopped beating", job_id)
    return ended


def release_once(
    settings: Settings, enqueue: Callable[[str, str], None], dependency_ids: Sequence[str] | None = None
) -> list[str]:
    """One pass of :func:`jobs.store.pipelines.release_waiting` (over the jobs waiting for ``dependency_ids``, or
    all), then send each job it queued with ``enqueue``; returns their ids. Called after a job ends, and by the
    sweeps."""
    with session_scope(settings.resolved_database_url) as session:
        queued = release_waiting(session, dependency_ids=dependency_ids)
    return send(settings, queued, enqueue, "the jobs it waited for succeeded; queued", "released", logging.INFO)


def resend_once(
    settings: Settings, enqueue: Callable[[str, str], None], unsent_grace_s: float = UNSENT_GRACE_S
) -> list[str]:
    """Send again each queued job whose message never went out ``unsent_grace_s`` after it was queued, or went
    out ``settings.resend_seconds`` ago with no worker claiming the job since; returns their ids."""
    with session_scope(settings.resolved_database_url) as session:
        due = crud.claim_unsent(
            session,
            unsent_for=timedelta(seconds=unsent_grace_s),
            resend_after=timedelta(seconds=settings.resend_seconds),
        )
    return send(settings, due, enqueue, "was queued with no message on its way; sent again", "lost", logging.WARNING)


def send(
    settings: Settings,
    jobs: list[tuple[str, str]],
    enqueue: Callable[[str, str], None],
    logged: str = "sent",
    which: str = "queued",
    level: int = logging.INFO,
) -> list[str]:
    """Send each (job id, queue), after the commit that queued them, then record the sends (``sent_at``); one the
    broker refuses is logged, left for the next sweep to send again, and the others are still sent. Returns the
    ids."""
    sent, refused = [], []
    for job_id, queue in jobs:
        log.log(level, "job %s %s", job_id, logged)
        try:
            enqueue(job_id, queue)
            sent.append(job_id)
        except Exception:
            log.exception("could not enqueue %s job %s", which, job_id)
            refused.append(job_id)
    if jobs:
        with session_scope(settings.resolved_database_url) as session:
            crud.mark_sent(session, job_ids=sent)
            crud.unmark_sent(session, job_ids=refused)
    return [job_id for job_id, _ in jobs]


class RecoveryThread(threading.Thread):
    """Calls :func:`recover_once`, :func:`end_abandoned_once`, :func:`release_once` and :func:`resend_once` every
    ``interval`` seconds (the first time after one interval: the process runs :meth:`sweep` itself when it starts)
    until stopped."""

    def __init__(self, settings: Settings, enqueue: Callable[[str, str], None], interval: float) -> None:
        super().__init__(name="rlhf-lease-recovery", daemon=True)
        self.settings, self.enqueue, self.interval = settings, enqueue, interval
        self.stopping = threading.Event()

    def sweep(self, unsent_grace_s: float = UNSENT_GRACE_S) -> None:
        """One :func:`recover_once`, :func:`end_abandoned_once`, :func:`release_once` and :func:`resend_once` (with
        ``unsent_grace_s``: 0 at a process's start, which sends at once what it finds lost); a failure is logged, and
        the next sweep tries again."""
        try:
            recover_once(self.settings, self.enqueue)
            end_abandoned_once(self.settings)
            release_once(self.settings, self.enqueue)
            resend_once(self.settings, self.enqueue, unsent_grace_s)
        except Exception:
            log.exception("lease recovery failed; retrying in %s s", self.interval)

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            self.sweep()

    def stop(self) -> None:
        """Ask the thread to stop, and wait up to 10 s for a sweep in progress."""
        self.stopping.set()
        self.join(timeout=10)
