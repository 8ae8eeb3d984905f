"""Dependency-injection aliases for the routes: settings, a database session, the caller's project,
and the two ways work leaves the API (enqueue a job, wait for a generation), both replaceable in tests."""

from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.errors import ApiError
from jobs.store import crud
from jobs.store.db import session_scope
from jobs.store.models import Project
from jobs.store.settings import Settings

Enqueue = Callable[[str], None]
"""Send a job to the train queue by id; called only after the job's row is committed."""
Generate = Callable[[dict[str, Any]], dict[str, Any]]
"""Run the generate task with these keyword arguments and wait for its result (blocking)."""


def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    """A session per request: committed when the route returns, rolled back when it raises."""
    with session_scope(settings.resolved_database_url) as session:
        yield session


# scope="function": the session ends when the route returns, before the response is sent (a stream
# does not hold a connection, and a failed commit is still answered with an error).
SessionDep = Annotated[Session, Depends(get_session, scope="function")]

_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer <key>`.")


def get_current_project(
    session: SessionDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Project:
    challenge = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise ApiError(401, "invalid_api_key", "missing API key: send 'Authorization: Bearer <key>'", headers=challenge)
    project = crud.project_for_key(session, key=credentials.credentials)
    if project is None:
        raise ApiError(401, "invalid_api_key", "the API key is not valid", headers=challenge)
    return project


CurrentProject = Annotated[Project, Depends(get_current_project)]


def get_enqueue(request: Request) -> Enqueue:
    enqueue: Enqueue = request.app.state.enqueue
    return enqueue


EnqueueDep = Annotated[Enqueue, Depends(get_enqueue)]


def get_generate(request: Request) -> Generate:
    generate: Generate = request.app.state.generate
    return generate


GenerateDep = Annotated[Generate, Depends(get_generate)]
