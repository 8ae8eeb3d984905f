"""Fixtures of the security tests: those of the API tests (the app on SQLite and PostgreSQL, a project and a
client authorised for it, rows written through ``jobs.store.crud``), from ``tests.api.fixtures``."""

from tests.api.fixtures import *  # noqa: F403  (pytest finds fixtures by name in this module)
