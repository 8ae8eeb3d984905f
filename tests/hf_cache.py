"""A Hugging Face cache of the test's own, holding models placed the way huggingface_hub lays them out
(``models--org--name/snapshots/<commit>/`` and ``refs/main``), so that nothing is downloaded."""

import hashlib
import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants


def use_cache(monkeypatch: pytest.MonkeyPatch, cache: Path) -> Path:
    """Make ``cache`` the Hugging Face cache of this process (and of the processes it starts). huggingface_hub
    read ``HF_HUB_CACHE`` into its constants when imported, and reads the constant at each call."""
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def put_in_cache(cache: Path, repo_id: str, files: dict[str, str] | Path) -> Path:
    """``repo_id``'s snapshot in ``cache``: a folder's files, or ``{name: text}``; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    if isinstance(files, Path):
        shutil.copytree(files, snapshot)
    else:
        snapshot.mkdir(parents=True)
        for name, text in files.items():
            (snapshot / name).write_text(text)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot
