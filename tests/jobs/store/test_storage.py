"""Telling a full disk and a storage that refuses writes apart from other failures, wherever the write failed."""

import errno
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from jobs.store import storage
from jobs.store.storage import DISK_FULL, NOT_WRITABLE, check_writable, storage_error


def raised_from(cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as e:
            raise RuntimeError("saving the checkpoint failed") from e
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(
    ("error", "problem"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), DISK_FULL),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), DISK_FULL),
        (OSError(errno.EROFS, "Read-only file system"), NOT_WRITABLE),
        (PermissionError(errno.EACCES, "Permission denied"), NOT_WRITABLE),
        (OperationalError("INSERT INTO jobs", {}, sqlite3.OperationalError("database or disk is full")), DISK_FULL),
        (
            OperationalError("INSERT", {}, sqlite3.OperationalError("attempt to write a readonly database")),
            NOT_WRITABLE,
        ),
        (RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 308864 vs 308752"), DISK_FULL),
        (RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed"), DISK_FULL),
        (Exception('could not extend file "base/16384/2619": No space left on device'), DISK_FULL),
        (raised_from(OSError(errno.ENOSPC, "No space left on device")), DISK_FULL),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory"), None),
        (OSError(errno.ECONNREFUSED, "Connection refused"), None),
        (ValueError("max_length is 4096"), None),
    ],
)
def test_storage_error(error: BaseException, problem: str | None) -> None:
    assert storage_error(error) == problem


def test_check_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_writable(tmp_path / "artifacts", min_free_bytes=1) is None
    assert list((tmp_path / "artifacts").iterdir()) == []  # the probe file is gone
    assert check_writable(tmp_path, min_free_bytes=2**62) == DISK_FULL

    def refuse(**_kwargs: object) -> tuple[int, str]:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(storage.tempfile, "mkstemp", refuse)
    assert check_writable(tmp_path, min_free_bytes=1) == NOT_WRITABLE
