"""OpenAI's fine-tuning API (``/v1/fine_tuning/jobs``, ``purpose: "fine-tune"`` files) driven by the official
``openai`` client over the app (workers faked): the specs the requests become, the objects as the SDK types them,
"auto" values, errors in OpenAI's envelope naming the request's field, paging, and the control actions."""

import io
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from api.fine_tuning import request_param
from api.openai_schemas import FineTuningJobCreate
from tests.api.helpers import PPO_SPEC, SFT_SPEC, Calls, Db
from tests.factories import Project
from tests.models import openai_rows

STRING_CHECK = {
    "type": "string_check",
    "name": "mood",
    "input": "{{sample.output_text}}",
    "reference": "{{item.mood}}",
    "operation": "ilike",
}


@pytest.fixture
def oa(client: TestClient, project: Project) -> Iterator[openai.OpenAI]:
    """The official client, talking to the app through the test client (an ``httpx.Client``)."""
    yield openai.OpenAI(api_key=project.key, base_url="http://testserver/v1", http_client=client, max_retries=0)


@pytest.fixture
def model(project: Project, db: Db) -> str:
    """A succeeded sft job to fine-tune further (its tokenizer is not at hand here, so chat rows are accepted)."""
    job_id = db.job(project.id, spec=SFT_SPEC, status="succeeded")
    db.checkpoint(job_id, 4)
    db.status(job_id, "succeeded", output_step=4)
    return f"job:{job_id}"


def upload(oa: openai.OpenAI, rows: list[dict[str, Any]], name: str = "train.jsonl") -> Any:
    content = "".join(json.dumps(row) + "\n" for row in rows).encode()
    return oa.files.create(file=(name, io.BytesIO(content)), purpose="fine-tune")


def test_fine_tune_files_are_openai_file_objects_of_one_method(oa: openai.OpenAI, client: TestClient) -> None:
    for method, kind in (("supervised", "sft"), ("dpo", "preference"), ("reinforcement", "prompts")):
        file = upload(oa, openai_rows(method, 12))
        assert (file.object, file.purpose, file.status, file.bytes > 0) == ("file", "fine-tune", "processed", True)
        assert isinstance(file.created_at, int) and file.expires_at is None
        native = client.get(f"/v1/files/{file.id}").json()
        assert (native["kind"], native["rows"], native["chat"]) == (kind, 12, True)
        assert oa.files.retrieve(file.id).created_at == file.created_at
    assert [f.purpose for f in oa.files.list()] == ["fine-tune"] * 3

    mixed = openai_rows("supervised", 3) + openai_rows("dpo", 1)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        upload(oa, mixed)
    assert refused.value.code == "invalid_file"
    assert "line 4: a dpo row in a file of supervised rows" in refused.value.message
    bad = openai_rows("dpo", 2)
    bad[1]["preferred_output"] = [{"role": "user", "content": "not an answer"}]
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        upload(oa, bad)
    assert "line 2: field 'preferred_output' must end with an assistant message" in refused.value.message
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        upload(oa, [{"prompt": "plain", "completion": "rows"}])
    assert "not a row of OpenAI's fine-tuning formats" in refused.value.message


def test_supervised_job_becomes_an_sft_spec_with_auto_values(
    oa: openai.OpenAI, client: TestClient, calls: Calls, model: str, project: Project
) -> None:
    file = upload(oa, openai_rows("supervised", 40))
    valid = upload(oa, openai_rows("supervised", 8), "valid.jsonl")
    job = oa.fine_tuning.jobs.create(
        model=model, training_file=file.id, validation_file=valid.id, suffix="reviews", seed=7,
        metadata={"team": "rl"},
    )  # fmt: skip
    assert job.object == "fine_tuning.job" and calls.enqueued == [job.id]
    assert (job.status, job.model, job.training_file, job.validation_file) == ("queued", model, file.id, valid.id)
    assert (job.seed, job.metadata, job.organization_id, job.fine_tuned_model) == (7, {"team": "rl"}, project.id, None)
    assert job.method is not None and job.method.type == "supervised" and job.method.supervised is not None
    # 40 rows: 3 epochs would see 120 >= 100 examples; a batch is 0.2% of 40, at least 1
    chosen = job.method.supervised.hyperparameters
    assert chosen is not None
    # the learning rate by the model's width, as POST /v1/jobs chooses it (builtin:tiny, 128 wide: 6.4e-4), read
    # as a multiplier of sft's default (1e-3)
    assert (chosen.n_epochs, chosen.batch_size, chosen.learning_rate_multiplier) == (3, 1, 0.64)
    assert (job.hyperparameters.n_epochs, job.hyperparameters.batch_size) == (3, 1)

    native = client.get(f"/v1/jobs/{job.id}").json()  # the same job, in the native API
    spec = native["spec"]
    assert (spec["type"], spec["name"], spec["dataset"], spec["eval_dataset"]) == ("sft", "reviews", file.id, valid.id)
    assert (spec["checkpoint_every"], spec["keep_checkpoints"], spec["seed"]) == (40, 3, 7)  # one an epoch, last 3
    hp = spec["hyperparameters"]
    assert (hp["epochs"], hp["batch_size"], hp["learning_rate"], hp["eval_every"]) == (3, 1, 6.4e-4, 40)

    given = oa.fine_tuning.jobs.create(
        model=model, training_file=file.id,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 8,
                                                                         "learning_rate_multiplier": 3}}},
    )  # fmt: skip
    hp = client.get(f"/v1/jobs/{given.id}").json()["spec"]["hyperparameters"]
    assert (hp["epochs"], hp["batch_size"], hp["learning_rate"]) == (2, 8, pytest.approx(3e-3))
    assert given.seed != 7 and 0 <= given.seed < 2**31  # drawn at random when not given
    legacy = oa.fine_tuning.jobs.create(model=model, training_file=file.id, hyperparameters={"n_epochs": 1})
    assert client.get(f"/v1/jobs/{legacy.id}").json()["spec"]["hyperparameters"]["epochs"] == 1


def test_dpo_and_reinforcement_jobs_become_dpo_and_grpo_specs(
    oa: openai.OpenAI, client: TestClient, model: str
) -> None:
    pairs = upload(oa, openai_rows("dpo", 64))
    dpo = oa.fine_tuning.jobs.create(
        model=model, training_file=pairs.id,
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.25, "batch_size": 16}}},
    )  # fmt: skip
    spec = client.get(f"/v1/jobs/{dpo.id}").json()["spec"]
    assert (spec["type"], spec["hyperparameters"]["beta"], spec["hyperparameters"]["batch_size"]) == ("dpo", 0.25, 16)
    assert spec["hyperparameters"]["epochs"] == 3 and spec["checkpoint_every"] == 4
    assert dpo.method is not None and dpo.method.dpo is not None and dpo.method.dpo.hyperparameters is not None
    assert (dpo.method.dpo.hyperparameters.beta, dpo.method.dpo.hyperparameters.n_epochs) == (0.25, 3)

    prompts = upload(oa, openai_rows("reinforcement", 30))
    rft = oa.fine_tuning.jobs.create(
        model=model, training_file=prompts.id, validation_file=prompts.id,
        method={"type": "reinforcement", "reinforcement": {
            "grader": STRING_CHECK,
            "hyperparameters": {"n_epochs": 2, "batch_size": 4, "compute_multiplier": 0.5, "eval_samples": 10}}},
    )  # fmt: skip
    spec = client.get(f"/v1/jobs/{rft.id}").json()["spec"]
    assert (spec["type"], spec["reward"]) == ("grpo", STRING_CHECK)
    hp = spec["hyperparameters"]
    # 30 prompts in batches of 4: 7 steps an epoch; 0.5 × 8 responses a prompt; minibatches dividing 16 samples
    assert (hp["total_steps"], hp["group_size"], hp["mini_batch_size"], hp["eval_max_prompts"]) == (14, 4, 16, 10)
    assert (hp["eval_every"], spec["checkpoint_every"], spec["eval_dataset"]) == (7, 7, prompts.id)
    assert rft.method is not None and rft.method.reinforcement is not None
    chosen = rft.method.reinforcement.hyperparameters
    assert chosen is not None and (chosen.n_epochs, chosen.compute_multiplier, chosen.batch_size) == (2, 0.5, 4)
    assert rft.method.reinforcement.grader.type == "string_check"


@pytest.mark.parametrize(
    ("create", "code", "param"),
    [
        ({"method": {"type": "dpo"}}, "wrong_file_purpose", "training_file"),
        ({"validation_file": "file-nothere00000"}, "file_not_found", "validation_file"),
        ({"hyperparameters": {"batch_size": 41}}, "invalid_request", "hyperparameters.batch_size"),
        ({"hyperparameters": {"n_epochs": True}}, "invalid_request", "hyperparameters.n_epochs"),
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": True}}}},
         "invalid_request", "method.supervised.hyperparameters.batch_size"),
        ({"hyperparameters": {"batch_size": 8192}}, "invalid_request", "hyperparameters.batch_size"),
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 0}}}}, "invalid_request",
         "method.supervised.hyperparameters.n_epochs"),
        ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"learning_rate_multiplier": 5000}}}},
         "invalid_request", "method.supervised.hyperparameters.learning_rate_multiplier"),
        ({"method": {"type": "reinforcement"}}, "invalid_request", "method"),
        ({"method": {"type": "supervised"}, "hyperparameters": {"n_epochs": 2}}, "invalid_request", None),
        ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}, "invalid_request", None),
        ({"model": "job:job_000000000000"}, "job_not_found", "model"),
        ({"metadata": {"k" * 65: "v"}}, "invalid_request", "metadata"),
        ({"suffix": "s" * 65}, "invalid_request", "suffix"),
    ],
)  # fmt: skip
def test_a_refused_request_names_its_field(
    oa: openai.OpenAI, model: str, create: dict[str, Any], code: str, param: str | None
) -> None:
    file = upload(oa, openai_rows("supervised", 40))
    with pytest.raises(openai.APIStatusError) as refused:
        oa.fine_tuning.jobs.create(**{"model": model, "training_file": file.id, **create})
    assert refused.value.status_code == 422
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error", body  # OpenAI's envelope
    assert (refused.value.code, refused.value.param) == (code, param), refused.value.message


def test_a_python_source_grader_that_does_not_compile_is_refused_naming_source(oa: openai.OpenAI, model: str) -> None:
    file = upload(oa, openai_rows("reinforcement", 40))
    grader = {"type": "python", "name": "g", "source": "def grade(sample, item):\n    return 1.0 +\n"}
    with pytest.raises(openai.APIStatusError) as refused:
        oa.fine_tuning.jobs.create(
            model=model, training_file=file.id, method={"type": "reinforcement", "reinforcement": {"grader": grader}}
        )
    assert refused.value.status_code == 422
    assert refused.value.param == "method.reinforcement.grader.python.source", refused.value.message
    assert "source does not compile" in refused.value.message and "line 2" in refused.value.message


def test_checkpoint_permissions_are_refused_naming_them(oa: openai.OpenAI) -> None:
    calls = [
        lambda: oa.fine_tuning.checkpoints.permissions.create("ftckpt-1", project_ids=["proj_x"]),
        lambda: oa.fine_tuning.checkpoints.permissions.list("ftckpt-1"),
        lambda: oa.fine_tuning.checkpoints.permissions.delete("perm-1", fine_tuned_model_checkpoint="ftckpt-1"),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert (refused.value.code, refused.value.param) == ("unsupported", "checkpoints.permissions")
        assert "checkpoint permissions are not supported" in refused.value.message


def test_a_bad_grader_is_named_under_the_method() -> None:
    body = FineTuningJobCreate.model_validate(
        {"model": "m", "training_file": "file-x", "method": {"type": "reinforcement", "reinforcement": {"grader": {}}}}
    )
    assert request_param("reward.type", body) == "method.reinforcement.grader.type"
    assert request_param("hyperparameters.total_steps", body) == "method.reinforcement.hyperparameters.n_epochs"
    assert request_param("dataset", body) == "training_file"


def test_jobs_list_retrieve_control_events_and_checkpoints(
    oa: openai.OpenAI, client: TestClient, calls: Calls, model: str, project: Project, db: Db
) -> None:
    file = upload(oa, openai_rows("supervised", 20))
    first = oa.fine_tuning.jobs.create(model=model, training_file=file.id)
    second = oa.fine_tuning.jobs.create(model=model, training_file=file.id)
    db.job(project.id, spec=PPO_SPEC)  # not a fine-tuning method: not listed
    native = db.job(project.id, spec=SFT_SPEC)  # an sft job from /v1/jobs is one

    listed = [job.id for job in oa.fine_tuning.jobs.list()]
    assert listed == [native, second.id, first.id, model.removeprefix("job:")]
    page = oa.fine_tuning.jobs.list(limit=2)
    assert [job.id for job in page.data] == listed[:2] and page.has_more
    assert [job.id for job in oa.fine_tuning.jobs.list(after=listed[1], limit=10).data] == listed[2:]
    assert [job.id for job in oa.fine_tuning.jobs.list(limit=1)] == listed  # iterating follows `after`
    builtin = oa.fine_tuning.jobs.retrieve(native)
    assert (builtin.training_file, builtin.hyperparameters.n_epochs, builtin.hyperparameters.batch_size) == (
        "builtin:reviews-sft", 3, 32)  # fmt: skip

    # Control: the native transitions, answered as fine-tuning jobs.
    assert oa.fine_tuning.jobs.pause(first.id).status == "paused"
    assert oa.fine_tuning.jobs.resume(first.id).status == "queued"
    assert calls.enqueued.count(first.id) == 2
    cancelled = oa.fine_tuning.jobs.cancel(first.id)
    assert (cancelled.status, cancelled.finished_at is not None) == ("cancelled", True)
    with pytest.raises(openai.ConflictError):
        oa.fine_tuning.jobs.cancel(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        oa.fine_tuning.jobs.retrieve("job_000000000000")
    assert missing.value.param == "fine_tuning_job_id"
    ppo = db.job(project.id, spec=PPO_SPEC)
    with pytest.raises(openai.NotFoundError) as not_fine_tuning:
        oa.fine_tuning.jobs.retrieve(ppo)
    assert f"GET /v1/jobs/{ppo}" in not_fine_tuning.value.message

    # A run, as a worker records it: events newest first, checkpoints with their models, the final model.
    db.status(second.id, "running", started_at=db.get(second.id).created_at)
    for step in (20, 40, 60):
        db.checkpoint(second.id, step, kept=(20, 40, 60))
    db.event(second.id, "slow step", kind="warning", data={"step": 1})
    db.event(second.id, "boom", kind="error")
    db.status(second.id, "failed", error_code="out_of_memory", error_message="CUDA out of memory")
    events = oa.fine_tuning.jobs.list_events(second.id)
    levels = [(e.level, e.message) for e in events.data]
    assert levels[:3] == [("error", "failed"), ("error", "boom"), ("warn", "slow step")]
    assert all(e.object == "fine_tuning.job.event" and e.id.startswith("ftevent-") for e in events.data)
    older = oa.fine_tuning.jobs.list_events(second.id, after=events.data[1].id, limit=1)
    assert [e.message for e in older.data] == ["slow step"] and older.has_more
    with pytest.raises(openai.UnprocessableEntityError):
        oa.fine_tuning.jobs.list_events(second.id, after="42")
    failed = oa.fine_tuning.jobs.retrieve(second.id)
    assert failed.status == "failed" and failed.error is not None
    assert (failed.error.code, failed.error.message) == ("out_of_memory", "CUDA out of memory")
    checkpoints = oa.fine_tuning.jobs.checkpoints.list(second.id)
    assert [c.step_number for c in checkpoints.data] == [60, 40, 20]
    newest = checkpoints.data[0]
    assert (newest.fine_tuned_model_checkpoint, newest.fine_tuning_job_id) == (f"job:{second.id}@60", second.id)
    assert (newest.metrics.step, newest.metrics.train_loss) == (60, pytest.approx(1 / 60))
    rest = oa.fine_tuning.jobs.checkpoints.list(second.id, after=newest.id, limit=1)
    assert [c.step_number for c in rest.data] == [40] and rest.has_more

    done = oa.fine_tuning.jobs.retrieve(model.removeprefix("job:"))
    assert (done.status, done.fine_tuned_model) == ("succeeded", model)
    assert oa.models.retrieve(model).id == model  # a model of /v1/models and the chat route


def test_event_and_checkpoint_ids_count_within_their_job(
    oa: openai.OpenAI, project: Project, db: Db, model: str
) -> None:
    """Ids say nothing of other jobs' activity: a job's first event is ftevent-1 however busy the server is, and a
    checkpoint is named by its step."""
    busy = db.job(project.id, spec=SFT_SPEC)
    for n in range(5):
        db.event(busy, f"other job's event {n}")
    job_id = db.job(project.id, spec=SFT_SPEC)
    db.event(job_id, "one")
    db.event(busy, "interleaved")
    db.event(job_id, "two")
    db.checkpoint(job_id, 20, kept=(20,))
    events = oa.fine_tuning.jobs.list_events(job_id, limit=100).data
    count = len(events)
    assert [e.id for e in events] == [f"ftevent-{n}" for n in range(count, 0, -1)]
    assert [e.message for e in events[:2]] == ["checkpoint at step 20", "two"]
    older = oa.fine_tuning.jobs.list_events(job_id, after=events[1].id, limit=1)
    assert [e.message for e in older.data] == ["one"] and not older.has_more
    assert [c.id for c in oa.fine_tuning.jobs.checkpoints.list(job_id).data] == ["ftckpt-20"]
