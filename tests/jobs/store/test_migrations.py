"""The Alembic migrations build exactly the schema the models declare, on SQLite and on PostgreSQL."""

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from engine.builtin import digits
from engine.spec.config import JobSpec
from jobs.store import db, migrate
from jobs.store.models import Base
from jobs.store.settings import Settings
from tests.services import postgres_database


def test_migrations_match_the_models(settings: Settings) -> None:
    # The `settings` fixture's database was built by `rlhf db upgrade`'s function (jobs.store.migrate.upgrade).
    with db.engine_for(settings.resolved_database_url).connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        diff = compare_metadata(context, Base.metadata)
    assert diff == []


@pytest.fixture(params=["sqlite", "postgresql"])
def bare_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database of each kind, for a test to migrate step by step."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'rlhf.db'}"
    else:
        with postgres_database("rlhf_migrate", migrated=False) as url:
            yield url


def files_columns(engine: sa.Engine) -> dict[str, sa.types.TypeEngine]:
    return {column["name"]: column["type"] for column in sa.inspect(engine).get_columns("files")}


def add_project(connection: sa.Connection, now: datetime) -> None:
    """Project ``p``, which the test's rows belong to."""
    connection.execute(sa.text("INSERT INTO projects (id, name, created_at) VALUES ('p', 'test', :now)"), {"now": now})


def query(engine: sa.Engine, sql: str) -> list[tuple[object, ...]]:
    with engine.connect() as connection:
        return [tuple(row) for row in connection.execute(sa.text(sql))]


def test_0004_fills_files_kind_from_purpose_and_downgrades(bare_url: str) -> None:
    migrate.upgrade(bare_url, "0003")
    engine = db.make_engine(bare_url)
    try:
        now = datetime.now(UTC)
        with engine.begin() as connection:
            add_project(connection, now)
            for purpose in ("sft", "rm", "ppo"):
                connection.execute(
                    sa.text(
                        "INSERT INTO files (id, project_id, filename, purpose, bytes, rows, path, created_at) "
                        "VALUES (:id, 'p', 'data.jsonl', :purpose, 10, 1, :path, :now)"
                    ),
                    {"id": f"file-{purpose}", "purpose": purpose, "path": f"files/{purpose}", "now": now},
                )
        engine.dispose()  # no pooled connection holds the table while Alembic rebuilds it

        migrate.upgrade(bare_url, "0004")
        assert query(engine, "SELECT version_num FROM alembic_version") == [("0004",)]
        assert dict(query(engine, "SELECT purpose, kind FROM files")) == {
            "sft": "sft",
            "rm": "preference",
            "ppo": "prompts",
        }
        columns = files_columns(engine)
        assert columns["purpose"].length == 16 and columns["kind"].length == 16  # type: ignore[attr-defined]
        with engine.begin() as connection:  # a fine-tune file: a purpose longer than the old 8 characters
            connection.execute(
                sa.text(
                    "INSERT INTO files (id, project_id, filename, purpose, kind, bytes, rows, path, created_at) "
                    "VALUES ('file-ft', 'p', 'ft.jsonl', 'fine-tune', 'sft', 10, 1, 'file-ft', :now)"
                ),
                {"now": now},
            )
        engine.dispose()

        command.downgrade(migrate.alembic_config(bare_url), "0003")
        assert query(engine, "SELECT version_num FROM alembic_version") == [("0003",)]
        assert query(engine, "SELECT id, purpose FROM files ORDER BY id") == [  # the fine-tune file goes
            ("file-ppo", "ppo"),
            ("file-rm", "rm"),
            ("file-sft", "sft"),
        ]
        columns = files_columns(engine)
        assert "kind" not in columns and columns["purpose"].length == 8  # type: ignore[attr-defined]
        engine.dispose()

        migrate.upgrade(bare_url)  # and up again
        assert dict(query(engine, "SELECT purpose, kind FROM files")) == {
            "sft": "sft",
            "rm": "preference",
            "ppo": "prompts",
        }
    finally:
        engine.dispose()


def jobs_columns(engine: sa.Engine) -> set[str]:
    return {column["name"] for column in sa.inspect(engine).get_columns("jobs")}


def test_0005_adds_sent_at_pipeline_keys_and_dependencies_and_downgrades(bare_url: str) -> None:
    migrate.upgrade(bare_url, "0004")
    engine = db.make_engine(bare_url)
    insert_job = sa.text(
        "INSERT INTO jobs (id, project_id, type, status, spec, idempotency_key, attempt, step, latest_metrics, "
        "created_at, updated_at) VALUES (:id, 'p', 'sft', 'queued', '{}', :key, 1, 0, '{}', :now, :now)"
    )
    try:
        now = datetime.now(UTC)
        with engine.begin() as connection:
            add_project(connection, now)
            connection.execute(insert_job, {"id": "job_old", "key": "k", "now": now})
        engine.dispose()

        migrate.upgrade(bare_url, "0005")
        assert query(engine, "SELECT version_num FROM alembic_version") == [("0005",)]
        assert {"sent_at", "pipeline_key", "stage"} <= jobs_columns(engine)
        assert query(engine, "SELECT id, sent_at, pipeline_key FROM jobs") == [("job_old", None, None)]  # sent again
        with engine.begin() as connection:  # a pipeline's stage, waiting for the old job
            connection.execute(insert_job, {"id": "job_stage", "key": None, "now": now})
            connection.execute(sa.text("UPDATE jobs SET pipeline_key = 'pipe', stage = 'rm' WHERE id = 'job_stage'"))
            connection.execute(sa.text("INSERT INTO job_dependencies VALUES ('job_stage', 'job_old')"))
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as connection:  # one job per stage of a key
            connection.execute(insert_job, {"id": "job_twin", "key": None, "now": now})
            connection.execute(sa.text("UPDATE jobs SET pipeline_key = 'pipe', stage = 'rm' WHERE id = 'job_twin'"))
        engine.dispose()

        command.downgrade(migrate.alembic_config(bare_url), "0004")
        assert query(engine, "SELECT version_num FROM alembic_version") == [("0004",)]
        assert "sent_at" not in jobs_columns(engine) and "job_dependencies" not in sa.inspect(engine).get_table_names()
        # the stage keeps its key the way 0004 stored it
        assert query(engine, "SELECT id, idempotency_key FROM jobs ORDER BY id") == [
            ("job_old", "k"),
            ("job_stage", "pipe/rm"),
        ]
        engine.dispose()

        migrate.upgrade(bare_url)  # and up again
        assert query(engine, "SELECT count(*) FROM job_dependencies") == [(0,)]
    finally:
        engine.dispose()


def test_0006_upgrades_stored_kl_estimators_with_a_warning_for_unfinished_jobs(bare_url: str) -> None:
    """A spec an earlier version stored with k3 in the reward (GRPO's default then) validates after 0006."""
    migrate.upgrade(bare_url, "0005")
    engine = db.make_engine(bare_url)
    grpo = {"type": "grpo", "model": "builtin:tiny", "dataset": "builtin:digits-prompts", "reward": digits.GRADER}
    specs = {
        "job_paused": {**grpo, "hyperparameters": {"advantage_estimator": "reinforce_pp", "kl_estimator": "k3"}},
        "job_done": {**grpo, "hyperparameters": {"kl_in_reward": True, "kl_estimator": "k2"}},
        "job_term": {**grpo, "hyperparameters": {"kl_estimator": "k3"}},  # k3 as a loss term: accepted
        "job_ppo": {
            "type": "ppo",
            "model": "builtin:tiny",
            "dataset": "builtin:reviews-prompts",
            "reward_model": "builtin:tiny",
            "hyperparameters": {"kl_estimator": "k3"},
        },
    }
    statuses = {"job_paused": "paused", "job_done": "succeeded", "job_term": "queued", "job_ppo": "running"}
    insert_job = sa.text(
        "INSERT INTO jobs (id, project_id, type, status, spec, attempt, step, latest_metrics, created_at, "
        "updated_at) VALUES (:id, 'p', :type, :status, :spec, 1, 0, '{}', :now, :now)"
    )
    try:
        now = datetime.now(UTC)
        with engine.begin() as connection:
            add_project(connection, now)
            for job_id, spec in specs.items():
                values = {"id": job_id, "type": spec["type"], "status": statuses[job_id], "now": now}
                connection.execute(insert_job, {**values, "spec": json.dumps(spec)})
        engine.dispose()

        migrate.upgrade(bare_url, "0006")
        assert query(engine, "SELECT version_num FROM alembic_version") == [("0006",)]
        stored = {job_id: json.loads(spec) for job_id, spec in query(engine, "SELECT id, CAST(spec AS TEXT) FROM jobs")}
        assert {job_id: spec["hyperparameters"]["kl_estimator"] for job_id, spec in stored.items()} == {
            "job_paused": None,
            "job_done": None,
            "job_term": "k3",
            "job_ppo": "k1",
        }
        for spec in stored.values():
            JobSpec.model_validate(spec)  # what failed when such a job resumed
        events = query(engine, "SELECT job_id, kind, CAST(data AS TEXT) FROM events ORDER BY job_id")
        assert [(job_id, kind) for job_id, kind, _ in events] == [("job_paused", "warning"), ("job_ppo", "warning")]
        assert all(json.loads(data)["reason"] == "spec_upgraded" for _, _, data in events)
        engine.dispose()

        command.downgrade(migrate.alembic_config(bare_url), "0005")  # null is read by 0005's code as what it meant
        stored = {job_id: json.loads(spec) for job_id, spec in query(engine, "SELECT id, CAST(spec AS TEXT) FROM jobs")}
        assert stored["job_paused"]["hyperparameters"]["kl_estimator"] == "k1"
        assert stored["job_term"]["hyperparameters"]["kl_estimator"] == "k3"
    finally:
        engine.dispose()


SESSION_TABLES = {"training_sessions", "session_models", "sampling_sessions", "session_requests", "session_checkpoints"}


def test_0007_adds_training_sessions_and_downgrades_without_them(bare_url: str) -> None:
    migrate.upgrade(bare_url, "0006")
    engine = db.make_engine(bare_url)
    insert_job = sa.text(
        "INSERT INTO jobs (id, project_id, type, status, spec, attempt, step, latest_metrics, created_at, updated_at) "
        "VALUES (:id, 'p', :type, 'running', '{}', 1, 0, '{}', :now, :now)"
    )
    try:
        now = datetime.now(UTC)
        with engine.begin() as connection:
            add_project(connection, now)
            connection.execute(insert_job, {"id": "job_sft", "type": "sft", "now": now})
        engine.dispose()

        migrate.upgrade(bare_url, "0007")
        assert query(engine, "SELECT version_num FROM alembic_version") == [("0007",)]
        assert set(sa.inspect(engine).get_table_names()) >= SESSION_TABLES
        with engine.begin() as connection:  # a live session with one operation in flight
            connection.execute(insert_job, {"id": "job_session", "type": "session", "now": now})
            connection.execute(
                sa.text(
                    "INSERT INTO training_sessions (id, project_id, sdk_version, heartbeat_at, user_metadata, "
                    "created_at) VALUES ('job_session', 'p', '0.38.0', :now, '{}', :now)"
                ),
                {"now": now},
            )
            connection.execute(
                sa.text(
                    "INSERT INTO session_requests (id, session_id, project_id, target, seq_id, kind, payload, status, "
                    "created_at) VALUES ('r1', 'job_session', 'p', 'model_1', 1, 'optim_step', :body, 'pending', :now)"
                ),
                {"body": b"{}", "now": now},
            )
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as connection:  # one operation per sequence number
            connection.execute(
                sa.text(
                    "INSERT INTO session_requests (id, session_id, project_id, target, seq_id, kind, payload, status, "
                    "created_at) VALUES ('r2', 'job_session', 'p', 'model_1', 1, 'optim_step', :body, 'pending', :now)"
                ),
                {"body": b"{}", "now": now},
            )
        engine.dispose()

        command.downgrade(migrate.alembic_config(bare_url), "0006")
        assert query(engine, "SELECT version_num FROM alembic_version") == [("0006",)]
        assert not SESSION_TABLES & set(sa.inspect(engine).get_table_names())
        assert query(engine, "SELECT id FROM jobs") == [("job_sft",)]  # 0006's code reads no session jobs
        engine.dispose()

        migrate.upgrade(bare_url)  # and up again
        assert query(engine, "SELECT count(*) FROM training_sessions") == [(0,)]
    finally:
        engine.dispose()


def test_0008_writes_in_what_cispo_and_gspo_jobs_trained_with_and_downgrades(bare_url: str) -> None:
    """Specs 0007's code stored keep training as they trained, now that cispo and gspo have defaults of their own;
    after a downgrade 0007's code reads every spec this version stores."""
    migrate.upgrade(bare_url, "0007")
    engine = db.make_engine(bare_url)
    grpo = {"type": "grpo", "model": "builtin:tiny", "dataset": "builtin:digits-prompts", "reward": digits.GRADER}
    ppo = {"type": "ppo", "model": "builtin:tiny", "dataset": "builtin:reviews-prompts", "reward_model": "builtin:tiny"}
    distill = {
        "type": "distill",
        "model": "builtin:tiny",
        "teacher": "builtin:tiny",
        "dataset": "builtin:digits-prompts",
    }
    earlier = {  # (spec as 0007 stored it, status)
        "job_cispo": ({**grpo, "hyperparameters": {"policy_loss": "cispo"}}, "queued"),  # a range left out
        "job_cispo_set": (
            {**grpo, "hyperparameters": {"policy_loss": "cispo", "cliprange_low": 0.2, "cliprange_high": 0.28}},
            "paused",
        ),
        "job_gspo": ({**grpo, "hyperparameters": {"policy_loss": "gspo", "loss_aggregation": None}}, "running"),
        "job_gspo_dr": (
            {**grpo, "hyperparameters": {"policy_loss": "gspo", "advantage_estimator": "dr_grpo"}},
            "succeeded",
        ),
        "job_ppo_gspo": ({**ppo, "hyperparameters": {"policy_loss": "gspo", "cliprange": 0.05}}, "paused"),
        "job_ppo": ({**ppo, "hyperparameters": {"cliprange": 0.2}}, "queued"),
        "job_distill_gspo": ({**distill, "hyperparameters": {"policy_loss": "gspo"}}, "failed"),
    }
    insert_job = sa.text(
        "INSERT INTO jobs (id, project_id, type, status, spec, attempt, step, latest_metrics, created_at, "
        "updated_at) VALUES (:id, 'p', :type, :status, :spec, 1, 0, '{}', :now, :now)"
    )

    def stored() -> dict[str, dict[str, Any]]:
        rows = query(engine, "SELECT id, CAST(spec AS TEXT) FROM jobs")
        return {job_id: json.loads(spec)["hyperparameters"] for job_id, spec in rows}

    try:
        now = datetime.now(UTC)
        with engine.begin() as connection:
            add_project(connection, now)
            for job_id, (spec, status) in earlier.items():
                values = {"id": job_id, "type": spec["type"], "status": status, "now": now}
                connection.execute(insert_job, {**values, "spec": json.dumps(spec)})
        engine.dispose()

        migrate.upgrade(bare_url, "0008")
        assert query(engine, "SELECT version_num FROM alembic_version") == [("0008",)]
        trained = {  # (clip below, clip above, aggregation): what 0007's code trained each with
            "job_cispo": (0.2, 0.2, "token_mean"),
            "job_cispo_set": (0.2, 0.28, "token_mean"),
            "job_gspo": (0.2, 0.2, "token_mean"),
            "job_gspo_dr": (0.2, 0.2, "constant"),
            "job_ppo_gspo": (0.05, 0.05, "token_mean"),
            "job_ppo": (0.2, 0.2, "token_mean"),
            "job_distill_gspo": (0.2, 0.2, "token_mean"),
        }
        rows = query(engine, "SELECT id, CAST(spec AS TEXT) FROM jobs")
        for job_id, spec in rows:
            config = JobSpec.model_validate(json.loads(spec)).config
            settings = config.loss_settings  # type: ignore[attr-defined]
            assert (settings.clip_low, settings.clip_high, config.aggregation) == trained[job_id], job_id  # type: ignore[attr-defined]
        assert stored()["job_cispo"]["cliprange_low"] == stored()["job_cispo"]["cliprange_high"] == 0.2
        assert stored()["job_ppo"] == {"cliprange": 0.2}  # nothing changed: no warning either
        events = query(engine, "SELECT job_id, kind, CAST(data AS TEXT) FROM events ORDER BY job_id")
        assert [(job_id, kind) for job_id, kind, _ in events] == [
            ("job_cispo", "warning"),
            ("job_gspo", "warning"),
            ("job_ppo_gspo", "warning"),
        ]  # the unfinished jobs changed; not the finished ones
        data = {job_id: json.loads(text) for job_id, _, text in events}
        assert all(d["reason"] == "spec_upgraded" for d in data.values())
        assert len(data["job_cispo"]["changes"]) == 2 and len(data["job_gspo"]["changes"]) == 3
        assert any("loss_aggregation token_mean" in change for change in data["job_gspo"]["changes"])

        new = {  # specs this version stores: null ranges (the loss's own), no lower bound, gspo's aggregation
            "job_new_cispo": JobSpec.model_validate({**grpo, "hyperparameters": {"policy_loss": "cispo"}}),
            "job_new_low": JobSpec.model_validate({**grpo, "hyperparameters": {"cliprange_low": 1}}),
            "job_new_ppo": JobSpec.model_validate({**ppo, "hyperparameters": {"policy_loss": "gspo"}}),
            "job_new_distill": JobSpec.model_validate({**distill, "hyperparameters": {"policy_loss": "cispo"}}),
        }
        with engine.begin() as connection:
            for job_id, spec in new.items():
                values = {"id": job_id, "type": spec.type, "status": "queued", "now": now}
                connection.execute(insert_job, {**values, "spec": json.dumps(spec.model_dump(mode="json"))})
        engine.dispose()

        command.downgrade(migrate.alembic_config(bare_url), "0007")
        assert query(engine, "SELECT version_num FROM alembic_version") == [("0007",)]
        hp = stored()
        assert "loss_aggregation" not in hp["job_ppo_gspo"] and "loss_aggregation" not in hp["job_distill_gspo"]
        assert hp["job_gspo"]["loss_aggregation"] == "token_mean"  # GRPO's: 0007 reads it
        assert hp["job_new_cispo"]["cliprange_low"] < 1 and 1 - hp["job_new_cispo"]["cliprange_low"] < 1e-15
        assert hp["job_new_cispo"]["cliprange_high"] == 3.0  # the weight capped at 4
        assert hp["job_new_low"]["cliprange_low"] < 1 and hp["job_new_low"]["cliprange_high"] == 0.2
        assert hp["job_new_ppo"]["cliprange"] == 4e-4 and "loss_aggregation" not in hp["job_new_ppo"]
        assert (hp["job_new_distill"]["cliprange_low"], hp["job_new_distill"]["cliprange_high"]) == (1 - 2**-53, 3.0)
        for job_id in (*earlier, *new):  # 0007's clip ranges: numbers, cliprange_low below 1
            values = [hp[job_id].get(name, 0.2) for name in ("cliprange", "cliprange_low", "cliprange_high")]
            assert all(isinstance(v, float) for v in values) and hp[job_id].get("cliprange_low", 0.2) < 1, job_id
        engine.dispose()

        migrate.upgrade(bare_url)  # and up again: the explicit values stay
        assert stored()["job_cispo"]["cliprange_low"] == 0.2
    finally:
        engine.dispose()
