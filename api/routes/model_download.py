"""``GET /v1/jobs/{id}/model`` and ``GET /v1/jobs/{id}/checkpoints/{step}/model``: a job's final model, or the model
of one of its checkpoints, as a ``.tar`` of its Hugging Face folder (``rlhf download JOB[@STEP]`` unpacks it).

The archive holds one folder, ``<job id>/`` (the final model) or ``<job id>-step-<N>/`` (a checkpoint): the
checkpoint's ``policy/`` as the worker saved it (``config.json``, ``model.safetensors``, ``generation_config.json``,
the tokenizer's files), which ``AutoModelForCausalLM.from_pretrained`` loads (``AutoModelForSequenceClassification``
for a reward model), and for a LoRA job, whose ``policy/`` holds the merged weights, the adapters themselves in
``adapter/`` (``adapter_config.json``, ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, folder /
"adapter")``). A PPO job's value model (``value/``) is a training tool, not part of the download.

A plain tar, not gzipped: safetensors hardly compress, and a plain tar is streamed straight from the files with its
exact ``Content-Length`` known up front (:mod:`api.tar_stream`), without a temporary file.
"""

import json
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session

from api.deps import CurrentProject, SessionDep, SettingsDep
from api.errors import ApiError, ErrorResponse
from api.schemas import MAX_INT32
from api.services.jobs import job_or_404
from api.tar_stream import Member, archive_size, regular_files, stream
from jobs.store import crud
from jobs.store.models import LIVE_STATUSES, Job
from jobs.store.settings import Settings

router = APIRouter(prefix="/jobs", tags=["jobs"])

POLICY_DIR = "policy"
"""The trained model's folder in a checkpoint (``engine/core/checkpoint.py``); with LoRA, merged."""
ADAPTERS_DIR = "adapters/policy"
"""A LoRA job's adapters in a checkpoint, beside the merged ``policy/``."""
ADAPTER_DIR = "adapter"
"""Where the adapters go in the archive, inside the model's folder."""

RESPONSES: dict[int | str, dict[str, object]] = {
    200: {"content": {"application/x-tar": {}}, "description": "The model's Hugging Face folder, as a tar."},
    404: {"model": ErrorResponse, "description": "No such job in the project, or it has no model (or checkpoint)."},
    409: {"model": ErrorResponse, "description": "The job is unfinished and has not saved that model yet."},
}


@router.get("/{job_id}/model", response_class=StreamingResponse, responses=RESPONSES)
def download_model(
    session: SessionDep, settings: SettingsDep, project: CurrentProject, job_id: str
) -> StreamingResponse:
    """The final model of a succeeded job as ``<job id>.tar``, holding ``<job id>/`` (with ``adapter/`` for a LoRA
    job). 409 while the job may still succeed (its checkpoints download meanwhile); 404 once it failed or was
    cancelled: it has no final model."""
    job = job_or_404(session, project, job_id)
    if job.status != "succeeded" or job.output_step is None:
        kept = _kept(session, job)
        if job.status in LIVE_STATUSES:
            message = f"job {job.id} is {job.status}: its final model is there once it succeeds{kept}"
            raise ApiError(409, "conflict", message)
        raise ApiError(404, "not_found", f"job {job.id} is {job.status}: it has no final model{kept}")
    return _archive(session, settings, job, job.output_step, root=job.id, param=None)


@router.get("/{job_id}/checkpoints/{step}/model", response_class=StreamingResponse, responses=RESPONSES)
def download_checkpoint_model(
    session: SessionDep,
    settings: SettingsDep,
    project: CurrentProject,
    job_id: str,
    step: Annotated[int, PathParam(ge=0, le=MAX_INT32)],
) -> StreamingResponse:
    """The model of the job's checkpoint at ``step`` (of a job still training too) as ``<job id>-step-<step>.tar``,
    holding ``<job id>-step-<step>/``. 409 while the job is unfinished and has not passed that step; 404 for a step
    it did not keep."""
    job = job_or_404(session, project, job_id)
    return _archive(session, settings, job, step, root=f"{job.id}-step-{step}", param="step")


def _archive(
    session: Session, settings: Settings, job: Job, step: int, root: str, param: str | None
) -> StreamingResponse:
    """The streamed archive of checkpoint ``step``'s model under ``root/``, or the 404 / 409 that says why not."""
    checkpoint = crud.get_checkpoint(session, job_id=job.id, step=step)
    members = None
    if checkpoint is not None:
        try:
            members = model_members(settings.resolved_artifacts_dir / checkpoint.path, root, job.spec["model"])
        except FileNotFoundError:  # removed by the job's checkpoint retention in the meantime
            members = None
    if not members:
        if job.status in LIVE_STATUSES and step >= job.step:
            message = f"job {job.id} is {job.status} at step {job.step}: it has no checkpoint at step {step} yet"
            raise ApiError(409, "conflict", message, param=param)
        message = f"job {job.id} has no checkpoint at step {step}{_kept(session, job)}"
        raise ApiError(404, "checkpoint_not_found", message, param=param)
    session.close()  # the files are open: the stream needs no connection
    headers = {
        "Content-Disposition": f'attachment; filename="{root}.tar"',
        "Content-Length": str(archive_size(members)),
    }
    return StreamingResponse(stream(members), media_type="application/x-tar", headers=headers)


def _kept(session: Session, job: Job) -> str:
    steps = [str(row.step) for row in crud.list_checkpoints(session, job_id=job.id)]
    return f"; its kept checkpoints: steps {', '.join(steps)}" if steps else ""


def model_members(checkpoint: Path, root: str, base_model: str) -> list[Member]:
    """The files of a checkpoint's model, opened, named under ``root/`` as the archive holds them: ``policy/``'s
    at the top, the LoRA adapters' in ``adapter/``, their ``adapter_config.json`` naming ``base_model`` (the job's
    ``model`` as its spec gives it) instead of the path the worker loaded it from. Empty when the checkpoint has no
    saved model. Links are never followed; raises FileNotFoundError when the checkpoint is removed while its files
    are opened."""
    named = [(f"{root}/{name}", path) for name, path in regular_files(checkpoint / POLICY_DIR)]
    if not any(name == f"{root}/config.json" for name, _ in named):
        return []
    named += [(f"{root}/{ADAPTER_DIR}/{name}", path) for name, path in regular_files(checkpoint / ADAPTERS_DIR)]
    members: list[Member] = []
    try:
        for name, path in named:
            if name == f"{root}/{ADAPTER_DIR}/adapter_config.json":
                config = {**json.loads(path.read_text()), "base_model_name_or_path": base_model}
                members.append(Member.of_bytes(name, json.dumps(config, indent=2).encode(), int(path.stat().st_mtime)))
                continue
            members.append(Member.open(name, path))
    except BaseException:
        for member in members:
            member.file.close()
        raise
    return members
