"""GET /v1/jobs/{id}/tensorboard: the job's event files as a tar.gz, nothing else of its folder; 404 when it has
none. (A worker writing them for real: tests/jobs/test_tracking.py.)"""

import io
import tarfile

from fastapi.testclient import TestClient

from jobs.store.settings import Settings
from tests.api.helpers import Db, error_of
from tests.factories import Project


def test_the_event_files_download_as_a_tar_gz(client: TestClient, project: Project, db: Db, settings: Settings) -> None:
    job_id = db.job(project.id, status="running")
    url = f"/v1/jobs/{job_id}/tensorboard"
    missing = client.get(url)
    assert missing.status_code == 404
    assert error_of(missing)["code"] == "not_found" and job_id in error_of(missing)["message"]

    folder = settings.resolved_artifacts_dir / "jobs" / job_id / "tensorboard"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("no event file yet")
    assert client.get(url).status_code == 404  # a folder without event files is none
    (folder / "events.out.tfevents.1.host.1.0").write_bytes(b"\x18\x00" * 100)
    (folder / "elsewhere").symlink_to(settings.resolved_artifacts_dir.parent)  # never followed
    (folder.parent / "spec.json").write_text("{}")  # the rest of the job folder is not served

    response = client.get(url)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/gzip"
    assert response.headers["content-disposition"] == f'attachment; filename="{job_id}-tensorboard.tar.gz"'
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as tar:
        assert tar.getnames() == [f"{job_id}/events.out.tfevents.1.host.1.0", f"{job_id}/notes.txt"]
        member = tar.extractfile(f"{job_id}/events.out.tfevents.1.host.1.0")
        assert member is not None and member.read() == b"\x18\x00" * 100
