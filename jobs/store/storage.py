"""Storage the service cannot write: a full disk or a read-only (or not writable) folder, told apart from other
failures so that the API answers them 507 with a code of their own, a job fails with that code rather than
``internal_error``, and ``/readyz`` reports them before a request meets them. Torch-free.

The signs, wherever the failed write happened:

- an ``OSError`` with ``ENOSPC`` or ``EDQUOT`` (full), ``EROFS``, ``EACCES`` or ``EPERM`` (not writable);
- "No space left on device" in a message (PostgreSQL's, safetensors'), and SQLite's "database or disk is full"
  and "attempt to write a readonly database", inside SQLAlchemy's error;
- torch's checkpoint writer cut short ("unexpected pos N vs M", "PytorchStreamWriter failed writing file"),
  which is how ``torch.save`` reports a full disk.
"""

import errno
import os
import shutil
import tempfile
from pathlib import Path

DISK_FULL = "disk_full"
NOT_WRITABLE = "storage_not_writable"
MESSAGES = {
    DISK_FULL: "the server's disk is full; nothing more can be stored until space is freed",
    NOT_WRITABLE: "the server's storage is read-only or not writable by the service",
}
"""What a user is told; the failed write itself goes to the server's log."""

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_NOT_WRITABLE_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}
_FULL_TEXTS = ("No space left on device", "database or disk is full", "unexpected pos",
               "PytorchStreamWriter failed writing")  # fmt: skip
_NOT_WRITABLE_TEXTS = ("readonly database", "read-only file system")


def storage_error(error: BaseException) -> str | None:
    """:data:`DISK_FULL` or :data:`NOT_WRITABLE` when ``error`` (or an error it was raised from, or wraps as
    SQLAlchemy's ``orig``) is a write the storage refused; None otherwise."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL_ERRNOS:
            return DISK_FULL
        if isinstance(current, OSError) and current.errno in _NOT_WRITABLE_ERRNOS:
            return NOT_WRITABLE
        text = str(current)
        if any(sign in text for sign in _FULL_TEXTS):
            return DISK_FULL
        if any(sign in text.lower() for sign in _NOT_WRITABLE_TEXTS):
            return NOT_WRITABLE
        orig = getattr(current, "orig", None)
        pending += [current.__cause__, current.__context__, orig if isinstance(orig, BaseException) else None]
    return None


def check_writable(folder: Path, min_free_bytes: int) -> str | None:
    """Whether the service can store files in ``folder`` now: None, or why not (:data:`DISK_FULL` when a probe
    file cannot be written for lack of space or fewer than ``min_free_bytes`` are free, :data:`NOT_WRITABLE`)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".ready-", suffix=".tmp")
        try:
            os.write(fd, b"ready")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        return storage_error(e) or NOT_WRITABLE
    return DISK_FULL if shutil.disk_usage(folder).free < min_free_bytes else None
