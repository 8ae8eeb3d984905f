"""Training sessions of the Tinker-compatible API: training_sessions, session_models, sampling_sessions,
session_requests (the operations and their results), session_checkpoints (weights saved by name)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 23:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.String(length=40)
_TARGET = sa.String(length=120)
_WHEN = sa.DateTime(timezone=True)


def _owned(*columns: sa.Column[object]) -> list[sa.schema.SchemaItem]:
    """A session's row: its session (a job) and project, both deleted with their owner."""
    return [
        *columns,
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.Column("created_at", _WHEN, nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        "training_sessions",
        *_owned(
            sa.Column("id", _ID, nullable=False),
            sa.Column("project_id", _ID, nullable=False),
            sa.Column("sdk_version", sa.String(length=40), nullable=False),
            sa.Column("heartbeat_at", _WHEN, nullable=False),
            sa.Column("finish_reason", sa.String(length=16), nullable=True),
            sa.Column("user_metadata", sa.JSON(), nullable=False),
        ),
        sa.ForeignKeyConstraint(["id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_training_sessions_project_id", "training_sessions", ["project_id"])
    op.create_table(
        "session_models",
        *_owned(
            sa.Column("id", _TARGET, nullable=False),
            sa.Column("session_id", _ID, nullable=False),
            sa.Column("project_id", _ID, nullable=False),
            sa.Column("base_model", sa.String(length=500), nullable=False),
            sa.Column("lora_rank", sa.Integer(), nullable=True),
            sa.Column("info", sa.JSON(), nullable=False),
            sa.Column("user_metadata", sa.JSON(), nullable=False),
            sa.Column("last_request_at", _WHEN, nullable=False),
        ),
        sa.ForeignKeyConstraint(["session_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_session_models_session", "session_models", ["session_id"])
    op.create_index("ix_session_models_project_id", "session_models", ["project_id"])
    op.create_table(
        "sampling_sessions",
        *_owned(
            sa.Column("id", _TARGET, nullable=False),
            sa.Column("session_id", _ID, nullable=False),
            sa.Column("project_id", _ID, nullable=False),
            sa.Column("base_model", sa.String(length=500), nullable=False),
            sa.Column("model_path", sa.Text(), nullable=True),
            sa.Column("folder", sa.Text(), nullable=True),
        ),
        sa.ForeignKeyConstraint(["session_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sampling_sessions_session", "sampling_sessions", ["session_id"])
    op.create_index("ix_sampling_sessions_project_id", "sampling_sessions", ["project_id"])
    op.create_table(
        "session_requests",
        *_owned(
            sa.Column("id", _ID, nullable=False),
            sa.Column("session_id", _ID, nullable=False),
            sa.Column("project_id", _ID, nullable=False),
            sa.Column("target", _TARGET, nullable=False),
            sa.Column("seq_id", sa.BigInteger(), nullable=False),
            sa.Column("kind", sa.String(length=32), nullable=False),
            sa.Column("payload", sa.LargeBinary(), nullable=False),
            sa.Column("status", sa.String(length=16), nullable=False),
            sa.Column("result", sa.LargeBinary(), nullable=True),
            sa.Column("result_format", sa.String(length=8), nullable=True),
            sa.Column("error", sa.Text(), nullable=True),
            sa.Column("category", sa.String(length=16), nullable=True),
            sa.Column("finished_at", _WHEN, nullable=True),
        ),
        sa.ForeignKeyConstraint(["session_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("target", "seq_id", name="uq_session_requests_target_seq"),
    )
    op.create_index("ix_session_requests_session_status", "session_requests", ["session_id", "status"])
    op.create_table(
        "session_checkpoints",
        *_owned(
            sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
            sa.Column("session_id", _ID, nullable=False),
            sa.Column("project_id", _ID, nullable=False),
            sa.Column("model_id", _TARGET, nullable=False),
            sa.Column("kind", sa.String(length=16), nullable=False),
            sa.Column("name", sa.String(length=200), nullable=False),
            sa.Column("path", sa.Text(), nullable=False),
            sa.Column("step", sa.Integer(), nullable=True),
            sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        ),
        sa.ForeignKeyConstraint(["session_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("model_id", "kind", "name", name="uq_session_checkpoints_name"),
    )
    op.create_index("ix_session_checkpoints_project_id", "session_checkpoints", ["project_id"])


def downgrade() -> None:
    # 0006's code knows no session jobs: they go, with their metrics, events and checkpoint rows
    op.execute("DELETE FROM jobs WHERE type = 'session'")
    for table in ("session_checkpoints", "session_requests", "sampling_sessions", "session_models"):
        op.drop_table(table)
    op.drop_table("training_sessions")
