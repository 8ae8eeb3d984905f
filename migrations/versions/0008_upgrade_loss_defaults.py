"""Stored specs keep what they trained with now that each policy loss has its own defaults (cispo: no lower bound,
capped at 4; gspo: the paper's 3e-4 / 4e-4 and the sequence mean): a ppo, grpo or distill job of policy_loss cispo
or gspo gets the values it left to the defaults written in, as the earlier version trained them
(engine.spec.config.upgraded_loss_defaults: clip ranges 0.2; gspo's loss_aggregation token_mean, constant for
dr_grpo). Each unfinished job it changes gets a ``warning`` event saying what was written.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-08 01:00:00.000000
"""

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

from engine.spec.config import upgraded_loss_defaults

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FINAL_STATUSES = ("succeeded", "failed", "cancelled")
TYPES = ("ppo", "grpo", "distill")
LOSS_RANGES = {"ppo_clip": (0.2, 0.2), "importance_sampling": (0.2, 0.2), "cispo": (1.0, 3.0), "gspo": (3e-4, 4e-4)}
"""Each policy loss's own clip range (below, above) in this revision, what a null range means
(engine.spec.policy_losses.LOSS_DEFAULTS)."""
BELOW_ONE = math.nextafter(1.0, 0.0)
"""The largest ``cliprange_low`` 0007's code takes (it refuses 1): a lower bound of the ratio at 1.1e-16."""

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
    candidates = sa.select(jobs.c.id, jobs.c.status, jobs.c.spec).where(jobs.c.type.in_(TYPES))
    for job_id, status, spec in connection.execute(candidates).all():
        upgraded, changes = upgraded_loss_defaults(spec)
        if not changes:
            continue
        connection.execute(jobs.update().where(jobs.c.id == job_id).values(spec=upgraded))
        if status not in FINAL_STATUSES:
            message = "this version trains the job's spec as it trained until now: " + "; ".join(changes)
            data = {"reason": "spec_upgraded", "changes": changes}
            connection.execute(
                events.insert().values(
                    job_id=job_id, kind="warning", message=message, data=data, created_at=datetime.now(UTC)
                )
            )


def _downgraded(job_type: str, hyperparameters: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameters as 0007's code reads them: no ``loss_aggregation`` in a ppo or distill spec (it trained them
    by the token mean); a null clip range the loss's own, as near as 0007 holds it (PPO's one ``cliprange`` the
    upper side: for cispo 3, whose lower bound 1 - 3 < 0 is none, exactly; for gspo 4e-4 both sides); a
    ``cliprange_low`` of 1 (no lower bound) just below 1."""
    low, high = LOSS_RANGES.get(hyperparameters.get("policy_loss", "ppo_clip"), (0.2, 0.2))
    out = dict(hyperparameters)
    if job_type in ("ppo", "distill"):
        out.pop("loss_aggregation", None)
    if job_type == "ppo":
        if out.get("cliprange", 0.2) is None:
            out["cliprange"] = high
        return out
    if out.get("cliprange_low", 0.2) is None:
        out["cliprange_low"] = low
    if out.get("cliprange_high", 0.2) is None:
        out["cliprange_high"] = high
    if out.get("cliprange_low", 0.2) >= 1.0:
        out["cliprange_low"] = BELOW_ONE
    return out


def downgrade() -> None:
    """Every ppo, grpo and distill spec as 0007's code reads it (:func:`_downgraded`)."""
    connection = op.get_bind()
    candidates = sa.select(jobs.c.id, jobs.c.type, jobs.c.spec).where(jobs.c.type.in_(TYPES))
    for job_id, job_type, spec in connection.execute(candidates).all():
        hyperparameters = spec.get("hyperparameters")
        if not isinstance(hyperparameters, dict):
            continue
        downgraded = _downgraded(job_type, hyperparameters)
        if downgraded != hyperparameters:
            spec = {**spec, "hyperparameters": downgraded}
            connection.execute(jobs.update().where(jobs.c.id == job_id).values(spec=spec))
