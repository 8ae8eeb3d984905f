"""Fixtures of the API tests, defined in ``tests.api.fixtures`` (tests/security loads the same ones): the app
on real databases (a migrated SQLite file, and a fresh PostgreSQL database per test session), a client
authorised for a fresh project per test, and ``db`` to write rows through ``jobs.store.crud`` the way workers
do. Helpers are in ``tests.api.helpers`` and ``tests.factories``.

PostgreSQL and Redis tests skip when the server is unreachable, except under ``CI=true``, where they fail.
"""

from tests.api.fixtures import *  # noqa: F403  (pytest finds fixtures by name in this module)
