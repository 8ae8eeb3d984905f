"""Jobs that wait for other jobs: a spec naming an unfinished job (``job:<id>`` as ``model``, ``reward_model`` or a
reward grader's model) is stored ``waiting``, with a ``job_dependencies`` row per such job (how a job that ends finds
those waiting for it); once every job it names has succeeded it is queued, and when one of them fails or is cancelled
it fails with ``dependency_failed``, naming that job."""

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs.store import crud
from jobs.store.models import LIVE_STATUSES, SESSION_TYPE, Job, JobDependency, utcnow
from jobs.store.refs import dependencies


def release_waiting(session: Session, *, dependency_ids: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """Queue the waiting jobs whose dependencies all succeeded, and fail those with one that cannot succeed any
    more: the jobs waiting for ``dependency_ids`` (jobs that just ended, or were just created), then those waiting
    for the jobs this failed, and so on; or, with None, every waiting job in one pass, oldest first (so a
    pipeline's failure reaches its last stage; and the jobs stored before ``job_dependencies`` existed). A few
    queries, whatever the number of waiting jobs. Returns (job id, train queue) of each job queued, for the caller
    to send after the commit."""
    queued: list[tuple[str, str]] = []
    ended = list(dependency_ids) if dependency_ids is not None else None
    while ended is None or ended:
        stmt = select(Job).where(Job.status == "waiting", Job.type != SESSION_TYPE)  # a session waits for a model
        if ended is not None:
            waiting_for = select(JobDependency.job_id).where(JobDependency.dependency_id.in_(ended))
            stmt = stmt.where(Job.id.in_(waiting_for))
        waiting = session.scalars(stmt.order_by(Job.created_at, Job.id)).all()
        failed = _release(session, waiting, queued)
        if ended is None:
            break
        ended = failed
    return queued


def _release(session: Session, waiting: Sequence[Job], queued: list[tuple[str, str]]) -> list[str]:
    """Queue or fail each of ``waiting`` (appending the queued ones to ``queued``); returns the ids it failed."""
    named = {job.id: dependencies(job.spec) for job in waiting}
    wanted = {dependency for ids in named.values() for dependency in ids}
    found: dict[str, tuple[str, str]] = {}
    if wanted:
        for job_id, project_id, status in session.execute(
            select(Job.id, Job.project_id, Job.status).where(Job.id.in_(wanted))
        ):
            found[job_id] = (project_id, status)
    failed = []
    for job in waiting:
        statuses = {}
        for dependency in named[job.id]:
            project_id, status = found.get(dependency, (job.project_id, "deleted"))
            statuses[dependency] = status if project_id == job.project_id else "deleted"
        ended = [(dependency, status) for dependency, status in statuses.items()
                 if status != "succeeded" and status not in LIVE_STATUSES]  # fmt: skip
        if ended:
            dependency, status = ended[0]
            message = f"job {dependency}, which this job starts from or is rewarded by, ended {status}"
            if crud.transition(
                session,
                job_id=job.id,
                from_statuses=("waiting",),
                to="failed",
                finished_at=utcnow(),
                error_code="dependency_failed",
                error_message=message,
            ):
                crud.add_event(session, job_id=job.id, kind="error", message=message,
                               data={"code": "dependency_failed", "job": dependency})  # fmt: skip
                failed.append(job.id)
                found[job.id] = (job.project_id, "failed")  # for a later stage in this pass
        elif all(status == "succeeded" for status in statuses.values()) and crud.transition(
            session, job_id=job.id, from_statuses=("waiting",), to="queued"
        ):
            queued.append((job.id, crud.job_queue(job)))
            found[job.id] = (job.project_id, "queued")
    return failed
