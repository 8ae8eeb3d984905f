"""A small HTTP client of the service, and the ``rlhf`` commands that use it: ``submit``, ``jobs``, ``logs``,
``generate JOB`` and ``download JOB[@STEP]``. :func:`follow` shows a job's live progress (``--follow``, and the stages
of ``rlhf demo``)."""

import argparse
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
from tqdm import tqdm

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
DOWNLOAD_TIMEOUT = httpx.Timeout(10.0, read=300.0)
"""A model download may wait on a slow disk between chunks, never for minutes."""


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
            raise error_of(response)
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

    def download_model(
        self, job_id: str, step: int | None, dest: Path, force: bool = False, progress: bool = True
    ) -> Path:
        """Download the final model of a job (``step`` None) or the model of its checkpoint at ``step``, and unpack
        it into the folder ``dest``: a Hugging Face folder (with ``adapter/`` for a LoRA job). A non-empty ``dest``
        is refused (FileExistsError) unless ``force``, which replaces the files and folders the archive holds and
        leaves the others. The archive is unpacked beside ``dest`` as it arrives (``progress``: a bar of its
        bytes) and moved in once whole, so a failed download leaves ``dest`` as it was."""
        dest = dest.resolve()
        if dest.exists() and not dest.is_dir():
            raise FileExistsError(f"{dest} exists and is not a folder")
        if dest.is_dir() and any(dest.iterdir()) and not force:
            raise FileExistsError(f"{dest} is not empty; pass --force to replace the files the model brings")
        path = f"/v1/jobs/{job_id}/model" if step is None else f"/v1/jobs/{job_id}/checkpoints/{step}/model"
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-download-", dir=dest.parent))
        try:
            with self.http.stream("GET", path, timeout=DOWNLOAD_TIMEOUT) as response:
                if response.is_error:
                    response.read()
                    raise error_of(response)
                size = response.headers.get("content-length")
                total = int(size) if size else None
                with tqdm(total=total, desc=dest.name, unit="B", unit_scale=True, disable=not progress) as bar:
                    unpack_model(ChunkReader(response.iter_bytes(), bar.update), staging)
            dest.mkdir(exist_ok=True)
            for entry in sorted(staging.iterdir()):
                target = dest / entry.name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                elif target.exists() or target.is_symlink():
                    target.unlink()
                os.replace(entry, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return dest

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


def error_of(response: httpx.Response) -> ClientError:
    """The API's error envelope of a (read) error response, as a :class:`ClientError`."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return ClientError(response.status_code, "http_error", response.text[:500])
    return ClientError(response.status_code, error["code"], error["message"], error.get("param"))


class ChunkReader:
    """The ``read(size)`` of a file over an iterator of byte chunks (a response body), calling ``on_bytes`` with the
    length of each chunk it takes: what ``tarfile`` reads a stream from."""

    def __init__(self, chunks: Iterator[bytes], on_bytes: Callable[[int], object] | None = None) -> None:
        self.chunks, self.on_bytes = chunks, on_bytes
        self.buffer = bytearray()

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self.buffer) < size:
            chunk = next(self.chunks, None)
            if chunk is None:
                break
            if self.on_bytes is not None:
                self.on_bytes(len(chunk))
            self.buffer += chunk
        taken = bytes(self.buffer if size < 0 else self.buffer[:size])
        del self.buffer[: len(taken)]
        return taken


class UnsafeArchiveError(ValueError):
    """A model archive holding what a model folder never holds: a link, a device, a sparse file, a path out of its
    folder."""


def unpack_model(fileobj: Any, folder: Path) -> None:
    """Unpack a model archive (a tar of one top folder, read as a stream from ``fileobj``) into ``folder``, without
    its top folder. Only regular files (not sparse ones) and folders, at relative paths without ``..``, inside that
    one top folder are taken; anything else raises :class:`UnsafeArchiveError` (tarfile's ``data`` filter checks
    again after)."""
    top: list[str] = []

    def inside_top(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
        parts = PurePosixPath(member.name).parts
        if not (member.isfile() or member.isdir()) or member.name.startswith("/") or ".." in parts or not parts:
            raise UnsafeArchiveError(f"the archive holds {member.name!r}, which a model folder never holds")
        if member.issparse():  # GNU or PAX sparse: a few bytes that unpack to any size (a file of holes)
            raise UnsafeArchiveError(f"the archive's {member.name!r} is a sparse file, which a model archive never is")
        top[:] = top or [parts[0]]
        if parts[0] != top[0] or (len(parts) == 1 and not member.isdir()):
            raise UnsafeArchiveError(f"the archive's {member.name!r} is outside its one top folder {top[0]!r}")
        if len(parts) == 1:
            return None  # the top folder itself: its files go straight into ``folder``
        return tarfile.data_filter(member.replace(name="/".join(parts[1:]), deep=False), path)

    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        tar.extractall(folder, filter=inside_top)


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


_MODEL_REF = re.compile(r"^(?:job:)?([A-Za-z0-9_-]+)(?:@(\d+))?$")


def parse_model_ref(ref: str) -> tuple[str, int | None]:
    """``JOB``, ``JOB@STEP``, ``job:JOB`` or ``job:JOB@STEP`` (the model ids of the OpenAI-compatible endpoints) as
    (job id, step or None)."""
    match = _MODEL_REF.match(ref)
    if match is None:
        raise SystemExit(f"error: {ref!r} is not JOB or JOB@STEP (a job id, and optionally a checkpoint's step)")
    return match.group(1), int(match.group(2)) if match.group(2) else None


def cmd_download(args: argparse.Namespace) -> None:
    """``rlhf download JOB[@STEP] [-o DIR] [--force]``: a job's final model, or a checkpoint's, unpacked into
    ``DIR`` (default ``./<job id>``, or ``./<job id>-step-<STEP>``)."""
    job_id, step = parse_model_ref(args.job)
    dest = args.out or Path(job_id if step is None else f"{job_id}-step-{step}")
    try:
        folder = client_for(args).download_model(job_id, step, dest, force=args.force)
    except (OSError, UnsafeArchiveError) as e:  # a non-empty folder, a disk full
        raise SystemExit(f"error: {e}") from None
    except (httpx.HTTPError, tarfile.TarError) as e:
        raise SystemExit(f"error: the download of {args.job} broke off, {dest} is as it was: {e!r}") from None
    print(folder)
