"""GET /v1/jobs/{id}/model and /v1/jobs/{id}/checkpoints/{step}/model: a checkpoint's Hugging Face folder as a
tar (the adapters of a LoRA job in ``adapter/``, nothing else of the checkpoint), scoped to the project, with 404
and 409 for what is not there (yet). Checkpoint folders are written here as a worker lays them out; real trained
models downloaded through ``rlhf download``: tests/jobs/test_download.py."""

import io
import json
import tarfile
from pathlib import Path

from fastapi.testclient import TestClient

from jobs.store.settings import Settings
from tests.api.helpers import Db, error_of
from tests.factories import Project, new_project

POLICY = {"config.json": b'{"model_type": "gpt2"}', "model.safetensors": b"\x01" * 3000, "tokenizer.json": b"{}"}
# as peft writes it: the base model by the path the worker loaded it from, which the archive replaces
ADAPTERS = {
    "adapter_config.json": b'{"r": 4, "base_model_name_or_path": "worker-cache/base-model"}',
    "adapter_model.safetensors": b"\x02" * 700,
}


def write_checkpoint(
    settings: Settings, db: Db, job_id: str, step: int, lora: bool = False, kept: tuple[int, ...] = ()
) -> Path:
    """A PPO-shaped checkpoint folder (policy, value, trainer state; with LoRA the adapters of both) and its row,
    keeping the rows of the ``kept`` steps."""
    folder = settings.resolved_artifacts_dir / "jobs" / job_id / "checkpoints" / f"step-{step}"
    contents = {f"policy/{name}": data for name, data in POLICY.items()}
    contents |= {"value/config.json": b"{}", "value/model.safetensors": b"\x03" * 10, "trainer_state.pt": b"s"}
    if lora:
        contents |= {
            f"adapters/{model}/{name}": data for model in ("policy", "value") for name, data in ADAPTERS.items()
        }
    for name, data in contents.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    db.checkpoint(job_id, step, kept)
    return folder


def archive(response: object) -> dict[str, bytes]:
    """The regular files of a tar response, by name, after checking its headers."""
    assert response.status_code == 200, response.text  # type: ignore[attr-defined]
    headers = response.headers  # type: ignore[attr-defined]
    content: bytes = response.content  # type: ignore[attr-defined]
    assert headers["content-type"] == "application/x-tar"
    assert int(headers["content-length"]) == len(content)
    with tarfile.open(fileobj=io.BytesIO(content)) as tar:
        files = {}
        for member in tar.getmembers():
            assert member.isfile(), member.name
            extracted = tar.extractfile(member)
            assert extracted is not None
            files[member.name] = extracted.read()
        return files


def test_a_lora_jobs_model_is_its_merged_folder_with_the_adapters_beside_it(
    client: TestClient, project: Project, db: Db, settings: Settings
) -> None:
    job_id = db.job(project.id, status="running")
    write_checkpoint(settings, db, job_id, 2, lora=True)
    folder = write_checkpoint(settings, db, job_id, 4, lora=True, kept=(2,))
    (folder / "policy" / "elsewhere").symlink_to(settings.resolved_artifacts_dir.parent)  # never followed
    (folder / "policy" / "link.json").symlink_to(folder / "trainer_state.pt")
    db.status(job_id, "succeeded", step=4, output_step=4)

    response = client.get(f"/v1/jobs/{job_id}/model")
    assert response.headers["content-disposition"] == f'attachment; filename="{job_id}.tar"'
    expected = {f"{job_id}/{name}": data for name, data in POLICY.items()}
    expected |= {f"{job_id}/adapter/{name}": data for name, data in ADAPTERS.items()}
    # the adapters' base model is the job's model as its spec names it, not a path of the worker's
    spec_model = client.get(f"/v1/jobs/{job_id}").json()["spec"]["model"]
    config = {"r": 4, "base_model_name_or_path": spec_model}
    expected[f"{job_id}/adapter/adapter_config.json"] = json.dumps(config, indent=2).encode()
    files = archive(response)
    assert files == expected  # no value model, trainer state, links, or the value model's adapters
    assert list(files) == list(expected)  # the model first, then its adapters

    older = client.get(f"/v1/jobs/{job_id}/checkpoints/2/model")
    assert older.headers["content-disposition"] == f'attachment; filename="{job_id}-step-2.tar"'
    assert set(archive(older)) == {name.replace(job_id, f"{job_id}-step-2", 1) for name in expected}


def test_a_full_model_has_no_adapter_folder(client: TestClient, project: Project, db: Db, settings: Settings) -> None:
    job_id = db.job(project.id, status="running")
    write_checkpoint(settings, db, job_id, 3)
    assert archive(client.get(f"/v1/jobs/{job_id}/checkpoints/3/model")) == {
        f"{job_id}-step-3/{name}": data for name, data in POLICY.items()
    }


def test_what_is_not_there_is_404_and_what_is_not_there_yet_409(
    client: TestClient, project: Project, db: Db, settings: Settings
) -> None:
    job_id = db.job(project.id, status="queued")
    assert client.get(f"/v1/jobs/{job_id}/model").status_code == 409  # it may still succeed
    db.status(job_id, "running", step=5)
    write_checkpoint(settings, db, job_id, 2)
    running = client.get(f"/v1/jobs/{job_id}/model")
    assert running.status_code == 409
    assert error_of(running)["code"] == "conflict" and "steps 2" in error_of(running)["message"]
    assert client.get(f"/v1/jobs/{job_id}/checkpoints/2/model").status_code == 200  # a checkpoint of a running job
    ahead = client.get(f"/v1/jobs/{job_id}/checkpoints/6/model")
    assert ahead.status_code == 409 and error_of(ahead)["param"] == "step"
    passed = client.get(f"/v1/jobs/{job_id}/checkpoints/4/model")  # passed without checkpointing it
    assert passed.status_code == 404
    assert error_of(passed) == {
        "code": "checkpoint_not_found",
        "message": f"job {job_id} has no checkpoint at step 4; its kept checkpoints: steps 2",
        "param": "step",
    }

    db.status(job_id, "failed")
    failed = client.get(f"/v1/jobs/{job_id}/model")
    assert failed.status_code == 404 and "no final model" in error_of(failed)["message"]
    assert client.get(f"/v1/jobs/{job_id}/checkpoints/6/model").status_code == 404  # it never will
    assert client.get(f"/v1/jobs/{job_id}/checkpoints/2/model").status_code == 200

    gone = db.job(project.id, status="running")
    write_checkpoint(settings, db, gone, 1)
    (settings.resolved_artifacts_dir / "jobs" / gone / "checkpoints" / "step-1" / "policy" / "config.json").unlink()
    db.status(gone, "succeeded", step=1, output_step=1)
    assert client.get(f"/v1/jobs/{gone}/model").status_code == 404  # its row, but no saved model

    assert client.get(f"/v1/jobs/{job_id}/checkpoints/-1/model").status_code == 422
    assert client.get("/v1/jobs/job_nope/model").status_code == 404


def test_another_projects_job_is_404(client: TestClient, db: Db, settings: Settings) -> None:
    other = new_project(settings, name="other")
    job_id = db.job(other.id, status="running")
    write_checkpoint(settings, db, job_id, 1)
    db.status(job_id, "succeeded", step=1, output_step=1)
    for url in (f"/v1/jobs/{job_id}/model", f"/v1/jobs/{job_id}/checkpoints/1/model"):
        response = client.get(url)
        assert response.status_code == 404
        assert error_of(response) == {
            "code": "not_found",
            "message": f"no job {job_id!r} in this project",
            "param": None,
        }
    assert client.get(f"/v1/jobs/{job_id}/model", headers=other.headers).status_code == 200
