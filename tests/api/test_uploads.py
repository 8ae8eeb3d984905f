"""Upload size limit: 413 ``file_too_large`` whether the size is declared up front or not."""

from collections.abc import Iterator
from pathlib import Path

from fastapi.testclient import TestClient

from api.main import create_app
from tests.api.helpers import error_of
from tests.factories import Project, make_settings


def test_oversized_uploads_are_413(tmp_path: Path, database_url: str, project: Project) -> None:
    settings = make_settings(tmp_path, database_url, max_upload_bytes=1000)
    row = b'{"prompt": "a prompt", "completion": "a completion"}\n'
    app = create_app(settings, enqueue=lambda *_: None, recovery_interval=None)
    with TestClient(app, headers=project.headers) as client:
        # Over the limit, within the multipart slack: the route measures the file.
        just_over = client.post("/v1/files", files={"file": ("a.jsonl", row * 25)}, data={"purpose": "sft"})
        assert just_over.status_code == 413
        assert error_of(just_over) | {"message": ""} == {"code": "file_too_large", "param": "file", "message": ""}
        # Far over, with Content-Length: refused before the body is read.
        declared = client.post("/v1/files", files={"file": ("a.jsonl", row * 5000)}, data={"purpose": "sft"})
        assert declared.status_code == 413
        assert error_of(declared)["code"] == "file_too_large"

        # Far over, chunked (no Content-Length): cut off while streaming.
        def chunks() -> Iterator[bytes]:
            yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
            for _ in range(5000):
                yield row

        chunked = client.post(
            "/v1/files", content=chunks(), headers={"Content-Type": "multipart/form-data; boundary=b"}
        )
        assert chunked.status_code == 413
        assert error_of(chunked)["code"] == "file_too_large"

        assert (
            client.post("/v1/files", files={"file": ("a.jsonl", row * 5)}, data={"purpose": "sft"}).status_code == 201
        )
    assert len(list((settings.resolved_artifacts_dir / "files").iterdir())) == 1
