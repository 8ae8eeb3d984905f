"""How the API talks to the workers: Celery tasks sent by name (never imported), after the commit."""

import logging
from typing import Any

import anyio
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeoutError
from fastapi import Request
from kombu.exceptions import OperationalError

from api.deps import Enqueue, Generate
from api.errors import ApiError
from jobs.celery_app import GENERATE_TASK, INFERENCE_QUEUE, send_job

logger = logging.getLogger(__name__)


def celery_enqueue(celery: Celery) -> Enqueue:
    def enqueue(job_id: str, queue: str) -> None:
        send_job(celery, job_id, queue)

    return enqueue


def celery_generate(celery: Celery, timeout: float) -> Generate:
    """Send the generate task to the inference queue and wait up to ``timeout`` seconds for its result."""

    def generate(kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            result = celery.send_task(GENERATE_TASK, kwargs=kwargs, queue=INFERENCE_QUEUE, expires=timeout)
        except OperationalError as e:
            logger.exception("the broker is unreachable")
            raise ApiError(503, "unavailable", "the broker is unreachable") from e
        try:
            answer: dict[str, Any] = result.get(timeout=timeout)
        except CeleryTimeoutError:
            # expires= makes a worker that picks the message up later drop it.
            raise ApiError(503, "unavailable", f"no inference worker answered within {timeout:g} s") from None
        finally:
            result.forget()
        return answer

    return generate


async def run_generation(request: Request, wait_for: Generate, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Wait for an inference worker (on the app's generate limiter, so slow generations cannot starve the other
    routes' threads). The one mapping of generation errors for every route: what the worker reports about the
    request (a model without a chat template, more tokens than the model's context, a checkpoint gone) is a
    400; anything else a 500."""
    try:
        result: dict[str, Any] = await anyio.to_thread.run_sync(
            wait_for, kwargs, limiter=request.app.state.generate_limiter
        )
    except ApiError:
        raise
    except Exception as e:
        # Celery re-creates the worker's exception under its class name (jobs.inference is not imported here).
        name = type(e).__name__
        if name == "ChatTemplateMissing":
            raise ApiError(400, "chat_template_missing", str(e), param="model") from e
        if name == "GenerateError":
            raise ApiError(400, "invalid_request", str(e)) from e
        logger.exception("generation failed for job %s step %s", kwargs["job_id"], kwargs["step"])
        raise ApiError(500, "generation_failed", "generation failed on the inference worker") from e
    return result


def check_broker(celery: Celery, timeout: float = 2.0) -> None:
    """Raise if the broker cannot be reached within about ``timeout`` seconds."""
    with celery.connection_for_write() as connection:
        connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0.2, timeout=timeout)
