"""Model graders' judge: an OpenAI-compatible chat endpoint asked for a score or a label (OpenAI's ``score_model`` and
``label_model`` graders, https://platform.openai.com/docs/api-reference/graders).

The judge is any ``/chat/completions`` endpoint the operator offers (this server's own, serving a checkpoint, is
one). Each sample's conversation is one request; a batch is sent ``concurrency`` at a time, each request bounded by
``timeout_s`` and retried ``retries`` times (with doubling backoffs) on connection errors, timeouts, 429 and 5xx.
An answer is read leniently, as a model that knows no structured outputs writes it: a JSON object's ``result``
(the shape OpenAI's score model answers in), else the first number of the text; a label is the answer that is
exactly one of the labels (case and surrounding punctuation aside), else the one label the text names. An answer
that is neither is *invalid* (OpenAI's ``model_grader_parse_error``); the grader scores it 0 and counts it.

Torch-free: the API runs a grader for ``/v1/fine_tuning/alpha/graders/run`` with it too."""

import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

Message = dict[str, str]
"""A chat message: ``{"role": ..., "content": ...}``."""

MAX_ANSWER_BYTES = 1024 * 1024
"""Largest judge answer read; a longer one is a server error."""
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class JudgeError(RuntimeError):
    """The judge could not be reached, or kept answering errors, after its retries."""


@dataclass(frozen=True)
class Endpoint:
    """Where a model grader's judge answers: an OpenAI-compatible API."""

    url: str
    """The API's base URL, e.g. ``http://127.0.0.1:8000/v1`` (``/chat/completions`` is appended)."""
    model: str
    """The model name sent in each request."""
    api_key: str | None = None
    """The API key, sent as a bearer token; None: none."""
    timeout_s: float = 60.0
    """Seconds one request may take."""
    retries: int = 2
    """Attempts after the first, on connection errors, timeouts, 429 and 5xx."""
    backoff_s: float = 1.0
    """Seconds before the first retry, doubling for each one after."""
    concurrency: int = 8
    """Requests in flight at once."""

    def schedule_s(self) -> float:
        """The longest one request may take, every attempt timing out after every backoff."""
        return self.timeout_s * (self.retries + 1) + self.backoff_s * (2**self.retries - 1)


@dataclass
class Answer:
    """A judge's answer to one conversation."""

    text: str
    """What the judge wrote."""
    tokens: int
    """The tokens the request used (prompt + completion), as the endpoint reports them; 0 when it does not."""
    refused: bool = False
    """The judge refused (a ``refusal`` in its message, OpenAI's ``model_grader_refusal_error``)."""


def score_instruction(low: float, high: float) -> Message:
    """What a score judge is told, after the grader's own messages, about the answer's form."""
    return {"role": "system", "content": f'Answer with a JSON object {{"result": <number>}}: a number from {low:g} '
                                         f"to {high:g}, and nothing else."}  # fmt: skip


def label_instruction(labels: Sequence[str]) -> Message:
    return {"role": "system", "content": f"Answer with exactly one of these labels and nothing else: "
                                         f"{', '.join(labels)}."}  # fmt: skip


def read_score(text: str, low: float, high: float) -> float | None:
    """The score in a judge's answer, or None when it has none within [low, high]."""
    value: Any = None
    try:
        parsed = json.loads(text.strip())
        value = parsed.get("result") if isinstance(parsed, dict) else parsed
    except json.JSONDecodeError:
        match = _NUMBER.search(text)
        value = float(match.group(0)) if match else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if low <= number <= high else None


def read_label(text: str, labels: Sequence[str]) -> str | None:
    """The label a judge's answer gives: the answer itself when it is one (ignoring case and surrounding quotes,
    spaces and punctuation), else the only label named in it as a word; None otherwise."""
    by_key = {label.casefold(): label for label in labels}
    answer = text.strip().strip("\"'`.!*:").strip().casefold()
    if answer in by_key:
        return by_key[answer]
    try:
        parsed = json.loads(text.strip())
        if isinstance(parsed, dict) and str(parsed.get("result", "")).casefold() in by_key:
            return by_key[str(parsed["result"]).casefold()]
    except json.JSONDecodeError:
        pass
    named = [label for label in labels if re.search(rf"(?<!\w){re.escape(label.casefold())}(?!\w)", answer)]
    return named[0] if len(named) == 1 else None


def ask(
    endpoint: Endpoint,
    conversations: Sequence[list[Message]],
    sampling: dict[str, Any],
    should_stop: Callable[[], bool] | None = None,
) -> list[Answer]:
    """The judge's answer to each conversation, in order. ``sampling``: the request's sampling fields
    (``max_tokens``, ``temperature``, ...). JudgeError when a request fails after its retries; a ``should_stop``
    answering True ends the wait with JudgeError too (the caller turns it into its stop)."""
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    url = endpoint.url.rstrip("/") + "/chat/completions"
    stopping = threading.Event()
    with httpx.Client(timeout=endpoint.timeout_s, headers=headers) as client:

        def one(messages: list[Message]) -> Answer:
            body = {"model": endpoint.model, "messages": messages, **sampling}
            return _request(client, url, body, endpoint, stopping, should_stop)

        with ThreadPoolExecutor(max_workers=max(1, endpoint.concurrency)) as pool:
            futures = [pool.submit(one, messages) for messages in conversations]
            try:
                return [future.result() for future in futures]
            except BaseException:
                stopping.set()
                for future in futures:
                    future.cancel()
                raise


def _request(
    client: httpx.Client, url: str, body: dict[str, Any], endpoint: Endpoint, stopping: threading.Event,
    should_stop: Callable[[], bool] | None,
) -> Answer:  # fmt: skip
    problem = ""
    for attempt in range(endpoint.retries + 1):
        if stopping.is_set() or (should_stop is not None and should_stop()):
            raise JudgeError("stopped while waiting for the judge")
        if attempt:
            time.sleep(endpoint.backoff_s * 2 ** (attempt - 1))
        try:
            response = client.post(url, json=body)
        except httpx.HTTPError as e:
            problem = f"{type(e).__name__}: {e}"
            continue
        if response.status_code == 429 or response.status_code >= 500:
            problem = f"HTTP {response.status_code}"
            continue
        if len(response.content) > MAX_ANSWER_BYTES:
            raise JudgeError(f"the judge {endpoint.model} at {url} answered over {MAX_ANSWER_BYTES} bytes")
        if response.status_code != 200:
            raise JudgeError(f"the judge {endpoint.model} at {url} answered HTTP {response.status_code}: "
                             f"{response.text[:300]}")  # fmt: skip
        return _answer(response, endpoint, url)
    raise JudgeError(f"the judge {endpoint.model} at {url} failed {endpoint.retries + 1} times; last: {problem}")


def _answer(response: httpx.Response, endpoint: Endpoint, url: str) -> Answer:
    try:
        data = response.json()
        message = data["choices"][0]["message"]
        text = message.get("content") or ""
        usage = data.get("usage") or {}
        tokens = int(usage.get("total_tokens") or 0)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise JudgeError(f"the judge {endpoint.model} at {url} answered no chat completion ({e!r})") from None
    return Answer(text=str(text), tokens=tokens, refused=bool(message.get("refusal")))
