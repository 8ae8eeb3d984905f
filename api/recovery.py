"""Recovery of jobs whose worker stopped renewing its lease (DESIGN §2: "by any live worker or the API").

A daemon thread runs ``crud.recover_expired`` every ``interval`` seconds and, after the commit, sends the
requeued jobs back to their train queues.
"""

import logging
import threading

from api.deps import Enqueue
from jobs.store import crud
from jobs.store.db import session_scope
from jobs.store.settings import Settings

logger = logging.getLogger(__name__)


def recover_once(settings: Settings, enqueue: Enqueue) -> list[str]:
    """One sweep; returns the ids requeued."""
    with session_scope(settings.resolved_database_url) as session:
        requeued = crud.recover_expired(session, max_attempts=settings.max_attempts)
    for job_id, queue in requeued:  # after the commit
        logger.warning("job %s lost its worker; requeued", job_id)
        try:
            enqueue(job_id, queue)
        except Exception:
            logger.exception("could not enqueue recovered job %s", job_id)
    return [job_id for job_id, _ in requeued]


class RecoveryThread(threading.Thread):
    def __init__(self, settings: Settings, enqueue: Enqueue, interval: float) -> None:
        super().__init__(name="rlhf-lease-recovery", daemon=True)
        self.settings, self.enqueue, self.interval = settings, enqueue, interval
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                recover_once(self.settings, self.enqueue)
            except Exception:
                logger.exception("lease recovery failed; retrying in %s s", self.interval)

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)
