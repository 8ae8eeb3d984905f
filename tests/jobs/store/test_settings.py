"""Settings from ``RLHF_*`` variables: a list setting takes the bare word the README shows (``loopback``), a comma
list or JSON; a variable that does not read stops ``rlhf serve``, ``rlhf api`` and ``rlhf worker`` with one line
naming it, not a parser's traceback (issue 39, items 3.6 and 4.13)."""

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs.store.settings import InvalidSettings, Settings, get_settings, load_settings
from tests.factories import environment_settings

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def clean_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No RLHF_* variable of the environment leaks in; the cached settings are dropped before and after."""
    yield from environment_settings(monkeypatch, tmp_path / "data")


@pytest.mark.parametrize(
    ("variable", "value", "field", "expected"),
    [
        ("RLHF_REWARD_URLS", "loopback", "reward_urls", ["loopback"]),
        (
            "RLHF_REWARD_URLS",
            "loopback, https://rewards.internal/",
            "reward_urls",
            ["loopback", "https://rewards.internal/"],
        ),
        ("RLHF_REWARD_URLS", '["loopback"]', "reward_urls", ["loopback"]),
        ("RLHF_REWARD_URLS", "", "reward_urls", []),
        (
            "RLHF_REWARD_FUNCTIONS",
            "my_rewards:length,my_rewards:format",
            "reward_functions",
            ["my_rewards:length", "my_rewards:format"],
        ),
        ("RLHF_TRACKING", "tensorboard", "tracking", ["tensorboard"]),
        ("RLHF_TRACKING", "tensorboard,mlflow", "tracking", ["tensorboard", "mlflow"]),
        ("RLHF_CORS_ORIGINS", "https://dash.example.com", "cors_origins", ["https://dash.example.com"]),
        ("RLHF_DEVICE_MEMORY", '{"train": "80GB"}', "device_memory", {"train": 80_000_000_000}),
        (
            "RLHF_JUDGES",
            '{"small": {"url": "http://127.0.0.1:8000/v1"}}',
            "judges",
            {"small": "http://127.0.0.1:8000/v1"},
        ),
    ],
)
def test_list_settings_take_a_bare_word_a_comma_list_or_json(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, field: str, expected: Any
) -> None:
    monkeypatch.setenv(variable, value)
    got = getattr(load_settings(), field)
    assert ({name: judge.url for name, judge in got.items()} if field == "judges" else got) == expected


@pytest.mark.parametrize(
    ("env", "lines"),
    [
        ({"RLHF_DEVICE_MEMORY": '{"train": "0"}'}, ["RLHF_DEVICE_MEMORY: 'train': Input should be greater than 0"]),
        (
            {"RLHF_DEVICE_MEMORY": '{"train": "0GB", "big": "-80GB"}'},
            ["RLHF_DEVICE_MEMORY: 'train': Input should be greater than 0; 'big': could not parse value and unit"],
        ),
        ({"RLHF_DEVICE_MEMORY": "80GB"}, ["RLHF_DEVICE_MEMORY: not a JSON object"]),
        (
            {"RLHF_JUDGES": '{"small": {"url": ""}', "RLHF_TRACKING": "tensorboard,tensorbord"},
            ["RLHF_JUDGES: not a JSON object", "RLHF_TRACKING: item 1: Input should be 'tensorboard', 'mlflow'"],
        ),
        (
            {"RLHF_REWARD_URLS": '["loopback"', "RLHF_MAX_PROCESSES": "eight"},
            ["RLHF_MAX_PROCESSES: Input should be a valid integer", "RLHF_REWARD_URLS: not a JSON list"],
        ),
    ],
)
def test_each_variable_that_does_not_read_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], lines: list[str]
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidSettings) as info:
        get_settings()
    assert len(info.value.lines) == len(lines), info.value.lines
    for line, start in zip(sorted(info.value.lines), sorted(lines), strict=True):
        assert line.startswith(start), line


def test_a_device_of_no_memory_is_refused_in_code_too() -> None:
    with pytest.raises(ValueError, match="greater than 0"):
        Settings(device_memory={"train": 0})  # type: ignore[dict-item]  # ByteSize from an int, as pydantic reads it


@pytest.mark.parametrize("command", [["serve", "--port", "1"], ["api", "--port", "1"], ["worker", "--queues", "train"]])
def test_the_server_commands_stop_with_one_line_a_variable(command: list[str], tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RLHF_")}
    env = {
        **clean,
        "RLHF_DATA_DIR": str(tmp_path / "data"),
        "RLHF_REWARD_URLS": "loopback",  # the README's bare word: fine
        "RLHF_DEVICE_MEMORY": '{"train": "0"}',
        "RLHF_MAX_PROCESSES": "eight",
    }
    if command[0] == "serve":
        command = [*command, "--data-dir", str(tmp_path / "data")]
    done = subprocess.run(
        [sys.executable, "-m", "jobs.cli", *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert sorted(done.stderr.strip().splitlines()) == [
        "error: RLHF_DEVICE_MEMORY: 'train': Input should be greater than 0",
        "error: RLHF_MAX_PROCESSES: Input should be a valid integer, unable to parse string as an integer",
    ], done.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was made
