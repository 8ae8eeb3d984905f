"""The database side of the command line: the migration of ``rlhf serve`` and ``rlhf db upgrade``, API keys
(the first key of ``rlhf serve``, ``rlhf keys create``), and the jobs a previous ``rlhf serve`` left running."""

import logging
import os
from pathlib import Path

from jobs.store import crud
from jobs.store.db import session_scope
from jobs.store.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_PROJECT = "default"


def upgrade_database(settings: Settings) -> None:
    """Create ``data_dir`` (and its SQLite stores) and bring the database to the newest schema."""
    from jobs.store.migrate import upgrade

    settings.prepare_data_dir()
    upgrade(settings.resolved_database_url)


def create_key(settings: Settings, project_name: str) -> str:
    """A new key for the project named ``project_name`` (created if there is none); returns the key."""
    with session_scope(settings.resolved_database_url) as session:
        project = crud.project_by_name(session, name=project_name) or crud.create_project(session, name=project_name)
        _, key = crud.create_api_key(session, project_id=project.id, name=project_name)
    return key


def ensure_key_file(settings: Settings, key_file: Path) -> None:
    """Unless ``key_file`` holds a valid key: a new key for the ``default`` project (created on first start),
    written to ``key_file`` (mode 0600)."""
    if key_file.exists():
        with session_scope(settings.resolved_database_url) as session:
            if crud.project_for_key(session, key=key_file.read_text().strip()):
                return
    key = create_key(settings, DEFAULT_PROJECT)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    log.info("a new API key for project %r is in %s", DEFAULT_PROJECT, key_file)


def orphaned_jobs_to_queue(settings: Settings) -> None:
    """Embedded mode owns every worker: jobs left running by a previous run expire now and get requeued."""
    with session_scope(settings.resolved_database_url) as session:
        crud.expire_active_leases(session)
