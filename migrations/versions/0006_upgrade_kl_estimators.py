"""Stored specs in this version's terms: a GRPO job whose KL is in the reward, or a PPO job, with ``kl_estimator``
k2 or k3 (k3 was GRPO's default, so every ``reinforce_pp`` job stored it) now has k1 there, the one estimator this
version accepts in the reward (engine.spec.config.upgraded_kl_estimator says why). Without this such a queued or
paused job would fail when it resumes; each unfinished job it changes gets a ``warning`` event saying what changed.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 17:00:00.000000
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

from engine.spec.config import kl_in_the_reward, upgraded_kl_estimator

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FINAL_STATUSES = ("succeeded", "failed", "cancelled")

jobs = sa.table(
    "jobs",
    sa.column("id", sa.String),
    sa.column("type", sa.String),
    sa.column("status", sa.String),
    sa.column("spec", sa.JSON),
)
events = sa.table(
    "events",
    sa.column("job_id", sa.String),
    sa.column("kind", sa.String),
    sa.column("message", sa.Text),
    sa.column("data", sa.JSON),
    sa.column("created_at", sa.DateTime(timezone=True)),
)


def upgrade() -> None:
    connection = op.get_bind()
    candidates = sa.select(jobs.c.id, jobs.c.status, jobs.c.spec).where(jobs.c.type.in_(("grpo", "ppo")))
    for job_id, status, spec in connection.execute(candidates).all():
        upgraded, changes = upgraded_kl_estimator(spec)
        if not changes:
            continue
        connection.execute(jobs.update().where(jobs.c.id == job_id).values(spec=upgraded))
        if status not in FINAL_STATUSES:
            message = "this version trains the job's spec as upgraded: " + "; ".join(changes)
            data = {"reason": "spec_upgraded", "changes": changes}
            connection.execute(
                events.insert().values(
                    job_id=job_id, kind="warning", message=message, data=data, created_at=datetime.now(UTC)
                )
            )


def downgrade() -> None:
    """The earlier version reads no ``kl_estimator`` null (this version's default, a GRPO spec's): it becomes the
    estimator null means, k1 where the KL is in the reward, k3 where it is a loss term."""
    connection = op.get_bind()
    for job_id, spec in connection.execute(sa.select(jobs.c.id, jobs.c.spec).where(jobs.c.type == "grpo")).all():
        hyperparameters = spec.get("hyperparameters", {})
        if "kl_estimator" in hyperparameters and hyperparameters["kl_estimator"] is None:
            in_reward = kl_in_the_reward(
                hyperparameters.get("advantage_estimator", "grpo"), hyperparameters.get("kl_in_reward")
            )
            spec = {**spec, "hyperparameters": {**hyperparameters, "kl_estimator": "k1" if in_reward else "k3"}}
            connection.execute(jobs.update().where(jobs.c.id == job_id).values(spec=spec))
