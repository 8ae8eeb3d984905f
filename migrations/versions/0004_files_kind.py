"""files.kind: what a file's rows are, apart from the purpose it was uploaded with (``fine-tune`` files)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 07:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.alter_column("purpose", existing_type=sa.String(length=8), type_=sa.String(length=16))
        batch.add_column(sa.Column("kind", sa.String(length=16), nullable=True))
    op.execute(
        "UPDATE files SET kind = CASE purpose WHEN 'rm' THEN 'preference' WHEN 'ppo' THEN 'prompts' ELSE purpose END"
    )
    with op.batch_alter_table("files") as batch:
        batch.alter_column("kind", existing_type=sa.String(length=16), nullable=False)


def downgrade() -> None:
    op.execute("DELETE FROM files WHERE purpose = 'fine-tune'")
    with op.batch_alter_table("files") as batch:
        batch.drop_column("kind")
        batch.alter_column("purpose", existing_type=sa.String(length=16), type_=sa.String(length=8))
