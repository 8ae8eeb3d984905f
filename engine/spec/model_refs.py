"""Model references turned into folders, and what a saved tokenizer holds: torch-free, so the API checks a
spec against the models it names without loading them.
"""

import json
from pathlib import Path


class ModelNotFoundError(ValueError):
    """A model reference names nothing loadable."""


def resolve_model_ref(ref: str) -> str:
    """Turn a job folder or checkpoint folder into the model directory inside it.

    ``DIR`` (a finished job's output) → its final checkpoint's ``policy/``;
    ``DIR/checkpoints/step-N`` → its ``policy/``; anything else is returned unchanged.
    """
    path = Path(ref)
    if ref.startswith("builtin:") or not path.exists():
        return ref
    if (path / "policy" / "config.json").exists():
        return str(path / "policy")
    job_file = path / "job.json"
    if job_file.exists():
        job = json.loads(job_file.read_text())
        if job.get("status") != "succeeded":
            raise ModelNotFoundError(f"{ref}: the job has not succeeded (status {job.get('status')!r})")
        return str(path / "checkpoints" / f"step-{job['final_step']}" / "policy")
    if (path / "checkpoints").is_dir():
        raise ModelNotFoundError(f"{ref}: the job has not finished; name one of its checkpoints instead")
    return ref


def chat_template_saved(folder: Path) -> bool | None:
    """Whether the tokenizer saved in ``folder`` has a chat template; None when no tokenizer is saved there."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError):
        return None


def context_saved(folder: Path) -> int | None:
    """How many positions the model saved in ``folder`` attends to, when its ``config.json`` says."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for name in ("max_position_embeddings", "n_positions"):
        if isinstance(config.get(name), int):
            return int(config[name])
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer.tiktoken")
"""Files that hold a tokenizer's vocabulary: ``tokenizer.json`` (a fast tokenizer, what ``save_pretrained``
writes), or the vocabulary of a slow one beside its ``tokenizer_config.json`` (SentencePiece ``tokenizer.model`` or
``spiece.model``, BPE ``vocab.json`` with ``merges.txt``, WordPiece ``vocab.txt``, tiktoken)."""


def tokenizer_saved(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer's vocabulary (one of :data:`TOKENIZER_FILES`)."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def model_type_saved(folder: Path) -> str | None:
    """The ``model_type`` of the config saved in ``folder`` (``llama``, ``granite``...), when it says."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None
