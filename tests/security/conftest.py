"""Fixtures of the security tests: those of the API tests (the app on SQLite and PostgreSQL, a project and a
client authorised for it, rows written through ``jobs.store.crud``), re-exported here."""

from tests.api.conftest import (  # noqa: F401  (pytest finds fixtures by name in this module)
    app,
    calls,
    client,
    database_url,
    db,
    hf_cache,
    postgresql_url,
    project,
    settings,
)
