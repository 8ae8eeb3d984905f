"""Checkpoints: ``<out>/checkpoints/step-N/`` with ``policy/`` (and ``value/`` for PPO) in Hugging Face
format and ``trainer_state.pt`` (optimizer, scheduler, RNG, controllers, step). Written to a temporary
folder and renamed, so a crash never leaves a half-written ``step-N``.
"""

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
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.models import save_model

_STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.pt"
JOB_FILE = "job.json"


def checkpoints_dir(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, path), oldest first."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(out_dir: Path) -> tuple[int, Path] | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def save_checkpoint(
    out_dir: Path,
    step: int,
    models: dict[str, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    state: dict[str, Any],
    keep: int,
) -> Path:
    """Write ``step-N`` atomically, then delete all but the newest ``keep`` checkpoints."""
    root = checkpoints_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step-{step}-", dir=root))
    try:
        for name, model in models.items():
            save_model(model, tokenizer, tmp / name)
        torch.save({**state, "step": step, "rng": rng_state()}, tmp / STATE_FILE)
        if final.exists():  # a re-run of the same step (e.g. a redelivered job): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


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
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{JOB_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, out_dir / JOB_FILE)
