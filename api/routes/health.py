"""``/healthz`` (the process answers) and ``/readyz`` (the database and the broker answer, and the storage takes
files: the artifacts folder, and the data folder of an embedded SQLite database)."""

import logging

from fastapi import APIRouter, Request
from sqlalchemy import text

from api.deps import SettingsDep
from api.errors import ApiError, ErrorResponse
from api.queue import check_broker
from api.schemas import Health, Readiness
from jobs.store.db import engine_for
from jobs.store.storage import DISK_FULL, check_writable

logger = logging.getLogger(__name__)
router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> Health:
    return Health()


@router.get(
    "/readyz",
    responses={503: {"model": ErrorResponse, "description": "`param` names what failed (the reasons are logged)."}},
)
def readyz(request: Request, settings: SettingsDep) -> Readiness:
    failures: dict[str, str] = {}
    try:
        with engine_for(settings.resolved_database_url).connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as e:
        failures["database"] = str(e).splitlines()[0] if str(e) else type(e).__name__
    try:
        check_broker(request.app.state.celery)
    except Exception as e:
        failures["broker"] = str(e).splitlines()[0] if str(e) else type(e).__name__
    reasons = {name: "unreachable" for name in failures}
    folders = {settings.resolved_artifacts_dir}
    if settings.resolved_database_url.startswith("sqlite"):
        folders.add(settings.data_dir.resolve())
    for folder in sorted(folders):
        problem = check_writable(folder, settings.min_free_bytes)
        if problem is not None:
            failures["storage"] = f"{folder}: {problem}"
            reasons["storage"] = "full" if problem == DISK_FULL else "not writable"
    if failures:
        # The reasons go to the log only: this route answers without a key, and they name internal hosts.
        logger.warning("not ready: %s", failures)
        message = "not ready: " + ", ".join(f"{name} {reason}" for name, reason in reasons.items())
        raise ApiError(503, "unavailable", message, param=",".join(failures))
    return Readiness(checks={"database": "ok", "broker": "ok", "storage": "ok"})
