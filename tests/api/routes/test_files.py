"""POST/GET /v1/files: JSONL validated line by line; nothing partial is stored."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from api.routes.files import STALE_UPLOAD_SECONDS
from jobs.store import crud
from jobs.store.settings import Settings
from tests.api.helpers import Db, error_of, jsonl
from tests.factories import Project, new_project

USER = {"role": "user", "content": "2+2?"}
ANSWER = {"role": "assistant", "content": "4"}
SFT_ROWS = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(3)]


def upload(client: TestClient, content: bytes, purpose: str = "sft", filename: str = "data.jsonl") -> Any:
    return client.post("/v1/files", files={"file": (filename, content, "application/jsonl")}, data={"purpose": purpose})


def stored_files(settings: Settings) -> list[Path]:
    folder = settings.resolved_artifacts_dir / "files"
    return sorted(folder.iterdir()) if folder.exists() else []


def test_upload_then_get_and_list(client: TestClient, settings: Settings, project: Project) -> None:
    content = jsonl(SFT_ROWS) + b"\n   \n"  # blank lines are skipped
    response = upload(client, content)
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["id"].startswith("file-")
    assert body["object"] == "file"
    assert (body["filename"], body["purpose"], body["bytes"], body["rows"]) == ("data.jsonl", "sft", len(content), 3)
    assert body["created_at"].endswith(("Z", "+00:00"))

    assert stored_files(settings) == [settings.resolved_artifacts_dir / "files" / f"{body['id']}.jsonl"]
    assert stored_files(settings)[0].read_bytes() == content
    with Db(settings).session() as session:
        row = crud.get_file(session, file_id=body["id"], project_id=project.id)
        assert row is not None and row.path == f"files/{body['id']}.jsonl"

    assert client.get(f"/v1/files/{body['id']}").json() == body
    assert client.get("/v1/files").json() == {"data": [body], "has_more": False}
    other = new_project(settings, "other")
    assert client.get(f"/v1/files/{body['id']}", headers=other.headers).status_code == 404


@pytest.mark.parametrize(
    ("purpose", "content", "line", "needle"),
    [
        ("sft", jsonl(SFT_ROWS[:2]) + b'{"prompt": "a", "completion": \n', 3, "invalid JSON"),
        ("sft", jsonl(SFT_ROWS[:1]) + jsonl([{"prompt": "a"}]), 2, "'completion'"),
        ("sft", jsonl([{"prompt": "a", "completion": ""}]), 1, "'completion'"),
        ("rm", jsonl([{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"}]), 2, "rejected"),
        ("ppo", b'{"prompt": "a"}\n\n["a list"]\n', 3, "JSON object"),
        ("ppo", b'{"prompt": "a"}\n{"prompt": 7}\n', 2, "'prompt'"),
        ("ppo", b'{"prompt": "a"}\r\n{"prompt": "\xff"}\r\n', 2, "UTF-8"),
        # a prompt that ends with the answer: GRPO would train on prompts holding it
        ("prompts", jsonl([{"prompt": "a"}, {"prompt": [USER, ANSWER]}]), 2, "'prompt' ends with an assistant"),
        ("prompts", jsonl([{"messages": [USER, ANSWER], "reference_answer": "4"}]), 1, "'messages' ends with an"),
        (
            "ppo",
            jsonl([{"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}]),
            1,
            "assistant",
        ),
    ],
)
def test_bad_line_is_rejected_with_its_number_and_nothing_stored(
    client: TestClient, settings: Settings, purpose: str, content: bytes, line: int, needle: str
) -> None:
    response = upload(client, content, purpose)
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert error["code"] == "invalid_file"
    assert error["param"] == "file"
    assert f"line {line}:" in error["message"]
    assert needle in error["message"]
    assert stored_files(settings) == []
    assert client.get("/v1/files").json()["data"] == []


def test_empty_file_and_bad_purpose(client: TestClient, settings: Settings) -> None:
    empty = upload(client, b"\n\n")
    assert empty.status_code == 422
    assert error_of(empty)["code"] == "invalid_file"
    bad_purpose = upload(client, jsonl(SFT_ROWS), purpose="dpo")
    assert bad_purpose.status_code == 422
    assert error_of(bad_purpose) | {"message": ""} == {"code": "invalid_request", "param": "purpose", "message": ""}
    missing = client.post("/v1/files", data={"purpose": "sft"})
    assert missing.status_code == 422
    assert error_of(missing)["param"] == "file"
    assert stored_files(settings) == []


def test_files_list_pages(client: TestClient) -> None:
    ids = [upload(client, jsonl(SFT_ROWS), filename=f"{i}.jsonl").json()["id"] for i in range(3)]
    first = client.get("/v1/files", params={"limit": 2}).json()
    second = client.get("/v1/files", params={"limit": 2, "after": first["data"][-1]["id"]}).json()
    assert (first["has_more"], second["has_more"]) == (True, False)
    assert sorted(f["id"] for f in first["data"] + second["data"]) == sorted(ids)


def test_unknown_file_is_404(client: TestClient) -> None:
    response = client.get("/v1/files/file-000000000000")
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"


def test_unparsable_lines_are_422_naming_the_line(client: TestClient) -> None:
    """JSON too deep for the parser, or an integer of more digits than it converts: a 422, not a 500."""
    good = b'{"prompt": "a", "completion": "b"}\n'
    for bad in (b"[" * 5000 + b"]" * 5000, b'{"prompt": "a", "completion": "b", "n": ' + b"9" * 5000 + b"}"):
        response = upload(client, good + bad + b"\n")
        assert response.status_code == 422, response.text
        assert error_of(response)["message"].startswith("line 2: invalid JSON"), error_of(response)
    raw_breaks = '{"prompt": "a\u2028b", "completion": "c\u0085d"}\n'.encode()  # raw U+2028 / U+0085 in strings
    assert upload(client, raw_breaks).json()["rows"] == 1


def test_an_interrupted_uploads_temporary_file_is_removed_when_the_api_starts(
    settings: Settings, project: Project
) -> None:
    """kill -9 of the API while it writes an upload leaves ``.<name>~<host>~<pid>~<random>.tmp`` with no row: the
    next start removes it at once when its writer was a process of this host that has ended, and a file of another
    host once it is older than any upload in progress could be; a live writer's file stays."""
    files_dir = settings.resolved_artifacts_dir / "files"
    files_dir.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        temps = {
            "ended": files_dir / f".file-aaaa.jsonl~{host}~{int(ended.stdout)}~x1.tmp",
            "alive": files_dir / f".file-bbbb.jsonl~{host}~{alive.pid}~x2.tmp",
            "elsewhere": files_dir / ".file-cccc.jsonl~another-host~4242~x3.tmp",
            "elsewhere_stale": files_dir / ".file-dddd.jsonl~another-host~4243~x4.tmp",
        }
        for path in temps.values():
            path.write_bytes(b"{}" * 1000)
        stale = time.time() - STALE_UPLOAD_SECONDS - 60
        os.utime(temps["elsewhere_stale"], (stale, stale))
        with TestClient(create_app(settings, enqueue=lambda *_: None, recovery_interval=None), headers=project.headers):
            pass
        alive.kill()
    kept = {name: path.exists() for name, path in temps.items()}
    assert kept == {"ended": False, "alive": True, "elsewhere": True, "elsewhere_stale": False}
