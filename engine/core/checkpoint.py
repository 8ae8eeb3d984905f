"""Checkpoints: ``<out>/checkpoints/step-N/`` with ``policy/`` (and ``value/`` for PPO) in Hugging Face
format and ``trainer_state.pt`` (optimizer, scheduler, RNG, controllers, step).

A crash (a killed worker, a lost machine) never leaves a half-written or half-deleted ``step-N``:

- a checkpoint is written to a hidden temporary folder ``.step-N-*``, flushed to disk, and renamed to
  ``step-N`` (atomic), ``trainer_state.pt`` being its last file;
- a checkpoint is deleted (retention, or replaced by a re-run of its step) by renaming it to a hidden
  ``.trash-step-N-*`` first, then removing that;
- hidden folders a crash left behind are removed by the next :func:`save_checkpoint` (or
  :func:`remove_stale_temporaries`), and :func:`list_checkpoints` never lists them.

A job folder also holds ``spec.json`` (the spec of the run, written when it starts afresh) and, once it
succeeds, ``job.json``; :func:`check_same_spec` refuses to continue a run under another spec.
"""

import contextlib
import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.core.models import save_model
from engine.spec.config import JobSpec, upgraded_spec

_STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.pt"
JOB_FILE = "job.json"
SPEC_FILE = "spec.json"
UNTRAINED_FIELDS = (("name",), ("metadata",), ("resources", "queue"), ("tracking",))
"""Spec fields that do not change what is trained: a run may resume under other values of them."""
TEMP_PREFIX = ".step-"
"""A checkpoint being written: ``.step-N-<random>``."""
TRASH_PREFIX = ".trash-"
"""A checkpoint being deleted: ``.trash-step-N-<random>``."""


def checkpoints_dir(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, path), oldest first: ``step-N`` folders holding their trainer state
    (never the hidden folders of a checkpoint being written or deleted)."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()
    ]
    return sorted(found)


def latest_checkpoint(out_dir: Path) -> tuple[int, Path] | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def remove_stale_temporaries(out_dir: Path) -> list[str]:
    """Delete what a crash left in the checkpoints folder: half-written ``.step-N-*`` and half-deleted
    ``.trash-*`` folders. Only the job's owner calls this (one writer per job folder). Returns their names."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    stale = sorted(p for p in root.iterdir() if p.name.startswith((TEMP_PREFIX, TRASH_PREFIX)))
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return [p.name for p in stale]


def delete_checkpoint(path: Path) -> None:
    """Remove a checkpoint folder: renamed out of sight first (atomic), so a crash midway leaves a hidden
    ``.trash-*`` folder, never a partial ``step-N``."""
    trash = Path(tempfile.mkdtemp(prefix=f"{TRASH_PREFIX}{path.name}-", dir=path.parent))
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, trash / path.name)  # into the fresh empty folder: a rename, whatever the name
    shutil.rmtree(trash, ignore_errors=True)


def new_checkpoint_dir(out_dir: Path, step: int) -> Path:
    """The hidden temporary folder ``step-N`` is written in (what a crash of an earlier run left is removed)."""
    root = checkpoints_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir)
    return Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{step}-", dir=root))


def save_checkpoint(
    out_dir: Path,
    step: int,
    models: dict[str, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    state: dict[str, Any],
    keep: int,
    tmp: Path | None = None,
    model_states: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write ``step-N`` atomically, then delete all but the newest ``keep`` checkpoints. ``tmp``: its folder from
    :func:`new_checkpoint_dir`, when other ranks wrote into it first (a sharded optimizer); ``model_states``: the
    models' whole state dicts by name, for sharded models."""
    root = checkpoints_dir(out_dir)
    final = root / f"step-{step}"
    tmp = tmp or new_checkpoint_dir(out_dir, step)
    try:
        for name, model in models.items():
            save_model(model, tokenizer, tmp / name, (model_states or {}).get(name))
        torch.save({**state, "step": step, "rng": rng_state()}, tmp / STATE_FILE)  # last: marks it complete
        _sync_tree(tmp)  # on disk before it is named, so a lost machine cannot leave a renamed empty file
        if final.exists():  # a re-run of the same step (e.g. a redelivered job): replace it
            delete_checkpoint(final)
        os.replace(tmp, final)
        _sync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in list_checkpoints(out_dir)[:-keep]:
        delete_checkpoint(old)
    return final


def _sync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then the folders themselves."""
    for dirpath, _, filenames in os.walk(folder):
        for filename in filenames:
            fd = os.open(os.path.join(dirpath, filename), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(Path(dirpath))


def _sync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory handles (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint; also restores the RNG states it captured."""
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)
    set_rng_state(state["rng"])
    return state


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_job_file(out_dir: Path, record: dict[str, Any]) -> None:
    """``<out>/job.json``: status and final step, so the folder can be named as a model later."""
    _write_json(out_dir, JOB_FILE, record)


def write_spec_file(out_dir: Path, spec: JobSpec) -> None:
    """``<out>/spec.json``: the spec a run started with, for :func:`check_same_spec` to compare."""
    _write_json(out_dir, SPEC_FILE, spec.model_dump(mode="json"))


def _write_json(out_dir: Path, name: str, record: dict[str, Any]) -> None:
    """Write ``<out>/<name>`` atomically: a temporary file renamed over it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{name}.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, out_dir / name)


class SpecMismatchError(ValueError):
    """A job folder holds a run of another spec; continuing it would train something that neither spec
    describes (another model's weights, a schedule recomputed midway)."""

    def __init__(self, out_dir: Path, differences: list[str]) -> None:
        self.differences = differences
        super().__init__(
            f"{out_dir} holds a run of a different spec: {', '.join(differences)}; "
            "use another --out folder, or --restart to delete its checkpoints and start over"
        )


def stored_spec(out_dir: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The spec of the run in ``out_dir`` (``spec.json``, else the ``spec`` of ``job.json``), in JSON form with
    the defaults of this version filled in and its values upgraded (:func:`engine.spec.config.upgraded_spec`), and what
    the upgrade changed; None when the folder has neither (a folder of an older version)."""
    for name, key in ((SPEC_FILE, None), (JOB_FILE, "spec")):
        path = out_dir / name
        if path.is_file():
            record = json.loads(path.read_text())
            data = record.get(key) if key else record
            if isinstance(data, dict):
                data, changes = upgraded_spec(data)
                try:  # a field added since has its default, not a difference
                    return JobSpec.model_validate(data).model_dump(mode="json"), changes
                except ValidationError:  # a field since removed or narrowed: compare as written
                    return data, changes
    return None, []


def spec_differences(old: Any, new: Any, path: tuple[str, ...] = ()) -> list[str]:
    """``dotted.path old → new`` for each field that differs, in the spec's order; objects compared key by key
    (lists whole), fields of :data:`UNTRAINED_FIELDS` left out."""
    if path in UNTRAINED_FIELDS:
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [*old, *(key for key in new if key not in old)]
        return [difference for key in keys for difference in spec_differences(old.get(key), new.get(key), (*path, key))]
    return [] if old == new else [f"{'.'.join(path)} {old!r} → {new!r}"]


def check_same_spec(out_dir: Path, spec: JobSpec) -> list[str]:
    """Raise :class:`SpecMismatchError` when ``out_dir`` holds a run (checkpoints or a ``job.json``) whose
    stored spec differs from ``spec`` in a field that changes what is trained. A folder with nothing to resume,
    or without a stored spec (written by an older version), passes. Returns what upgrading the stored spec to
    this version changed (the run resumes as upgraded)."""
    if latest_checkpoint(out_dir) is None and not (out_dir / JOB_FILE).is_file():
        return []
    old, changes = stored_spec(out_dir)
    if old is None:
        return []
    differences = spec_differences(old, spec.model_dump(mode="json"))
    if differences:
        raise SpecMismatchError(out_dir, differences)
    return changes


def delete_run(out_dir: Path) -> int:
    """Delete the run in ``out_dir`` so that the next one starts afresh: its checkpoints, ``job.json`` and
    ``spec.json``, nothing else of the folder. Returns how many checkpoints were deleted.

    Checkpoints go first, newest last, so a crash midway leaves a folder that still names its spec.
    """
    found = list_checkpoints(out_dir)
    for _, path in found:
        delete_checkpoint(path)
    shutil.rmtree(checkpoints_dir(out_dir), ignore_errors=True)  # and what a crash left there
    for name in (JOB_FILE, SPEC_FILE):
        (out_dir / name).unlink(missing_ok=True)
    return len(found)
