"""Service references in a job spec — ``job:<id>[@<step>]`` and ``file-<id>`` — turned into what the engine
loads (folders and files under the artifacts folder). The API calls this to validate a spec before it is
queued; the worker calls it again to get the paths. Torch-free.

What a spec may name on the server:

- models: ``builtin:…``, ``job:<id>[@<step>]`` of the caller's project, a hub id (``name`` or ``org/name``,
  and nothing of that name in the server's working folder), or a folder inside ``Settings.model_root``
  (absolute, or relative to the root). A path with ``..`` or ``~``, one outside the root, one whose symlinks
  lead out of it, and any local path when no root is configured, are refused (``local_path_refused``).
- datasets: ``builtin:…`` and ``file-<id>`` of the caller's project only; the ``.jsonl`` paths the local
  ``rlhf train`` reads are refused: the server reads no file a client names.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from jobs.store import crud

_JOB_REF = re.compile(r"^job:([A-Za-z0-9_-]+)(?:@(\d+))?$")
_MAX_STEP = 2**31 - 1
_FILE_ID = re.compile(r"^file-[A-Za-z0-9_-]+$")
# Hugging Face hub ids: ``name`` or ``org/name`` of letters, digits, ``-``, ``_`` and ``.``, no ``..`` or ``--``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")

# Which job types may feed which spec field.
MODEL_SOURCES = {"sft": ("sft", "ppo"), "rm": ("sft", "ppo", "rm"), "ppo": ("sft", "ppo")}


@dataclass
class SpecReferenceError(ValueError):
    param: str
    """The spec field, e.g. ``model`` or ``hyperparameters.ptx_dataset``."""
    code: str
    """``job_not_found``, ``job_not_succeeded``, ``checkpoint_not_found``, ``wrong_job_type``,
    ``file_not_found``, ``wrong_file_purpose`` or ``local_path_refused``."""
    message: str

    def __str__(self) -> str:
        return f"{self.param}: {self.message}"


def job_dir(artifacts: Path, job_id: str) -> Path:
    return artifacts / "jobs" / job_id


def resolve_spec(session: Session, *, project_id: str, spec: dict[str, Any], artifacts: Path,
                 model_root: Path | None) -> dict[str, Any]:  # fmt: skip
    """A copy of ``spec`` with every service reference replaced by a path; raises SpecReferenceError."""
    resolved = {**spec, "hyperparameters": dict(spec.get("hyperparameters", {}))}
    job_type = spec["type"]
    resolved["model"] = _model(session, project_id, "model", spec["model"], MODEL_SOURCES[job_type], artifacts,
                               model_root)  # fmt: skip
    if spec.get("reward_model"):
        resolved["reward_model"] = _model(
            session, project_id, "reward_model", spec["reward_model"], ("rm",), artifacts, model_root
        )
    for field in ("dataset", "eval_dataset"):
        if spec.get(field):
            resolved[field] = _dataset(session, project_id, field, spec[field], job_type, artifacts)
    ptx = resolved["hyperparameters"].get("ptx_dataset")
    if ptx:
        resolved["hyperparameters"]["ptx_dataset"] = _dataset(
            session, project_id, "hyperparameters.ptx_dataset", ptx, "sft", artifacts
        )
    return resolved


def _model(
    session: Session, project_id: str, param: str, ref: str, sources: tuple[str, ...], artifacts: Path,
    model_root: Path | None,
) -> str:  # fmt: skip
    if ref.startswith("builtin:"):
        return ref
    match = _JOB_REF.match(ref)
    if match is None:
        if _is_hub_id(ref):
            return ref
        return _local_path(param, ref, model_root)
    job_id, step = match.group(1), match.group(2)
    job = crud.get_job(session, job_id=job_id, project_id=project_id)
    if job is None:
        raise SpecReferenceError(param, "job_not_found", f"no job {job_id!r} in this project")
    if job.type not in sources:
        raise SpecReferenceError(
            param, "wrong_job_type", f"job {job_id} is a {job.type} job; {param} needs one of {sources}"
        )
    if step is not None:
        checkpoint = crud.get_checkpoint(session, job_id=job_id, step=int(step)) if int(step) <= _MAX_STEP else None
        if checkpoint is None:
            raise SpecReferenceError(param, "checkpoint_not_found", f"job {job_id} has no checkpoint at step {step}")
        return str(artifacts / checkpoint.path)
    if job.status != "succeeded":
        raise SpecReferenceError(
            param, "job_not_succeeded", f"job {job_id} is {job.status}; name a succeeded job or one of its checkpoints"
        )
    return str(job_dir(artifacts, job_id))


def _is_hub_id(ref: str) -> bool:
    """A hub id, which transformers would not mistake for a folder of this machine: from_pretrained loads a
    local folder of that name first, so a hub-id-shaped name that exists here counts as a local path."""
    if not _HUB_ID.match(ref) or ".." in ref or "--" in ref:
        return False
    return not Path(ref).exists()


def _local_path(param: str, ref: str, model_root: Path | None) -> str:
    """A folder inside ``model_root``: resolved (symlinks followed), then checked to lie inside the root."""
    if model_root is None:
        raise SpecReferenceError(
            param, "local_path_refused", f"{ref!r} is a local path, and local model paths are disabled on this server"
        )
    if ref.startswith("~") or ".." in Path(ref).parts:
        raise SpecReferenceError(param, "local_path_refused", f"{ref!r}: '..' and '~' are not allowed in model paths")
    root = model_root.resolve()
    try:
        path = (root / ref).resolve()  # an absolute ref replaces the root here, and is checked like any other
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a NUL character
        raise SpecReferenceError(param, "local_path_refused", f"{ref!r} is not a usable path: {e}") from None
    if not path.is_relative_to(root):
        raise SpecReferenceError(param, "local_path_refused", f"{ref!r} is outside the model root")
    return str(path)  # whether a model is there is for the worker to find out (model_not_found)


def _dataset(session: Session, project_id: str, param: str, ref: str, kind: str, artifacts: Path) -> str:
    if ref.startswith("builtin:"):
        return ref
    if not _FILE_ID.match(ref):
        raise SpecReferenceError(
            param,
            "local_path_refused",
            f"{ref!r}: the server reads no local dataset files; upload it (POST /v1/files) and name its file- id",
        )
    file = crud.get_file(session, file_id=ref, project_id=project_id)
    if file is None:
        raise SpecReferenceError(param, "file_not_found", f"no file {ref!r} in this project")
    if file.purpose != kind:
        raise SpecReferenceError(
            param, "wrong_file_purpose", f"{ref} holds {file.purpose} rows; a {kind} file is needed"
        )
    return str(artifacts / file.path)
