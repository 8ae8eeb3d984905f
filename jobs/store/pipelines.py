"""Jobs that wait for other jobs: a spec naming an unfinished job (``job:<id>`` as ``model``, ``reward_model`` or a
reward grader's model) is stored ``waiting``; once every job it names has succeeded it is queued, and when one of
them fails or is cancelled it fails with ``dependency_failed``, naming that job."""

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs.store import crud
from jobs.store.models import LIVE_STATUSES, Job, utcnow
from jobs.store.refs import dependencies


def release_waiting(session: Session) -> list[tuple[str, str]]:
    """One pass over the waiting jobs, oldest first (so a pipeline's failure reaches its last stage in one pass):
    queue those whose dependencies all succeeded, fail those with one that cannot succeed any more. Returns
    (job id, train queue) of each job queued, for the caller to send after the commit."""
    queued = []
    waiting = session.scalars(select(Job).where(Job.status == "waiting").order_by(Job.created_at, Job.id)).all()
    for job in waiting:
        statuses = {}
        for dependency in dependencies(job.spec):
            found = crud.get_job(session, job_id=dependency, project_id=job.project_id)
            statuses[dependency] = found.status if found is not None else "deleted"
        ended = [(dependency, status) for dependency, status in statuses.items()
                 if status != "succeeded" and status not in LIVE_STATUSES]  # fmt: skip
        if ended:
            dependency, status = ended[0]
            message = f"job {dependency}, which this job starts from or is rewarded by, ended {status}"
            failed = crud.transition(session, job_id=job.id, from_statuses=("waiting",), to="failed",
                                     finished_at=utcnow(), error_code="dependency_failed",
                                     error_message=message)  # fmt: skip
            if failed:
                crud.add_event(session, job_id=job.id, kind="error", message=message,
                               data={"code": "dependency_failed", "job": dependency})  # fmt: skip
        elif all(status == "succeeded" for status in statuses.values()) and crud.transition(
            session, job_id=job.id, from_statuses=("waiting",), to="queued"
        ):
            queued.append((job.id, crud.job_queue(job)))
    return queued
