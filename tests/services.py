"""The real services the tests use: PostgreSQL and Redis on 127.0.0.1.

A test that needs one skips when it is unreachable, except under ``CI=true``, where every service must be
there and the test fails instead.
"""

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import psycopg
import pytest

from jobs.store import db, migrate

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


def unavailable(what: str, error: Exception) -> NoReturn:
    """Skip outside CI (a developer without the service); fail under CI=true."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is required under CI=true: {error}")
    pytest.skip(f"{what} unreachable: {error}")


@contextmanager
def postgres_database(prefix: str, migrated: bool = True) -> Iterator[str]:
    """A fresh PostgreSQL database (migrated to the newest schema unless told not to); dropped after."""
    try:
        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as e:
        unavailable("PostgreSQL at 127.0.0.1:5432", e)
    name = f"{prefix}_{secrets.token_hex(4)}"
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        url = PG_URL.format(name=name)
        try:
            if migrated:
                migrate.upgrade(url)
            yield url
        finally:
            db.engine_for(url).dispose()
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
