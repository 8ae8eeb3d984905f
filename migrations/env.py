"""Alembic environment: the URL comes from the service settings (or the caller's config), the target
metadata from the models."""

from alembic import context

from jobs.store.db import make_engine
from jobs.store.models import Base
from jobs.store.settings import get_settings

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().resolved_database_url


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()  # a one-off run leaves no pooled connections behind


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
