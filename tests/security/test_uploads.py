"""Bad uploads: refused with a precise message (the line at fault), nothing stored — no file row, no file on
disk — and the server unaffected: the next request works. The huge ones go to a real server over a socket,
which refuses them before reading them."""

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient

from api.main import create_app
from jobs.store import crud
from jobs.store.settings import Settings
from tests.api.helpers import Db, error_of, jsonl
from tests.factories import Project, make_settings

ROW = {"prompt": "a prompt", "completion": "a completion"}
GIB = 1024**3


def upload(client: TestClient, content: bytes, purpose: str = "sft") -> Any:
    files = {"file": ("d.jsonl", content, "application/jsonl")}
    return client.post("/v1/files", files=files, data={"purpose": purpose})


def nothing_stored(settings: Settings, project: Project) -> None:
    folder = settings.resolved_artifacts_dir / "files"
    assert not folder.exists() or list(folder.iterdir()) == []  # no file, no temporary file either
    with Db(settings).session() as session:
        assert crud.list_files(session, project_id=project.id, after=None, limit=10)[0] == []


def still_works(client: TestClient, settings: Settings) -> None:
    response = upload(client, jsonl([ROW]))
    assert response.status_code == 201, response.text
    assert [p.name for p in (settings.resolved_artifacts_dir / "files").iterdir()] == [f"{response.json()['id']}.jsonl"]


@pytest.mark.parametrize(
    ("content", "purpose", "message"),
    [
        (jsonl([ROW, ROW]) + b'{"prompt": "caf\xc3\xa9 \xff", "completion": "x"}\n', "sft", "line 3: not valid UTF-8"),
        (b"\xc3(" + b"\n", "sft", "line 1: not valid UTF-8"),
        (jsonl([ROW]) + b'{"prompt": 12, "completion": "x"}\n', "sft", "line 2: field 'prompt' must be a non-empty"),
        (jsonl([ROW]) + b'{"prompt": "a", "completion": ["x"]}\n', "sft", "line 2: field 'completion'"),
        (jsonl([{"prompt": "a", "chosen": "b", "rejected": None}]), "rm", "line 1: field 'rejected'"),
        (jsonl([ROW]) + b"\n\n[1, 2]\n", "sft", "line 4: expected a JSON object, got list"),
        (jsonl([ROW]) + b'{"prompt": "a", "completion": "b"', "sft", "line 2: invalid JSON"),
        (b"", "sft", "the file has no rows"),
        (b"\n \n\t\n", "ppo", "the file has no rows"),
    ],
    ids=["utf8-line-3", "utf8-line-1", "int-prompt", "list-completion", "null-rejected", "list-row", "truncated",
         "empty", "blank"],
)  # fmt: skip
def test_bad_files_are_refused_naming_the_line(
    client: TestClient, settings: Settings, project: Project, content: bytes, purpose: str, message: str
) -> None:
    response = upload(client, content, purpose)
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert (error["code"], error["param"]) == ("invalid_file", "file")
    assert error["message"].startswith(message), error["message"]
    nothing_stored(settings, project)
    still_works(client, settings)


def test_a_line_over_the_cap_is_refused(client: TestClient, settings: Settings, project: Project) -> None:
    limit = settings.max_line_bytes
    assert limit == 1024 * 1024  # the default
    long_row = b'{"prompt": "' + b"x" * limit + b'", "completion": "c"}\n'
    response = upload(client, jsonl([ROW]) + long_row + jsonl([ROW]))
    assert response.status_code == 422
    error = error_of(response)
    assert error["code"] == "invalid_file"
    assert error["message"] == f"line 2: longer than the limit of {limit} bytes"
    nothing_stored(settings, project)
    still_works(client, settings)


def test_the_line_cap_counts_bytes_without_the_line_ending(tmp_path: Path, database_url: str, project: Project) -> None:
    settings = make_settings(tmp_path, database_url, max_line_bytes=100)
    app = create_app(settings, enqueue=lambda *_: None, recovery_interval=None)

    def row_of(size: int) -> bytes:
        head = b'{"prompt": "p", "completion": "'
        return head + b"y" * (size - len(head) - 2) + b'"}'

    with TestClient(app, headers=project.headers) as client:
        exact = row_of(100)
        assert len(exact) == 100
        assert upload(client, exact + b"\r\n" + exact + b"\n" + exact).status_code == 201
        over = upload(client, exact + b"\n" + row_of(101) + b"\r\n")
        assert error_of(over)["message"] == "line 2: longer than the limit of 100 bytes"
        multibyte = upload(client, b'{"prompt": "p", "completion": "' + "é".encode() * 40 + b'"}\n')
        assert error_of(multibyte)["message"] == "line 1: longer than the limit of 100 bytes"  # 113 bytes


# --- a real server for the huge bodies ----------------------------------------------------------


@contextmanager
def serve(settings: Settings) -> Iterator[tuple[str, int]]:
    """The app under uvicorn on a free loopback port, in a thread; its address."""
    app = create_app(settings, enqueue=lambda *_: None, recovery_interval=None)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not (server.started and server.servers):
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield "127.0.0.1", server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def server(settings: Settings) -> Iterator[tuple[str, int]]:
    with serve(settings) as address:
        yield address


def head(method: str, path: str, key: str, **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {key}"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket, data: bytes = b"") -> tuple[int, bytes]:
    """(status, body) of the response read from ``sock`` (after what was already read: ``data``)."""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed: {data!r}"
        data += chunk
    header, _, body = data.partition(b"\r\n\r\n")
    lengths = [line.split(b":")[1] for line in header.split(b"\r\n") if line.lower().startswith(b"content-length")]
    length = int(lengths[0])
    while len(body) < length:
        body += sock.recv(65536)
    return int(header.split()[1]), body


MULTIPART = "multipart/form-data; boundary=b"
PREAMBLE = b'--b\r\nContent-Disposition: form-data; name="file"; filename="huge.jsonl"\r\n\r\n'


def test_a_declared_1_gib_upload_is_refused_before_it_is_read(
    server: tuple[str, int], settings: Settings, project: Project
) -> None:
    with socket.create_connection(server, timeout=10) as sock:
        sock.sendall(head("POST", "/v1/files", project.key, Content_Type=MULTIPART, Content_Length=str(GIB)))
        sock.sendall(PREAMBLE + jsonl([ROW]) * 10)  # a first few bytes of the gigabyte; the rest never comes
        status, body = read_response(sock)
    assert status == 413
    assert b'"code":"file_too_large"' in body
    assert str(settings.max_upload_bytes).encode() in body
    nothing_stored(settings, project)
    with TestClient(create_app(settings, recovery_interval=None), headers=project.headers) as client:
        assert client.get("/v1/files").json()["data"] == []
    with socket.create_connection(server, timeout=10) as sock:  # the server still answers
        sock.sendall(head("GET", "/healthz", project.key))
        assert read_response(sock)[0] == 200


def test_a_declared_1_gib_job_spec_is_refused(server: tuple[str, int], project: Project) -> None:
    with socket.create_connection(server, timeout=10) as sock:
        sock.sendall(head("POST", "/v1/jobs", project.key, Content_Type="application/json", Content_Length=str(GIB)))
        sock.sendall(b'{"type": "sft", "metadata": {"a": "')
        status, body = read_response(sock)
    assert status == 413
    assert b'"code":"request_too_large"' in body


def test_a_streamed_upload_is_cut_off_at_the_limit(tmp_path: Path, database_url: str, project: Project) -> None:
    """Chunked, without a declared length: the server answers 413 once the body passes the limit; the client,
    ready to send a gigabyte, stops after a few megabytes."""
    settings = make_settings(tmp_path, database_url, max_upload_bytes=1024 * 1024)
    sent = 0
    with serve(settings) as address:
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(head("POST", "/v1/files", project.key, Content_Type=MULTIPART, Transfer_Encoding="chunked"))
            chunk = jsonl([ROW]) * 1000  # 52 KB
            frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
            sock.sendall(f"{len(PREAMBLE):x}\r\n".encode() + PREAMBLE + b"\r\n")
            sock.setblocking(False)
            answer, pending = b"", memoryview(b"")
            while sent < GIB:  # a gigabyte, frame after frame, until the server answers
                try:
                    answer += sock.recv(65536)
                    if b"\r\n\r\n" in answer:
                        break
                except BlockingIOError:
                    pass
                if not pending:
                    pending = memoryview(frame)
                try:
                    n = sock.send(pending)
                except BlockingIOError:
                    time.sleep(0.001)
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent, pending = sent + n, pending[n:]
                assert sent < 64 * 1024 * 1024, "the server kept reading"
            sock.setblocking(True)
            status, body = read_response(sock, answer)
        assert (status, json.loads(body)["error"]["code"]) == (413, "file_too_large")
        assert sent < 64 * 1024 * 1024
        nothing_stored(settings, project)
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(head("GET", "/v1/files", project.key))
            assert read_response(sock) == (200, b'{"data":[],"has_more":false}')
