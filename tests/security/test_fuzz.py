"""Fuzzing of the whole OpenAPI surface with schemathesis, against the ASGI app in process.

The app runs on a migrated SQLite database in a temporary folder, with the Celery calls replaced by fakes (no
broker; the fake "worker" finishes a queued job at once), and requests carry a valid API key (but for the
negative cases that drop the header: those must be 401). The project holds a job of each kind with
checkpoints, metrics, events and samples, and a file; about half the generated requests for ``/v1/jobs/{job_id}/…`` and
``/v1/files/{file_id}`` have their id replaced by one of those, and half the valid uploads get valid JSONL, so
the fuzzer reaches the routes' success paths, not only their 404s and 422s. Each operation gets
``MAX_EXAMPLES`` generated requests, valid and invalid ones (schemathesis' positive and negative modes), then
``test_fuzz_stateful`` chains calls through the ids the responses carry. Every response must:

- not be a server error (5xx),
- have a status code, content type and headers the OpenAPI document declares for the operation,
- match the declared schema (errors: the error envelope),
- reject invalid data with a 4xx (negative data rejection).

The number of requests sent is checked at the end (``test_fuzz_ran_cases``) and printed.
"""

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import delete

from api.main import create_app
from jobs.store import crud
from jobs.store.db import engine_for, session_scope
from jobs.store.migrate import upgrade
from jobs.store.models import File, Job
from tests.api.helpers import PPO_SPEC, RM_SPEC, SFT_SPEC, Db
from tests.factories import make_settings, new_project

MAX_EXAMPLES = 60
"""Generated requests per operation (and per generation mode): 60 (was 100) keeps the run near a minute on 2 cores."""

STATEFUL_EXAMPLES = 50
"""Scenarios of the stateful test, up to 10 linked calls each."""

REQUEST_TIMEOUT = 5.0
"""Seconds a response may take (every job the fuzzer can stream is final, so streams end at once)."""


@schemathesis.check
def rejects_negative_data(ctx: Any, response: Any, case: Any) -> bool | None:
    """Schemathesis' negative data rejection, with 413 counted as a rejection: a body over the size limit (a
    string far past its ``maxLength``, say) is refused before it is parsed."""
    if response.status_code == 413:
        return True
    result: bool | None = negative_data_rejection(ctx, response, case)
    return result


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    rejects_negative_data,
]


@dataclass
class Target:
    app: Any
    headers: dict[str, str]
    ids: dict[str, list[str]]
    """Existing ids per path parameter name."""
    cases: Counter[str] = field(default_factory=Counter)
    """Requests sent, per operation."""
    statuses: Counter[int] = field(default_factory=Counter)
    stateful: int = 0
    """Requests sent by the stateful test."""
    turn: Iterator[int] = field(default_factory=itertools.count)
    database_url: str = ""

    def reset(self) -> None:
        """Delete what the fuzzer created: jobs and files other than the seeded ones."""
        with session_scope(self.database_url) as session:
            session.execute(delete(Job).where(Job.id.not_in(self.ids["job_id"])))
            session.execute(delete(File).where(File.id.not_in(self.ids["file_id"])))


ROWS = {  # text, as the schema's `format: binary` strings are generated (bytes would count as invalid)
    "sft": '{"prompt": "a", "completion": "b"}\n',
    "rm": '{"prompt": "a", "chosen": "b", "rejected": "c"}\n',
    "ppo": '{"prompt": "a"}\n',
}


def fake_generate(kwargs: dict[str, Any]) -> dict[str, Any]:
    completion = {"text": " fine", "finish_reason": "stop"}
    if kwargs["score"]:
        completion["score"] = 0.5  # type: ignore[assignment]
    return {"completions": [{"prompt": p, **completion} for p in kwargs["prompts"]]}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    folder: Path = tmp_path_factory.mktemp("fuzz")
    url = f"sqlite:///{folder / 'rlhf.db'}"
    upgrade(url)
    settings = make_settings(folder, url)
    project = new_project(settings, "fuzz")
    db = Db(settings)
    jobs = []
    for spec, status in ((SFT_SPEC, "succeeded"), (RM_SPEC, "failed"), (PPO_SPEC, "cancelled")):
        job_id = db.job(project.id, spec=spec, status=status)
        db.metrics(job_id, 1, {"loss/sft": 2.0, "lr": 0.001})
        db.metrics(job_id, 2, {"loss/sft": 1.5, "lr": 0.001})
        db.event(job_id, "hello", kind="info", data={"n": 1})
        db.checkpoint(job_id, 1)
        db.checkpoint(job_id, 2, kept=(1,))
        sample = {"prompt": "p", "response": "r", "rewards": {"score": 0.5}, "kl": 0.1, "length": 1}
        db.samples(job_id, 2, [sample, sample])
        jobs.append(job_id)
    with db.session() as session:
        row = crud.create_file(
            session, file_id="file-fuzz00000000", project_id=project.id, filename="a.jsonl", purpose="sft", kind="sft",
            size=10, rows=1, path="files/file-fuzz00000000.jsonl",
        )  # fmt: skip

    def enqueue(job_id: str, _queue: str) -> None:
        """A worker that finishes every job at once: streams of created jobs end, and they can generate."""
        db.status(job_id, "succeeded")
        db.checkpoint(job_id, 1)

    app = create_app(
        settings,
        enqueue=enqueue,
        generate_with=fake_generate,
        recovery_interval=None,
        poll_interval=0.01,
        heartbeat_interval=0.05,
    )
    yield Target(app=app, headers=project.headers, ids={"job_id": jobs, "file_id": [row.id]}, database_url=url)
    engine_for(url).dispose()


def authorize(case: Any, target: Target) -> None:
    """Send the valid key in place of the Authorization header schemathesis generates (a random bearer token).

    A negative case that drops the header is left without it (and must be answered 401). The key is set on
    the case itself, so the checks judge the request that was actually sent.
    """
    if case.headers is None:
        case.headers = {}
    header = case.meta.components.get(ParameterLocation.HEADER) if case.meta else None
    dropped = header is not None and header.mode.is_negative and "Authorization" not in case.headers
    if not dropped:
        case.headers.update(target.headers)


@pytest.fixture(scope="module")
def api_schema(target: Target) -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", target.app)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same requests on every run
    suppress_health_check=list(HealthCheck),
)
def test_fuzz(case: Any, target: Target) -> None:
    turn = next(target.turn)
    for name, known in target.ids.items():
        if name in (case.path_parameters or {}) and turn % 2 == 0:
            case.path_parameters[name] = known[(turn // 2) % len(known)]
    positive = case.meta is not None and not any(c.mode.is_negative for c in case.meta.components.values())
    if case.path == "/v1/files" and case.method == "POST" and positive and isinstance(case.body, dict) and turn % 2:
        purpose = case.body.get("purpose")
        if purpose in ROWS:  # a valid file for a valid purpose, to reach the success path too
            case.body["file"] = ROWS[purpose]
    authorize(case, target)
    response = case.call_and_validate(checks=CHECKS, timeout=REQUEST_TIMEOUT)
    target.cases[f"{case.method.upper()} {case.path}"] += 1
    target.statuses[response.status_code] += 1


def test_fuzz_stateful(target: Target, api_schema: Any) -> None:
    """Sequences of calls linked by the ids the responses carry (schemathesis infers the links: a job created
    by ``POST /v1/jobs`` is then read, cancelled, paused, resumed, streamed and generated from)."""

    class Machine(api_schema.as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            target.reset()  # each scenario starts from the seeded rows: replays see the same answers

        def before_call(self, case: Any) -> None:
            authorize(case, target)

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"timeout": REQUEST_TIMEOUT}

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            target.cases[f"{case.method.upper()} {case.path}"] += 1
            target.statuses[response.status_code] += 1
            target.stateful += 1
            case.validate_response(response, checks=CHECKS)

    Machine.run(
        settings=settings(
            max_examples=STATEFUL_EXAMPLES,
            stateful_step_count=10,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
    )
    assert target.stateful > 0


def test_fuzz_ran_cases(target: Target, api_schema: Any) -> None:
    """Runs after ``test_fuzz`` (file order): every operation was fuzzed, and nothing answered 5xx."""
    paths = api_schema.raw_schema["paths"]
    operations = {f"{method.upper()} {path}" for path, item in paths.items() for method in item}
    total = sum(target.cases.values())
    statuses = dict(sorted(target.statuses.items()))
    print(f"\nfuzz: {total} requests ({target.stateful} in stateful scenarios), statuses {statuses}")
    assert operations <= set(target.cases)
    assert all(status < 500 for status in target.statuses)
