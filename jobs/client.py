"""A small HTTP client of the service, and the ``rlhf`` commands that use it: ``submit``, ``jobs``, ``logs`` and
``generate JOB``. :func:`follow` shows a job's live progress (``--follow``, and the stages of ``rlhf demo``)."""

import argparse
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engine import cli as engine_cli
from jobs.store.settings import Settings, get_settings

SERVER_FILE = "server.json"
KEY_FILE = "api-key"
FINAL = ("succeeded", "failed", "cancelled")
STREAM_RECONNECT_S = 120.0
"""How long :meth:`Client.stream` keeps trying to reconnect after the stream last worked."""
STREAM_RETRY_FIRST_S = 0.2
STREAM_RETRY_MAX_S = 2.0
"""Pause before the first reconnect, doubled each try up to this."""
STREAM_TIMEOUT = httpx.Timeout(10.0, read=60.0)
"""The server sends a keep-alive comment at least every 15 s: a minute of silence is a dead connection."""
RETRY_STATUSES = (502, 503, 504)


class ClientError(RuntimeError):
    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" (param: {param})" if param else ""))
        self.status, self.code, self.param = status, code, param


@dataclass
class SseMessage:
    event: str
    id: str | None
    data: Any


class Client:
    def __init__(self, url: str, api_key: str, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout)

    @classmethod
    def discover(cls, settings: Settings, url: str | None = None, api_key: str | None = None) -> "Client":
        """Flags first, then ``RLHF_URL`` / ``RLHF_API_KEY``, then what ``rlhf serve`` wrote in its data folder."""
        url = url or settings.url
        api_key = api_key or settings.api_key
        server_file, key_file = settings.data_dir / SERVER_FILE, settings.data_dir / KEY_FILE
        if url is None and server_file.exists():
            url = json.loads(server_file.read_text())["url"]
        if api_key is None and key_file.exists():
            api_key = key_file.read_text().strip()
        if url is None or api_key is None:
            raise SystemExit(
                f"no server found: start one with `rlhf serve` (it writes {server_file}), or pass --url and --api-key"
            )
        return cls(url, api_key)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        if response.is_error:
            try:
                error = response.json()["error"]
            except (ValueError, KeyError, TypeError):
                raise ClientError(response.status_code, "http_error", response.text[:500]) from None
            raise ClientError(response.status_code, error["code"], error["message"], error.get("param"))
        return response.json()

    def upload_file(self, path: Path, purpose: str) -> dict[str, Any]:
        with path.open("rb") as f:
            return self.request("POST", "/v1/files", files={"file": (path.name, f)}, data={"purpose": purpose})

    def create_job(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self.request("POST", "/v1/jobs", json=spec, headers=headers)

    def create_pipeline(self, stages: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        """``POST /v1/pipelines``: the stages' jobs, by stage name."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        jobs: dict[str, Any] = self.request("POST", "/v1/pipelines", json={"stages": stages}, headers=headers)["stages"]
        return jobs

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/jobs/{job_id}")

    def stream(
        self, job_id: str, last_event_id: str | None = None, *, reconnect_for: float = STREAM_RECONNECT_S
    ) -> Iterator[SseMessage]:
        """The job's SSE stream until ``end``. A dropped connection (the API restarting, a proxy timing out)
        is opened again with ``Last-Event-ID``, so each message arrives once. Connection errors, a stream
        closed before ``end`` and 502, 503 and 504 answers are retried with a growing pause for up to
        ``reconnect_for`` seconds after the server last sent anything (a message or a keep-alive comment); then
        :class:`ClientError` (503) is raised."""
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        delay = STREAM_RETRY_FIRST_S
        ok_since = time.monotonic()
        """When the server last sent a line (or the call began): the reconnect budget counts from here."""

        def lines(response: httpx.Response) -> Iterator[str]:
            nonlocal ok_since
            for line in response.iter_lines():
                ok_since = time.monotonic()
                yield line

        while True:
            if last_event_id:
                headers["Last-Event-ID"] = last_event_id
            try:
                with self.http.stream(
                    "GET", f"/v1/jobs/{job_id}/stream", headers=headers, timeout=STREAM_TIMEOUT
                ) as response:
                    if response.status_code in RETRY_STATUSES:
                        raise _Unavailable(response.status_code)
                    if response.is_error:
                        response.read()
                        self.request("GET", f"/v1/jobs/{job_id}")  # raises the API's error
                        raise ClientError(response.status_code, "http_error", response.text[:500])
                    for message in parse_sse(lines(response)):
                        last_event_id, delay = message.id or last_event_id, STREAM_RETRY_FIRST_S
                        yield message
                        ok_since = time.monotonic()  # the caller's time with the message does not count
                        if message.event == "end":
                            return
                error: Exception = _Unavailable(None)  # closed before ``end`` (e.g. the server shutting down)
            except (httpx.TransportError, _Unavailable) as e:
                error = e
            if time.monotonic() - ok_since > reconnect_for:
                raise ClientError(503, "stream_unavailable", f"the stream of {job_id} broke off: {error!r}") from error
            time.sleep(delay)
            delay = min(delay * 2, STREAM_RETRY_MAX_S)


class _Unavailable(Exception):
    """A 502/503/504 answer to a stream request, or a stream closed before ``end``: worth trying again."""

    def __init__(self, status: int | None) -> None:
        super().__init__(f"HTTP {status}" if status else "the stream closed before its end message")


def parse_sse(lines: Iterator[str]) -> Iterator[SseMessage]:
    """Server-Sent Events (https://html.spec.whatwg.org/multipage/server-sent-events.html), JSON data."""
    event, event_id, data = "message", None, list[str]()
    for line in lines:
        if not line:
            if data:
                yield SseMessage(event, event_id, json.loads("\n".join(data)))
            event, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
            elif field == "id":
                event_id = value


# --- commands ----------------------------------------------------------------------------------


def client_for(args: argparse.Namespace) -> Client:
    """The client of the server named by the flags, the environment or ``rlhf serve``'s data folder."""
    return Client.discover(get_settings(), args.url, args.api_key)


def cmd_submit(args: argparse.Namespace) -> None:
    """A job spec, or a pipeline file (``{"stages": {name: spec, ...}}``, later stages naming earlier ones as
    ``stage:<name>``) submitted whole in one request."""
    spec = engine_cli.read_spec(args.spec)
    c = client_for(args)
    if "stages" in spec and "type" not in spec:
        jobs = c.create_pipeline(spec["stages"], args.idempotency_key)
        for name, job in jobs.items():
            print(f"{name}: {job['id']} {job['status']}")
        if args.follow:
            for name, job in jobs.items():
                follow(c, job["id"], name)
        return
    engine_cli.parse_spec(spec, str(args.spec))  # the same validation the server does, before any upload
    job = c.create_job(spec, args.idempotency_key)
    print(json.dumps(job))
    if args.follow:
        follow(c, job["id"])


def cmd_jobs(args: argparse.Namespace) -> None:
    c = client_for(args)
    if args.action == "list":
        params = {k: v for k, v in (("status", args.status), ("type", args.type), ("limit", args.limit)) if v}
        for job in c.request("GET", "/v1/jobs", params=params)["data"]:
            print(f"{job['id']}  {job['type']:<4} {job['status']:<10} step {job['step']}/{job['total_steps'] or '?'}")
        return
    if args.job is None:
        raise SystemExit(f"rlhf jobs {args.action} needs a job id")
    if args.action == "get":
        print(json.dumps(c.get_job(args.job), indent=2))
    else:
        print(json.dumps(c.request("POST", f"/v1/jobs/{args.job}/{args.action}")))


def follow(c: Client, job_id: str, label: str | None = None) -> dict[str, Any]:
    """Live progress bar and key metrics of a job from its SSE stream, until it ends; returns the job."""
    job = c.get_job(job_id)
    bar = engine_cli.ProgressBar(job["type"], label or job.get("name") or job_id)
    started = False
    try:
        for message in c.stream(job_id):
            if message.event in ("metrics", "status") and not started:
                total = c.get_job(job_id)["total_steps"]
                if total:
                    bar.on_start(0, total)
                    started = True
            if message.event == "metrics" and started:
                bar.on_metrics(message.data["step"], message.data["metrics"])
            elif message.event == "event" and message.data["kind"] in ("warning", "error"):
                bar.on_event(message.data["kind"], message.data["message"])
    finally:
        bar.close()
    job = c.get_job(job_id)
    error = f" ({job['error']['code']}: {job['error']['message']})" if job.get("error") else ""
    print(f"{bar.label}: {job['status']} at step {job['step']}{error}", flush=True)
    return job


def cmd_logs(args: argparse.Namespace) -> None:
    c = client_for(args)
    if args.follow:
        follow(c, args.job)
        return
    for event in c.request("GET", f"/v1/jobs/{args.job}/events", params={"limit": 100})["data"]:
        print(f"{event['created_at']}  {event['kind']:<10} {event['message']}")


def cmd_generate(args: argparse.Namespace) -> None:
    """``rlhf generate JOB PROMPT``: sample from a job's checkpoint on the server."""
    if args.job is None or not (args.prompt or args.prompt_text):
        raise SystemExit("usage: rlhf generate JOB PROMPT [--checkpoint N], or rlhf generate --model DIR --prompt TEXT")
    prompts = (args.prompt or []) + ([args.prompt_text] if args.prompt_text else [])
    if args.chat:
        chat(args, prompts)
        return
    body = {
        "prompts": prompts,
        "checkpoint": args.checkpoint,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "score": args.score,
    }
    result = client_for(args).request("POST", f"/v1/jobs/{args.job}/generate", json=body)
    for completion in result["completions"]:
        print(json.dumps({"checkpoint": result["checkpoint"], **completion}))


def chat(args: argparse.Namespace, prompts: list[str]) -> None:
    """``rlhf generate JOB PROMPT --chat``: each prompt a user turn to the job's model (or ``--checkpoint N``)
    through ``/v1/chat/completions``, which renders it with the model's chat template."""
    if args.score:
        raise SystemExit("rlhf generate --chat cannot --score; leave out one of them")
    model = f"job:{args.job}" if args.checkpoint == "latest" else f"job:{args.job}@{args.checkpoint}"
    client = client_for(args)
    for messages in engine_cli.chat_prompts(prompts, args.system):
        body = {
            "model": model,
            "messages": messages,
            "max_completion_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": args.seed,
        }
        result = client.request("POST", "/v1/chat/completions", json=body)
        choice = result["choices"][0]
        print(
            json.dumps(
                {
                    "model": model,
                    "prompt": messages,
                    "text": choice["message"]["content"],
                    "finish_reason": choice["finish_reason"],
                }
            )
        )
