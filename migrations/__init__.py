"""Alembic migrations of the service database (``rlhf db upgrade``)."""
