"""A small HTTP client of the service, used by the ``rlhf`` command (submit, jobs, logs, generate, demo)."""

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from jobs.store.settings import Settings

SERVER_FILE = "server.json"
KEY_FILE = "api-key"
FINAL = ("succeeded", "failed", "cancelled")


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

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/jobs/{job_id}")

    def stream(self, job_id: str, last_event_id: str | None = None) -> Iterator[SseMessage]:
        """The job's SSE stream until ``end``; reconnects with ``Last-Event-ID`` if the connection drops."""
        while True:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
            try:
                with self.http.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers, timeout=None) as response:
                    if response.is_error:
                        response.read()
                        self.request("GET", f"/v1/jobs/{job_id}")  # raises the API's error
                    for message in parse_sse(response.iter_lines()):
                        last_event_id = message.id or last_event_id
                        yield message
                        if message.event == "end":
                            return
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError):
                time.sleep(1.0)


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
