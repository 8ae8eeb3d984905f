"""OpenAI's grader endpoints (``/v1/fine_tuning/alpha/graders/run`` and ``/validate``): a grader checked as a job's
reward is, and run on one sample in the API process, with the answer OpenAI gives (``reward``, ``sub_rewards`` and
``metadata`` with its error flags). Every kind runs here but ``model`` (a reward model: the workers load models).

A run grades in a thread of its own, holding no database connection, within the request's wall-clock budget
(``RLHF_GRADER_RUN_SECONDS``), a bounded number at once per project (``RLHF_GRADER_RUNS_PER_PROJECT``); past the
budget, or once its client has left, its grading is told to stop (``should_stop``: a source grader's sandbox is
killed, a judge or a reward service no longer waited for) and the thread is left to end."""

import json
import logging
import threading
import time
from typing import Any

import anyio
from fastapi import Request
from pydantic import ValidationError

from api.errors import ApiError, dotted
from engine.callbacks import StopRequest
from engine.rewards import graders
from engine.rewards.graders import (
    Grader,
    ModelGrader,
    MultiGrader,
    PythonGrader,
    RewardError,
    RewardFormulaError,
    RewardFunctionError,
    RewardServiceError,
    RewardVariableError,
    Samples,
    StopCheck,
)
from engine.rewards.judge import Endpoint
from engine.spec.rows import Text
from jobs.store.settings import Settings

logger = logging.getLogger(__name__)

ERROR_FLAGS = (
    "formula_parse_error", "invalid_variable_error", "model_grader_parse_error", "model_grader_refusal_error",
    "model_grader_server_error", "other_error", "python_grader_runtime_error", "python_grader_server_error",
    "sample_parse_error", "truncated_observation_error", "unresponsive_reward_error",
)  # fmt: skip
"""The error flags of OpenAI's grader run metadata (all false when the grader ran cleanly)."""


def checked_grader(settings: Settings, data: Any) -> Grader:
    """The grader of a request's ``grader`` field, as a job's reward would be accepted, its source graders
    importing only what the sandbox here offers; 400 naming the field."""
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_request", "grader must be a JSON object", param="grader")
    try:
        grader = graders.parse_grader(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        raise ApiError(400, "invalid_request", f"{dotted(tuple(first['loc'])) or 'grader'}: {first['msg']}",
                       param=dotted(("grader", *first["loc"]))) from None  # fmt: skip
    problems = graders.check_allowed(
        grader,
        settings.reward_urls,
        settings.reward_functions,
        settings.judges.keys(),
        settings.source_graders,
        settings.own_urls,
    )
    if problems:
        raise ApiError(400, "reward_not_allowed", "; ".join(problems), param="grader")
    imports = graders.import_problems(grader)  # what this process's sandbox offers (the workers offer their own)
    if imports:
        raise ApiError(400, "invalid_request", "; ".join(imports), param="grader")
    return grader


POLL_S = (0.005, 0.1)
"""The first and the longest pause between two looks at a run's grading (done? budget spent? client gone?)."""


class RunningGraders:
    """The ``graders/run`` requests grading now, per project: each counts from its start until its grading thread
    has ended, which may come after its answer (its budget spent, its client gone). One per app
    (``app.state.grader_runs``), shared by the request handlers and their threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}

    def start(self, project_id: str, most: int) -> bool:
        """Count one more run of the project, unless it has ``most`` already (False then)."""
        with self._lock:
            if self._running.get(project_id, 0) >= most:
                return False
            self._running[project_id] = self._running.get(project_id, 0) + 1
            return True

    def end(self, project_id: str) -> None:
        with self._lock:
            self._running[project_id] -= 1
            if not self._running[project_id]:
                del self._running[project_id]

    def count(self, project_id: str) -> int:
        with self._lock:
            return self._running.get(project_id, 0)


async def run_within_budget(
    request: Request, settings: Settings, project_id: str, grader: Grader, *, model_sample: str, item: Any
) -> dict[str, Any]:
    """:func:`run`, in a thread of its own, counted in the app's :class:`RunningGraders` (429 past
    ``settings.grader_runs_per_project``), waited for until ``settings.grader_run_seconds`` have passed (400
    ``grader_run_timeout``) or the client has left; the grading is then told to stop, and its thread left to end."""
    running: RunningGraders = request.app.state.grader_runs
    most = settings.grader_runs_per_project
    if not running.start(project_id, most):
        message = (
            f"the project has {most} graders/run requests grading already, the most RLHF_GRADER_RUNS_PER_PROJECT "
            "allows; retry once one has answered"
        )
        raise ApiError(429, "too_many_grader_runs", message)
    stop, done = threading.Event(), threading.Event()
    outcome: list[dict[str, Any] | BaseException] = []

    def stopped() -> StopRequest | None:
        return "cancel" if stop.is_set() else None

    def grade() -> None:
        try:
            outcome.append(run(settings, grader, model_sample, item, should_stop=stopped))
        except BaseException as e:  # raised again in the request, if it still waits
            outcome.append(e)
        finally:
            running.end(project_id)
            done.set()

    deadline = time.monotonic() + settings.grader_run_seconds
    threading.Thread(target=grade, name=f"graders-run-{project_id}", daemon=True).start()
    pause = POLL_S[0]
    try:
        while not done.is_set():
            if time.monotonic() > deadline:
                budget = f"{settings.grader_run_seconds:g} s (RLHF_GRADER_RUN_SECONDS)"
                message = f"the grader did not finish within graders/run's budget of {budget}; its grading was stopped"
                raise ApiError(400, "grader_run_timeout", message, param="grader")
            if await request.is_disconnected():
                logger.info("graders/run of project %s: the client left; its grading was stopped", project_id)
                raise ApiError(499, "client_closed_request", "the client closed the request before its answer")
            await anyio.sleep(pause)
            pause = min(2 * pause, POLL_S[1])
    finally:
        stop.set()  # nothing to stop once done
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


def run(
    settings: Settings, grader: Grader, model_sample: str, item: Any, should_stop: StopCheck | None = None
) -> dict[str, Any]:
    """``grader``'s reward of ``model_sample`` for dataset ``item``, in OpenAI's ``GraderRunResponse`` shape; its
    judges, reward services and sandboxes stop when ``should_stop`` asks (RewardStopped)."""
    if any(isinstance(sub, ModelGrader) for _, sub in graders.iter_graders(grader)):
        raise ApiError(400, "invalid_request", "model graders (reward models) run on the workers: graders/run "
                       "loads no model; try the grader in a job", param="grader")  # fmt: skip
    try:
        json.loads(model_sample)  # sample.output_json of the python graders: JSON it can read, or none
    except RecursionError:
        message = "model_sample nests arrays or objects too deeply to be read as JSON"
        raise ApiError(400, "invalid_request", message, param="model_sample") from None
    except ValueError:
        pass
    row = item if isinstance(item, dict) else {}
    given = row.get("prompt")
    prompt: Text = given if isinstance(given, str | list) else ""
    samples = Samples(prompts=[prompt], prompt_texts=[prompt if isinstance(prompt, str) else ""],
                      completions=[model_sample], rows=[row])  # fmt: skip
    errors = dict.fromkeys(ERROR_FLAGS, False)
    details: dict[str, str | None] = {}
    started = time.perf_counter()
    scored = None
    try:
        scored = graders.score(grader, samples, judges=lambda name: judge_of(settings, name), should_stop=should_stop)
    except RewardVariableError as e:
        errors["invalid_variable_error"] = True
        details["other"] = str(e)
    except RewardFormulaError:
        errors["formula_parse_error"] = True
    except RewardServiceError as e:
        judged = any(sub.type in ("score_model", "label_model") for _, sub in graders.iter_graders(grader))
        errors["model_grader_server_error" if judged else "unresponsive_reward_error"] = True
        details["model_grader_server_error_details"] = str(e)
    except RewardFunctionError as e:
        server = "cannot run here" in str(e)
        errors["python_grader_server_error" if server else "python_grader_runtime_error"] = True
        details["python_grader_server_error_type" if server else "python_grader_runtime_error_details"] = str(e)
    except RewardError as e:
        errors["other_error"] = True
        details["other"] = str(e)
    scores: dict[str, object] = {}
    reward = 0.0
    if scored is not None:
        reward = scored.total[0]
        scores = {name: values[0] for name, values in scored.components.items()}
        for name, values in scored.components.items():
            if name.endswith("/invalid") and values[0]:
                errors["model_grader_parse_error"] = True
            if name.endswith("/errors") and values[0]:
                errors["python_grader_runtime_error"] = True
        for name, message in scored.errors.items():
            if errors["python_grader_runtime_error"] and isinstance(_named(grader, name), PythonGrader):
                details.setdefault("python_grader_runtime_error_details", message)
            if "refused" in message:
                errors["model_grader_refusal_error"] = True
    sub_rewards = {}
    if isinstance(grader, MultiGrader) and scored is not None:
        sub_rewards = {key: scored.components[key][0] for key in grader.graders}
    tokens = scored.judge_tokens if scored is not None else {}
    metadata = {
        "name": grader.name or grader.type,
        "type": grader.type,
        "errors": {**errors, **{key: value for key, value in details.items() if key != "other"}},
        "execution_time": time.perf_counter() - started,
        "scores": scores,
        "token_usage": sum(tokens.values()) if tokens else None,
        "sampled_model_name": None,
    }
    usage = {model: {"total_tokens": count} for model, count in tokens.items()}
    return {"reward": reward, "sub_rewards": sub_rewards, "metadata": metadata,
            "model_grader_token_usage_per_model": usage}  # fmt: skip


def judge_of(settings: Settings, name: str) -> Endpoint | None:
    setting = settings.judges.get(name)
    return setting.endpoint(name) if setting is not None else None


def _named(grader: Grader, name: str) -> Grader | None:
    return next((sub for sub_name, sub in graders.iter_graders(grader) if sub_name == name), None)
