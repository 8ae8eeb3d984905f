"""``/v1/files``: JSONL datasets, validated in full before anything is stored."""

import contextlib
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Annotated, BinaryIO

from fastapi import APIRouter, File, Form, Query, UploadFile

from api.datasets import InvalidFile, summarize
from api.deps import CurrentProject, SessionDep, SettingsDep
from api.errors import ApiError, error_responses, not_found
from api.schemas import ID_PATTERN, FilePublic, FilesPublic, FineTuneFile, Purpose, file_object, looks_like_id
from jobs.store import crud

router = APIRouter(prefix="/files", tags=["files"])


@router.post("", status_code=201, responses=error_responses(400, 507))
def upload_file(
    session: SessionDep,
    settings: SettingsDep,
    project: CurrentProject,
    file: Annotated[UploadFile, File(description="JSONL, one JSON object per line (blank lines are skipped).")],
    purpose: Annotated[
        Purpose,
        Form(
            description="Row kind: `sft` {prompt, completion} or {messages}, `preference` {prompt, chosen, rejected} "
            "(or only chosen and rejected conversations), `prompts` {prompt}; texts are strings or lists of chat "
            "messages. `rm` and `ppo` are accepted for `preference` and `prompts`. `fine-tune`: one of OpenAI's "
            "fine-tuning formats (supervised {messages}, DPO {input, preferred_output, non_preferred_output}, "
            "reinforcement {messages, ...reference fields}), for /v1/fine_tuning/jobs and /v1/jobs alike; it is "
            "answered as OpenAI's file object."
        ),
    ],
) -> FilePublic | FineTuneFile:
    """Upload a dataset. A bad line (not JSON, not UTF-8, a wrong field, longer than the line limit) is rejected
    with its number (422 ``invalid_file``); a file over the size limit is 413 ``file_too_large``. Nothing of a
    refused upload is kept."""
    stream = file.file
    size = stream.seek(0, os.SEEK_END)
    stream.seek(0)
    if size > settings.max_upload_bytes:
        raise ApiError(
            413, "file_too_large", f"the file has {size} bytes; the limit is {settings.max_upload_bytes}", param="file"
        )
    try:
        summary = summarize(stream, purpose, settings.max_line_bytes)
    except InvalidFile as e:
        raise ApiError(422, "invalid_file", str(e), param="file") from None
    stream.seek(0)

    file_id = crud.new_id("file-")
    relative = Path("files") / f"{file_id}.jsonl"
    target = settings.resolved_artifacts_dir / relative
    _write_atomically(stream, target)
    try:
        row = crud.create_file(
            session,
            file_id=file_id,
            project_id=project.id,
            filename=_filename(file.filename),
            purpose=purpose,
            kind=summary.kind,
            size=size,
            rows=summary.rows,
            chat=summary.chat,
            path=relative.as_posix(),
        )
        session.commit()
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return file_object(row)


@router.get("")
def list_files(
    session: SessionDep,
    project: CurrentProject,
    after: Annotated[
        str | None, Query(description="Id of the last file of the previous page.", max_length=64, pattern=ID_PATTERN)
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> FilesPublic:
    """The project's files, newest first."""
    rows, has_more = crud.list_files(session, project_id=project.id, after=after, limit=limit)
    return FilesPublic(data=[file_object(row) for row in rows], has_more=has_more)


@router.get("/{file_id}")
def get_file(session: SessionDep, project: CurrentProject, file_id: str) -> FilePublic | FineTuneFile:
    row = crud.get_file(session, file_id=file_id, project_id=project.id) if looks_like_id(file_id) else None
    if row is None:
        raise not_found("file", file_id)
    return file_object(row)


def _filename(name: str | None) -> str:
    """The client's file name without folders or control characters, at most 255 characters."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(c for c in base if c.isprintable())
    return base[:255] or "upload.jsonl"


STALE_UPLOAD_SECONDS = 600
"""An upload's temporary file untouched this long was left by an API process that died writing it: the copy of an
upload the API has received to disk takes seconds."""


def remove_stale_uploads(files_dir: Path, older_than_s: float = STALE_UPLOAD_SECONDS) -> list[str]:
    """Delete the temporary files (``.<name>~<host>~<pid>~<random>.tmp``) that uploads interrupted by a killed API
    left: at once those whose writer, a process of this host, has ended, and the others (another host's) once they
    are older than any upload in progress could be; returns their names. Run when the API starts."""
    if not files_dir.is_dir():
        return []
    cutoff = time.time() - older_than_s
    removed = []
    for path in files_dir.glob(".*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            if path.is_file() and (_writer_ended(path.name) or path.stat().st_mtime < cutoff):
                path.unlink()
                removed.append(path.name)
    return removed


def _temp_prefix(target: Path) -> str:
    """The start of the name of ``target``'s temporary file: whose it is, so that a restart can tell it was lost."""
    return f".{target.name}~{socket.gethostname()}~{os.getpid()}~"


def _writer_ended(name: str) -> bool:
    """Whether the process of this host that wrote the temporary file ``name`` has ended."""
    parts = name.split("~")
    if len(parts) != 4 or parts[1] != socket.gethostname() or not parts[2].isdigit():
        return False
    pid = int(parts[2])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, as another user's
        return False
    return False


def _write_atomically(stream: BinaryIO, target: Path) -> None:
    """Copy to a temporary file beside ``target`` and rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=_temp_prefix(target), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(stream, out, 1024 * 1024)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
