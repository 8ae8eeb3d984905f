"""Dependency-injection aliases for the routes: settings, a database session, the caller's project,
and the two ways work leaves the API (enqueue a job, wait for a generation), both replaceable in tests."""

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Annotated, Any

import anyio
from anyio.lowlevel import RunVar
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.errors import ApiError
from jobs.store import crud
from jobs.store.db import session_scope
from jobs.store.models import Project
from jobs.store.settings import Settings

Enqueue = Callable[[str, str], None]
"""Send a job (id, train queue) to the workers; called only after the job's row is committed."""
Generate = Callable[[dict[str, Any]], dict[str, Any]]
"""Run the generate task with these keyword arguments and wait for its result (blocking)."""


def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


DB_SLOTS = 20
"""Requests holding a database session at once: below the pool (30) minus the stream pollers (8)."""
_db_slots: RunVar[anyio.CapacityLimiter] = RunVar("db_slots")


class DbSlot:
    """A request's hold on one of the :data:`DB_SLOTS`: freed when its session ends, or before (:data:`ReleaseDb`)."""

    def __init__(self, limiter: anyio.CapacityLimiter) -> None:
        self.limiter = limiter
        self.held = False

    async def take(self) -> None:
        await self.limiter.acquire_on_behalf_of(self)
        self.held = True

    def free(self) -> None:
        if self.held:
            self.held = False
            self.limiter.release_on_behalf_of(self)


async def db_slot() -> AsyncIterator[DbSlot]:
    """Wait for a database slot *before* taking a connection. Without it, a burst of requests can hold
    every pooled connection while waiting for a request thread, and stall until the pool times out."""
    try:
        limiter = _db_slots.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(DB_SLOTS)
        _db_slots.set(limiter)
    slot = DbSlot(limiter)
    await slot.take()
    try:
        yield slot
    finally:
        slot.free()


DbSlotDep = Annotated[DbSlot, Depends(db_slot, scope="function")]


def get_session(settings: SettingsDep, _slot: DbSlotDep) -> Iterator[Session]:
    """A session per request: committed when the route returns, rolled back when it raises."""
    with session_scope(settings.resolved_database_url) as session:
        yield session


# scope="function": the session ends when the route returns, before the response is sent (a stream
# does not hold a connection, and a failed commit is still answered with an error).
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def get_release_db(session: SessionDep, slot: DbSlotDep) -> Callable[[], Awaitable[None]]:
    """For a route that works on after its last query (grading, waiting): ends the request's session now (committed,
    its connection back in the pool; the objects read stay readable) and frees its database slot."""

    async def release() -> None:
        await anyio.to_thread.run_sync(_end, session)
        slot.free()

    return release


def _end(session: Session) -> None:
    session.commit()
    session.close()


ReleaseDb = Annotated[Callable[[], Awaitable[None]], Depends(get_release_db)]
"""Call (and await) to end the request's database session and free its slot before long work."""

_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer <key>`.")


MAX_KEY_CHARS = 256
"""Longer bearer tokens are refused unhashed (keys the service issues have 49 characters)."""


def get_current_project(
    session: SessionDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Project:
    """The caller's project. The key is never logged nor repeated in an error."""
    challenge = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise ApiError(401, "invalid_api_key", "missing API key: send 'Authorization: Bearer <key>'", headers=challenge)
    key = credentials.credentials
    project = crud.project_for_key(session, key=key) if len(key) <= MAX_KEY_CHARS else None
    if project is None:
        raise ApiError(401, "invalid_api_key", "the API key is not valid", headers=challenge)
    return project


CurrentProject = Annotated[Project, Depends(get_current_project)]


def _declared_query(dependant: Any) -> set[str]:
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _declared_query(sub)
    return names


def reject_unknown_query(request: Request, _project: CurrentProject) -> None:
    """422 for a query parameter the route does not declare (a typo like ``?limt=5`` is not silently ignored),
    as unknown fields of a body are. Runs after authentication, so a caller without a key learns nothing."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    unknown = sorted(set(request.query_params) - _declared_query(dependant))
    if unknown:
        name = unknown[0][:100]
        raise ApiError(422, "invalid_request", f"unknown query parameter {name!r}", param=name)


def get_enqueue(request: Request) -> Enqueue:
    enqueue: Enqueue = request.app.state.enqueue
    return enqueue


EnqueueDep = Annotated[Enqueue, Depends(get_enqueue)]


def get_generate(request: Request) -> Generate:
    generate: Generate = request.app.state.generate
    return generate


GenerateDep = Annotated[Generate, Depends(get_generate)]
