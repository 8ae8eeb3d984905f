"""The Alembic migrations build exactly the schema the models declare, on SQLite and on PostgreSQL."""

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from jobs.store import db
from jobs.store.models import Base
from jobs.store.settings import Settings


def test_migrations_match_the_models(settings: Settings) -> None:
    # The `settings` fixture's database was built by `rlhf db upgrade`'s function (jobs.store.migrate.upgrade).
    with db.engine_for(settings.resolved_database_url).connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        diff = compare_metadata(context, Base.metadata)
    assert diff == []
