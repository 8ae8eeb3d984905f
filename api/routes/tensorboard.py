"""``GET /v1/jobs/{id}/tensorboard``: a job's TensorBoard event files as a ``.tar.gz`` (written by its worker when
the spec's ``tracking.tensorboard`` or the server's ``RLHF_TRACKING`` switches TensorBoard on).

The archive holds one folder named by the job's id, so archives of several jobs unpacked side by side show as
runs of one ``tensorboard --logdir .``. A running job's files are archived as far as they are written.
"""

import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from api.deps import CurrentProject, SessionDep, SettingsDep
from api.errors import ApiError
from api.services.jobs import job_or_404
from engine.tracking import TENSORBOARD_DIR
from jobs.store.refs import job_dir

router = APIRouter(prefix="/jobs", tags=["jobs"])

CHUNK_BYTES = 1024 * 1024


@router.get(
    "/{job_id}/tensorboard",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/gzip": {}}, "description": "The event files, as a gzipped tar."}},
)
def download_tensorboard(
    session: SessionDep, settings: SettingsDep, project: CurrentProject, job_id: str
) -> StreamingResponse:
    """The job's TensorBoard event files as ``<job id>-tensorboard.tar.gz``, holding ``<job id>/events.out.tfevents.*``
    (``tar xzf`` it, then ``tensorboard --logdir .``). 404 when the job has none: TensorBoard was not switched on
    for it, or it has not started."""
    job = job_or_404(session, project, job_id)
    folder = job_dir(settings.resolved_artifacts_dir, job.id) / TENSORBOARD_DIR
    files = event_files(folder)
    if not files:
        message = f"job {job.id} has no TensorBoard event files (tracking.tensorboard was off, or it has not started)"
        raise ApiError(404, "not_found", message)
    headers = {"Content-Disposition": f'attachment; filename="{job.id}-tensorboard.tar.gz"'}
    return StreamingResponse(gzipped_tar(folder, files, job.id), media_type="application/gzip", headers=headers)


def event_files(folder: Path) -> list[Path]:
    """The regular files under ``folder`` (no links), if it holds an event file; else none."""
    files = sorted(path for path in folder.rglob("*") if path.is_file() and not path.is_symlink())
    return files if any("tfevents" in path.name for path in files) else []


def gzipped_tar(folder: Path, files: list[Path], root: str) -> Iterator[bytes]:
    """``files`` (under ``folder``) in a gzipped tar, under ``root/``, in chunks."""
    with tempfile.TemporaryFile() as archive:
        with tarfile.open(fileobj=archive, mode="w:gz") as tar:
            for path in files:
                tar.add(path, arcname=f"{root}/{path.relative_to(folder).as_posix()}", recursive=False)
        archive.seek(0)
        while chunk := archive.read(CHUNK_BYTES):
            yield chunk
