"""What a worker bounds or refuses before it trains.

A worker that may download (``RLHF_HUB_DOWNLOADS``) fetches a job's hub models in a child process it watches:
the job trains on the downloaded snapshot, a hub that sends nothing fails it within ``hub_stall_seconds``, and a
cancel sent during the download ends it ``cancelled`` at once (against a hub of the test's own). A job asking
for more processes than the worker has GPUs (or CPU cores) fails at once as ``invalid_spec``; one whose checkpoint
the disk cannot take fails as ``disk_full``, in a sentence without torch's words for it. A distill job's hub
teacher is downloaded the same way."""

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants

from engine.core import checkpoint
from engine.spec import hub
from engine.spec.config import vocabulary_mismatch
from jobs import runner
from jobs.downloads import cached_snapshot, model_files
from jobs.store.models import Job
from jobs.store.settings import Settings
from tests.factories import create_job, make_settings, new_project
from tests.fake_hub import FakeHub, fake_hub
from tests.helpers import wait_until
from tests.hf_cache import use_cache
from tests.jobs.helpers import events, get_job, set_status, sft_spec
from tests.models import build_model

REPO_ID = "someorg/tiny-llama"


@pytest.fixture
def downloading(sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings of a worker that downloads hub models, into an empty cache of this test."""
    use_cache(monkeypatch, tmp_path / "hf-cache")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_answers", {})
    return make_settings(tmp_path, sqlite_url, hub_downloads=True, lease_seconds=30, hub_stall_seconds=60)


def hub_of(served: FakeHub, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """``served`` as the hub of this process and the processes it starts."""
    monkeypatch.setattr(constants, "ENDPOINT", served.endpoint)
    return served


def failed_job(settings: Settings, spec: dict[str, Any]) -> Job:
    """The row of a new job with ``spec`` after a worker ran it and it failed."""
    job_id = create_job(settings, new_project(settings).id, spec)
    assert runner.run_job(job_id, settings=settings, worker="w:1") == "failed"
    return get_job(settings, job_id)


def test_model_files_are_what_from_pretrained_reads() -> None:
    repo = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
            "special_tokens_map.json", "chat_template.jinja", "README.md", ".gitattributes", "training_args.bin",
            "original/consolidated.00.pth", "original/params.json", "onnx/model.onnx"]  # fmt: skip
    assert model_files(repo) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "special_tokens_map.json",
        "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
    ]  # fmt: skip
    # Without safetensors, the PyTorch weights and their index.
    assert model_files(["config.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "vocab.json"]) == [
        "config.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "vocab.json",
    ]  # fmt: skip


def test_a_job_trains_on_the_model_it_downloaded(
    downloading: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model("llama", tmp_path / "published")
    settings = downloading
    job_id = create_job(settings, new_project(settings).id, sft_spec(model=REPO_ID))

    with fake_hub({REPO_ID: model}) as served:
        hub_of(served, monkeypatch)
        status = runner.run_job(job_id, settings=settings, worker="w:1")
    assert status == "succeeded", get_job(settings, job_id).error_message
    assert any(f"/{REPO_ID}/resolve/" in request for request in served.requests)
    assert any(e.message == f"downloading {REPO_ID} from the Hugging Face hub" for e in events(settings, job_id))
    assert get_job(settings, job_id).spec["model"] == REPO_ID  # the stored spec keeps the hub id
    # In the cache as from_pretrained leaves it (refs/main): found again offline, by the inference worker too.
    snapshot = cached_snapshot(REPO_ID)
    assert snapshot is not None and (Path(snapshot) / "model.safetensors").is_file()
    assert cached_snapshot("someorg/never-downloaded") is None


def test_a_distill_job_downloads_its_teacher_and_fails_one_of_another_tokenizer(
    downloading: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub teacher is downloaded like a hub model; one whose tokenizer is not the model's fails the job as
    ``invalid_spec``, with the API's message."""
    teacher = "someorg/tiny-llama-teacher"
    model = build_model("llama", tmp_path / "published")
    settings = downloading
    small = {"total_steps": 1, "batch_size": 2, "group_size": 2, "mini_batch_size": 4, "response_length": 2}
    spec = {"type": "distill", "model": REPO_ID, "teacher": teacher, "dataset": "builtin:digits-prompts"}
    spec["hyperparameters"] = small
    with fake_hub({REPO_ID: model, teacher: model}) as served:
        hub_of(served, monkeypatch)
        job_id = create_job(settings, new_project(settings).id, spec)
        status = runner.run_job(job_id, settings=settings, worker="w:1")
        assert status == "succeeded", get_job(settings, job_id).error_message
        assert any(e.message == f"downloading {teacher} from the Hugging Face hub" for e in events(settings, job_id))
        job = failed_job(settings, {**spec, "model": "builtin:tiny"})
    # the teacher is in the cache now: the worker's own check of the spec's references finds it out first
    assert (job.error_code, job.error_message) == ("invalid_spec", f"teacher: {vocabulary_mismatch('teacher')}")


def test_a_model_the_hub_does_not_have_fails_with_model_not_found(
    downloading: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fake_hub({}) as served:
        hub_of(served, monkeypatch)
        job = failed_job(downloading, sft_spec(model="someorg/missing"))
    assert job.error_code == "model_not_found"
    assert job.error_message is not None and "has no model 'someorg/missing'" in job.error_message


def test_a_hub_that_never_answers_fails_the_job_within_the_stall_bound(
    downloading: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = downloading.model_copy(update={"hub_stall_seconds": 2.0})

    start = time.monotonic()
    with fake_hub(silent=True) as served:
        hub_of(served, monkeypatch)
        job = failed_job(settings, sft_spec(model=REPO_ID))
    assert time.monotonic() - start < 2.0 + 10  # the bound, plus a poll and the child's start
    assert job.error_code == "hub_download_failed"
    assert job.error_message is not None and "sent nothing for 2 s" in job.error_message


def test_a_cancel_sent_while_a_model_downloads_ends_the_job_cancelled(
    downloading: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = downloading
    job_id = create_job(settings, new_project(settings).id, sft_spec(model=REPO_ID))
    ended: list[str] = []

    with fake_hub(silent=True) as served:
        hub_of(served, monkeypatch)
        worker = threading.Thread(target=lambda: ended.append(runner.run_job(job_id, settings=settings, worker="w:1")))
        worker.start()
        wait_until(lambda: get_job(settings, job_id).status == "running" and events(settings, job_id)[-1].message
                   .startswith("downloading"), timeout=30, what="the download to start")  # fmt: skip
        set_status(settings, job_id, ("running",), "cancelling")
        cancelled_at = time.monotonic()
        worker.join(timeout=30)
    assert ended == ["cancelled"]
    assert time.monotonic() - cancelled_at < 10  # well inside the stall bound (60 s)
    job = get_job(settings, job_id)
    assert job.status == "cancelled" and job.worker is None


def test_more_processes_than_the_worker_has_fail_at_once(
    sqlite_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "processors", lambda: 2)
    job = failed_job(sqlite_settings, sft_spec(resources={"num_processes": 4}))
    assert job.error_code == "invalid_spec"
    assert job.error_message is not None and "resources.num_processes is 4" in job.error_message


def test_a_checkpoint_the_disk_cannot_take_fails_the_job_with_disk_full(
    sqlite_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 308864 vs 308752")

    monkeypatch.setattr(checkpoint.torch, "save", full)  # what torch.save raises when the disk fills up
    job = failed_job(sqlite_settings, sft_spec())
    assert job.error_code == "disk_full"
    assert job.error_message == "the server's disk is full; nothing more can be stored until space is freed"
