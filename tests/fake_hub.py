"""A Hugging Face hub of the test's own, on a loopback port: it serves the model folders it is given the way
huggingface_hub asks for them (``/api/models/<id>`` for the file list, ``/<id>/resolve/<commit>/<file>`` for
each file), or, ``silent``, accepts connections and never answers a request."""

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FakeHub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, models: dict[str, Path], silent: bool) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.models = models
        self.silent = silent
        self.released = threading.Event()
        """Set when the hub shuts down: a silent hub's handlers stop waiting."""
        self.requests: list[str] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def commit_of(repo_id: str) -> str:
    return hashlib.sha1(repo_id.encode()).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        self.server.requests.append(f"{self.command} {self.path}")
        if self.server.silent:
            self.server.released.wait()
            return
        path = self.path.split("?")[0].strip("/")
        for repo_id, folder in self.server.models.items():
            commit = commit_of(repo_id)
            if path in (f"api/models/{repo_id}", f"api/models/{repo_id}/revision/{commit}",
                        f"api/models/{repo_id}/revision/main"):  # fmt: skip
                files = [{"rfilename": p.name} for p in sorted(folder.iterdir()) if p.is_file()]
                return self._send(json.dumps({"id": repo_id, "sha": commit, "siblings": files}).encode(), body)
            if path.startswith(f"api/models/{repo_id}/tree/"):
                tree = [_tree_entry(p) for p in sorted(folder.iterdir()) if p.is_file()]
                return self._send(json.dumps(tree).encode(), body)
            for revision in (commit, "main"):
                prefix = f"{repo_id}/resolve/{revision}/"
                if path.startswith(prefix) and (folder / path.removeprefix(prefix)).is_file():
                    data = (folder / path.removeprefix(prefix)).read_bytes()
                    etag = hashlib.sha256(data).hexdigest()
                    return self._send(data, body, {"X-Repo-Commit": commit, "ETag": f'"{etag}"'})
        self._send(b'{"error": "Repository not found"}', body, {"X-Error-Code": "RepoNotFound"}, status=404)

    def _send(self, data: bytes, body: bool, headers: dict[str, str] | None = None, status: int = 200) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


def _tree_entry(path: Path) -> dict[str, object]:
    return {"type": "file", "path": path.name, "size": path.stat().st_size, "oid": commit_of(path.name)}


@contextmanager
def fake_hub(models: dict[str, Path] | None = None, *, silent: bool = False) -> Iterator[FakeHub]:
    """A running hub serving ``models`` (hub id → folder), or a silent one."""
    hub = FakeHub(models or {}, silent)
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.released.set()
        hub.shutdown()
        hub.server_close()
