"""API keys for the command line: the first key of ``rlhf serve`` and ``rlhf keys create``."""

from jobs.store import crud
from jobs.store.db import session_scope
from jobs.store.settings import Settings

DEFAULT_PROJECT = "default"


def ensure_default_key(settings: Settings) -> str | None:
    """On a database without any project: create project ``default`` and a key for it, and return the key
    (shown once: ``rlhf serve`` writes it to ``data_dir/api-key``). None when a project exists already.

    The database must be migrated first.
    """
    with session_scope(settings.resolved_database_url) as session:
        if crud.any_project(session):
            return None
        project = crud.create_project(session, name=DEFAULT_PROJECT)
        _, key = crud.create_api_key(session, project_id=project.id, name="default")
    return key


def create_key(settings: Settings, project_name: str) -> str:
    """A new key for the project named ``project_name`` (created if there is none); returns the key."""
    with session_scope(settings.resolved_database_url) as session:
        project = crud.project_by_name(session, name=project_name) or crud.create_project(session, name=project_name)
        _, key = crud.create_api_key(session, project_id=project.id, name=project_name)
    return key
