"""One error envelope for every failure: ``{"error": {"code", "message", "param", "type"}}``, as OpenAI's API
answers.

Routes raise :class:`ApiError`; the handlers installed by :func:`install_error_handlers` also turn
request validation errors, Starlette's HTTP errors and unexpected exceptions into the envelope.
"""

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.spec.config import HYPERPARAMETERS, JobSpec, format_errors
from jobs.store.storage import MESSAGES, storage_error

logger = logging.getLogger(__name__)

# Locations FastAPI puts first in a validation error's ``loc``; the param names the field without them.
_LOCATIONS = ("body", "query", "path", "header", "cookie")
_CODES = {
    400: "bad_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    500: "internal_error",
    503: "unavailable",
    507: "disk_full",
}
MAX_LISTED_ERRORS = 10
"""A validation error's message lists this many problems at most."""


class ErrorDetail(BaseModel):
    code: str
    """Machine-readable reason, e.g. ``not_found``, ``invalid_request``, ``job_not_succeeded``."""
    message: str
    """What went wrong, for people."""
    param: str | None = None
    """The request field at fault, as a dotted path (e.g. ``hyperparameters.learning_rate``), if any."""
    type: str = "invalid_request_error"
    """OpenAI's error class: ``invalid_request_error``, ``authentication_error`` (401) or ``server_error`` (5xx)."""


class ErrorResponse(BaseModel):
    error: ErrorDetail


_DESCRIPTIONS = {
    400: "The request could not be parsed (e.g. a malformed multipart body), or asks for what this server does not "
    "do (`unsupported`; `param` names it).",
    401: "Missing, unknown or revoked API key.",
    404: "No such object in the caller's project.",
    409: "The request conflicts with the object's state.",
    413: "The request body (or the uploaded file) is larger than the limit.",
    422: "The request is invalid; `param` names the field at fault.",
    500: "An unexpected error.",
    503: "A service the request needs is unavailable.",
    507: "The server cannot store what the request needs: its disk is full (`disk_full`) or its storage is not "
    "writable (`storage_not_writable`).",
}


def error_responses(*status_codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` declaring these statuses as answered with the error envelope."""
    return {code: {"model": ErrorResponse, "description": _DESCRIPTIONS[code]} for code in status_codes}


class ApiError(Exception):
    """An error answered with the envelope: ``raise ApiError(404, "not_found", "no job 'job_x'")``."""

    def __init__(
        self, status_code: int, code: str, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers


class BodyTooLarge(StarletteHTTPException):
    """Raised while a request body is read, once it passes its size limit (see ``api.uploads``).

    An HTTPException, because FastAPI passes those through from body parsing (any other error there
    becomes a 400); it is answered 413 with its own ``code`` and ``param``.
    """

    def __init__(self, code: str, message: str, param: str | None) -> None:
        super().__init__(413, message)
        self.code = code
        self.param = param


def not_found(kind: str, object_id: str) -> ApiError:
    return ApiError(404, "not_found", f"no {kind} {object_id!r} in this project", param=None)


def error_response(
    status_code: int, code: str, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    kind = "authentication_error" if status_code == 401 else "server_error" if status_code >= 500 else None
    detail = ErrorDetail(code=code, message=message, param=param, **({"type": kind} if kind else {}))
    body = ErrorResponse(error=detail)
    return JSONResponse(body.model_dump(), status_code=status_code, headers=headers)


def dotted(loc: Sequence[int | str]) -> str | None:
    """``("body", "hyperparameters", "lr")`` → ``"hyperparameters.lr"``; None for an empty location."""
    parts = list(loc)
    if parts and parts[0] in _LOCATIONS:
        parts = parts[1:]
    return ".".join(map(str, parts)) or None


def _message(errors: Sequence[Any]) -> str:
    parts = []
    for e in errors[:MAX_LISTED_ERRORS]:
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        where = dotted(e.get("loc", ()))
        parts.append(f"{where}: {msg}" if where else msg)
    if len(errors) > MAX_LISTED_ERRORS:
        parts.append(f"and {len(errors) - MAX_LISTED_ERRORS} more")
    return "; ".join(parts) or "invalid request"


def _leading_field(message: str, fields: Sequence[str]) -> str | None:
    """The field a model-level validator's message starts with ("batch_size (6) must be …" → batch_size), dotted
    when it names a nested one ("hyperparameters.batch_size (6) …")."""
    match = re.match(r"[A-Za-z_][A-Za-z_.]*", message.removeprefix("Value error, "))
    name = match.group(0).rstrip(".") if match else ""
    return name if name.split(".")[0] in fields else None


def spec_error(error: ValidationError, body: dict[str, Any]) -> ApiError:
    """A 422 for a job spec that failed ``JobSpec.model_validate``, whose ``param`` names the field.

    JobSpec validates ``hyperparameters`` as one field and flattens the nested errors into one message,
    so the nested config is validated again here to name the exact hyperparameter.
    """
    first = error.errors(include_url=False)[0]
    loc: tuple[int | str, ...] = tuple(first["loc"])
    if not loc:  # a model-level check, e.g. "reward_model is required for ppo jobs"
        field = _leading_field(first["msg"], list(JobSpec.model_fields))
        loc = tuple(field.split(".")) if field else ()
    elif loc == ("hyperparameters",) and body.get("type") in HYPERPARAMETERS:
        config = HYPERPARAMETERS[body["type"]]
        try:
            config.model_validate(body.get("hyperparameters"))
        except ValidationError as nested:
            inner = nested.errors(include_url=False)[0]
            inner_loc = tuple(inner["loc"])
            if not inner_loc:
                field = _leading_field(inner["msg"], list(config.model_fields))
                inner_loc = (field,) if field else ()
            loc = ("hyperparameters", *inner_loc)
    message = format_errors(error).replace("\n", "; ")
    return ApiError(422, "invalid_request", message, param=dotted(loc))


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status_code, exc.code, exc.message, exc.param, exc.headers)


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    param = dotted(errors[0].get("loc", ())) if errors else None
    return error_response(422, "invalid_request", _message(errors), param)


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc, BodyTooLarge):
        return error_response(413, exc.code, str(exc.detail), exc.param)
    code = _CODES.get(exc.status_code, "error")
    return error_response(exc.status_code, code, str(exc.detail), None, dict(exc.headers or {}))


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    # The server closes the connection after an unhandled error: say so, or a client reusing it meets a reset.
    close = {"Connection": "close"}
    problem = storage_error(exc)
    if problem is not None:  # a full disk or a read-only folder: the user's request was fine
        logger.error("storage refused a write (%s): %s", problem, exc)
        return error_response(507, problem, MESSAGES[problem], headers=close)
    logger.exception("unhandled error", exc_info=exc)
    return error_response(500, "internal_error", "internal server error", headers=close)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
