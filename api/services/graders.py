"""OpenAI's grader endpoints (``/v1/fine_tuning/alpha/graders/run`` and ``/validate``): a grader checked as a job's
reward is, and run on one sample in the API process, with the answer OpenAI gives (``reward``, ``sub_rewards`` and
``metadata`` with its error flags). Every kind runs here but ``model`` (a reward model: the workers load models)."""

import time
from typing import Any

from pydantic import ValidationError

from api.errors import ApiError, dotted
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
)
from engine.rewards.judge import Endpoint
from engine.spec.rows import Text
from jobs.store.settings import Settings

ERROR_FLAGS = (
    "formula_parse_error", "invalid_variable_error", "model_grader_parse_error", "model_grader_refusal_error",
    "model_grader_server_error", "other_error", "python_grader_runtime_error", "python_grader_server_error",
    "sample_parse_error", "truncated_observation_error", "unresponsive_reward_error",
)  # fmt: skip
"""The error flags of OpenAI's grader run metadata (all false when the grader ran cleanly)."""


def checked_grader(settings: Settings, data: Any) -> Grader:
    """The grader of a request's ``grader`` field, as a job's reward would be accepted; 400 naming the field."""
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_request", "grader must be a JSON object", param="grader")
    try:
        grader = graders.parse_grader(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        raise ApiError(400, "invalid_request", f"{dotted(tuple(first['loc'])) or 'grader'}: {first['msg']}",
                       param=dotted(("grader", *first["loc"]))) from None  # fmt: skip
    problems = graders.check_allowed(grader, settings.reward_urls, settings.reward_functions,
                                     settings.judges.keys(), settings.source_graders, settings.own_urls)  # fmt: skip
    if problems:
        raise ApiError(400, "reward_not_allowed", "; ".join(problems), param="grader")
    return grader


def run(settings: Settings, grader: Grader, model_sample: str, item: Any) -> dict[str, Any]:
    """``grader``'s reward of ``model_sample`` for dataset ``item``, in OpenAI's ``GraderRunResponse`` shape."""
    if any(isinstance(sub, ModelGrader) for _, sub in graders.iter_graders(grader)):
        raise ApiError(400, "invalid_request", "model graders (reward models) run on the workers: graders/run "
                       "loads no model; try the grader in a job", param="grader")  # fmt: skip
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
        scored = graders.score(grader, samples, judges=lambda name: judge_of(settings, name))
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
