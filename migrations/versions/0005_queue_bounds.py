"""jobs.sent_at (lost messages are sent again), jobs.pipeline_key and jobs.stage (a pipeline's Idempotency-Key, apart
from those of /v1/jobs), job_dependencies (the jobs a waiting job waits for), and an index to count a project's
queued and waiting jobs

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 22:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("pipeline_key", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("stage", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_unique_constraint("uq_jobs_project_pipeline_stage", ["project_id", "pipeline_key", "stage"])
        batch.create_index("ix_jobs_project_status", ["project_id", "status"], unique=False)
    op.create_table(
        "job_dependencies",
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("dependency_id", sa.String(length=40), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "dependency_id"),
    )
    with op.batch_alter_table("job_dependencies") as batch:
        batch.create_index("ix_job_dependencies_dependency", ["dependency_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("job_dependencies") as batch:
        batch.drop_index("ix_job_dependencies_dependency")
    op.drop_table("job_dependencies")
    # A pipeline's stages keep their key the way 0004's code stored it: "<key>/<stage>" as the idempotency key.
    op.execute(
        "UPDATE jobs SET idempotency_key = pipeline_key || '/' || stage "
        "WHERE pipeline_key IS NOT NULL AND idempotency_key IS NULL"
    )
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_project_status")
        batch.drop_constraint("uq_jobs_project_pipeline_stage", type_="unique")
        batch.drop_column("sent_at")
        batch.drop_column("stage")
        batch.drop_column("pipeline_key")
