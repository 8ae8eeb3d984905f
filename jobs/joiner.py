"""A train worker as one more host of a job another worker claimed (``resources.num_nodes > 1``).

The claiming worker sends one invitation per host it waits for to the job's queue (:func:`jobs.celery_app.
send_invitation`); a train worker that takes one runs the job's ranks for its host under torchrun
(:func:`jobs.distributed.join_distributed`) while the job runs that attempt, once it proved to the claiming worker
that it holds the secret the hosts share (:func:`jobs.channel.node_secret`; the invitation holds none). It writes
nothing to the database: the ranks report to the claiming worker. An invitation for an attempt that ended (a
redelivered message, a job that stopped waiting) is dropped. A joined worker asked to shut down stops its ranks at
once, which ends the attempt as a lost worker would: the job goes back to the queue from its last checkpoint.
"""

import logging

from sqlalchemy.orm import Session

from jobs import runner
from jobs.channel import node_secret
from jobs.distributed import Invitation, join_distributed
from jobs.store import crud
from jobs.store.models import ACTIVE_STATUSES
from jobs.store.settings import Settings

log = logging.getLogger(__name__)


def join_job(message: dict[str, object], *, settings: Settings, worker: str) -> str:
    """Take part in the job ``message`` invites to; returns ``joined`` once its ranks here ended, or why not
    (``stale``: the attempt is over, or the claiming worker needs no more hosts; ``too_small``; ``stopping``)."""
    try:
        invitation = Invitation(**message)  # type: ignore[arg-type]
    except TypeError:  # an older worker's
        log.warning("an invitation this worker does not read: %s", sorted(message))
        return "stale"
    if not runs(settings, invitation):
        log.info("job %s no longer runs attempt %d: not joining", invitation.job_id, invitation.attempt)
        return "stale"
    if invitation.num_processes > (available := runner.processors()):
        log.error("job %s wants %d processes per host; this worker has %d: not joining (the job waits for another)",
                  invitation.job_id, invitation.num_processes, available)  # fmt: skip
        return "too_small"
    if runner.stopping.is_set():
        return "stopping"
    log.info("job %s: %s joins attempt %d as one of its %d hosts", invitation.job_id, worker, invitation.attempt,
             invitation.num_nodes)  # fmt: skip
    code = join_distributed(
        invitation,
        node_secret(settings.resolved_artifacts_dir),
        lambda: runs(settings, invitation) and not runner.stopping.is_set(),
    )
    if code is None:
        return "stale"
    log.info("job %s: this host's ranks ended (torchrun exited with %d)", invitation.job_id, code)
    return "joined"


def runs(settings: Settings, invitation: Invitation) -> bool:
    """Whether the job still runs the attempt ``invitation`` is for."""

    def read(session: Session) -> bool:
        job = crud.get_job(session, job_id=invitation.job_id)
        return job is not None and job.status in ACTIVE_STATUSES and job.attempt == invitation.attempt

    return runner.in_transaction(settings.resolved_database_url, read)
