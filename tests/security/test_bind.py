"""``rlhf api`` and ``rlhf serve`` listen on loopback only, unless ``--allow-remote`` or ``RLHF_ALLOW_REMOTE=true``
says otherwise."""

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import jobs.cli
import jobs.supervisor
from jobs.cli import check_bind_address, is_loopback
from jobs.store.settings import get_settings
from tests.factories import environment_settings

ROOT = Path(__file__).resolve().parents[2]
REMOTE = ["0.0.0.0", "::", "192.168.1.10", "10.0.0.1", "example.com", ""]
LOOPBACK = ["127.0.0.1", "127.0.0.2", "localhost", "LOCALHOST", "::1", "[::1]"]


@pytest.fixture(autouse=True)
def clean_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No RLHF_* variable of the environment leaks in; the cached settings are dropped before and after."""
    yield from environment_settings(monkeypatch, tmp_path / "data")


class Started(BaseException):
    """Raised by the stand-ins of the servers: the command got past the address check. (Not an Exception, which
    the command line would turn into its one-line error.)"""


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host)
    check_bind_address(host, allow_remote=False)


@pytest.mark.parametrize("host", REMOTE)
def test_other_addresses_need_the_opt_in(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(SystemExit, match=r"refusing to listen on .*--allow-remote.*RLHF_ALLOW_REMOTE"):
        check_bind_address(host, allow_remote=False)
    check_bind_address(host, allow_remote=True)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RLHF_")}
    return subprocess.run(
        [sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env={**clean, **(env or {})},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("command", ["api", "serve"])
def test_the_commands_refuse_a_public_address(command: str, tmp_path: Path) -> None:
    data = tmp_path / "server"
    extra = ["--data-dir", str(data)] if command == "serve" else []
    result = run_cli(command, "--host", "0.0.0.0", "--port", "1", *extra, env={"RLHF_DATA_DIR": str(data)})
    assert result.returncode != 0
    assert "refusing to listen on '0.0.0.0'" in result.stderr
    assert "--allow-remote" in result.stderr
    assert "Traceback" not in result.stderr
    assert not data.exists()  # refused before anything was set up


def test_api_starts_with_the_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    started: list[dict[str, Any]] = []

    def fake_run(app: str, **kwargs: Any) -> None:
        started.append(kwargs)

    monkeypatch.setattr(uvicorn, "run", fake_run)
    with pytest.raises(SystemExit, match="refusing"):
        jobs.cli.main(["api", "--host", "0.0.0.0"])
    assert started == []
    jobs.cli.main(["api", "--host", "0.0.0.0", "--allow-remote"])
    assert started[-1]["host"] == "0.0.0.0"
    monkeypatch.setenv("RLHF_ALLOW_REMOTE", "true")
    get_settings.cache_clear()
    jobs.cli.main(["api", "--host", "::"])
    assert started[-1]["host"] == "::"
    jobs.cli.main(["api"])
    assert started[-1]["host"] == "127.0.0.1"  # loopback by default


@pytest.mark.parametrize("opt_in", ["flag", "environment"])
def test_serve_starts_with_the_opt_in_and_passes_it_to_its_api(
    opt_in: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    commands: list[list[str]] = []

    def fake_popen(command: list[str], **kwargs: Any) -> Any:
        commands.append(command)
        raise Started

    monkeypatch.setattr(jobs.supervisor.subprocess, "Popen", fake_popen)
    args = ["serve", "--host", "0.0.0.0", "--data-dir", str(tmp_path / "server")]
    with pytest.raises(SystemExit, match="refusing"):
        jobs.cli.main(args)
    assert commands == []
    if opt_in == "flag":
        args.append("--allow-remote")
    else:
        monkeypatch.setenv("RLHF_ALLOW_REMOTE", "true")
        get_settings.cache_clear()
    with pytest.raises(Started):
        jobs.cli.main(args)
    [api] = commands
    assert api[api.index("--host") + 1] == "0.0.0.0"
    assert "--allow-remote" in api
