"""Service references in a job spec — ``job:<id>[@<step>]`` and ``file-<id>`` — turned into what the engine
loads (folders and files under the artifacts folder). The API calls this to validate a spec before it is
queued; the worker calls it again to get the paths. Torch-free.

What a spec may name on the server:

- models: ``builtin:…``, ``job:<id>[@<step>]`` of the caller's project (and a training session's sampler weights
  by name: ``job:<session>@<name>``, ``tinker://<model>/sampler_weights/<name>``), a folder inside
  ``Settings.model_root`` (absolute, or relative to the root: a name that exists under the root is that folder),
  or a hub id (``name`` or ``org/name``, and nothing of that name under the root or in the server's working
  folder). A path with
  ``..`` or ``~``, one outside the root, one whose symlinks lead out of it, and any local path when no root is
  configured, are refused (``local_path_refused``). A hub id is accepted when ``Settings.hub_downloads`` lets
  the workers download it, or when it is in the Hugging Face cache this process sees (which the workers are to
  share); otherwise it is refused (``hub_model_unavailable``), since the workers run with ``HF_HUB_OFFLINE=1``.
- datasets: ``builtin:…`` and ``file-<id>`` of the caller's project only; the ``.jsonl`` paths the local
  ``rlhf train`` reads are refused: the server reads no file a client names.
"""

import contextlib
import difflib
import functools
import itertools
import json
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import try_to_load_from_cache
from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.builtin import DATASETS, TINY_CONFIG, TINY_MODEL, TOKENIZER_FILE
from engine.rewards.graders import check_allowed, item_references, missing_item, parse_grader, replace_models
from engine.spec.auto import auto_hyperparameters, model_width
from engine.spec.config import GENERATING_TYPES, JOB_TYPES, MODEL_FIELDS, vocabulary_mismatch
from engine.spec.hub import is_hub_id
from engine.spec.memory import Weights, builtin_weights, read_weights
from engine.spec.model_refs import (
    TOKENIZER_FILES,
    ModelNotFoundError,
    chat_template_saved,
    context_saved,
    model_type_saved,
    resolve_model_ref,
    tokenizer_saved,
)
from engine.spec.rows import dataset_kind, parse_line
from engine.spec.sequence_classification import SEQUENCE_CLASSIFICATION_TYPES
from jobs.store import crud
from jobs.store.models import LIVE_STATUSES, SESSION_TYPE, Job, SessionCheckpoint
from jobs.store.settings import Settings

_JOB_REF = re.compile(r"^job:([A-Za-z0-9_-]+)(?:@(\d+))?$")
_NAMED_SAVE = re.compile(r"^job:([A-Za-z0-9_-]+)@([A-Za-z0-9._-]*[A-Za-z._-][A-Za-z0-9._-]*)$")
"""``job:<session>@<name>``: a training session's sampler weights by the name it saved them under."""
_TINKER_SAVE = re.compile(r"^tinker://([^/]+)/sampler_weights/([A-Za-z0-9._-]+)$")
_MAX_STEP = 2**31 - 1
_FILE_ID = re.compile(r"^file-[A-Za-z0-9_-]+$")


def model_sources(job_type: str) -> tuple[str, ...]:
    """The job types whose output a ``job_type`` job may start from: any policy (a training session's sampler
    weights among them), and a reward model's own type (a reward model trained further)."""
    own = JOB_TYPES[job_type]
    return (*output_sources("policy"), *(output_sources(own.output) if own.output != "policy" else ()))


def output_sources(output: str) -> tuple[str, ...]:
    """The job types whose output is ``output`` (``policy`` or ``reward_model``): what a model field of
    :data:`MODEL_FIELDS` of that output may name. A training session's saved sampler weights are a policy."""
    types = tuple(name for name, info in JOB_TYPES.items() if info.output == output)
    return (*types, SESSION_TYPE) if output == "policy" else types


GENERATING_JOB_TYPES = (*GENERATING_TYPES, SESSION_TYPE)
"""The job types whose checkpoints generate text: those that train a policy, and training sessions (their saved
sampler weights)."""


def generates(job_type: str) -> bool:
    """Whether a job of ``job_type`` has checkpoints that generate text (:data:`GENERATING_JOB_TYPES`)."""
    return job_type in GENERATING_JOB_TYPES


def resolve_model(session: Session, *, project_id: str, ref: str, settings: Settings, param: str) -> str:
    """A model reference as a job spec's ``model`` names one (builtin, ``job:<id>[@<step>]``, a folder under the
    model root, a hub id), resolved to what the engine loads; :class:`SpecReferenceError` naming ``param``."""
    return _model(session, project_id, param, ref, output_sources("policy"), settings.resolved_artifacts_dir,
                  settings.model_root, settings.hub_downloads)  # fmt: skip


@dataclass
class SpecReferenceError(ValueError):
    param: str
    """The spec field, e.g. ``model`` or ``hyperparameters.ptx_dataset``."""
    code: str
    """``job_not_found``, ``job_not_succeeded``, ``checkpoint_not_found``, ``wrong_job_type``,
    ``file_not_found``, ``wrong_file_purpose``, ``local_path_refused``, ``hub_model_unavailable``,
    ``model_not_found`` (no such folder), ``tokenizer_missing``, ``no_classification_head``,
    ``chat_template_missing``, ``exceeds_context``, ``reward_not_allowed``, ``column_not_found`` or
    ``vocabulary_mismatch``."""
    message: str

    def __str__(self) -> str:
        return f"{self.param}: {self.message}"


def job_dir(artifacts: Path, job_id: str) -> Path:
    return artifacts / "jobs" / job_id


def resolve_spec(
    session: Session,
    *,
    project_id: str,
    spec: dict[str, Any],
    artifacts: Path,
    model_root: Path | None,
    hub_downloads: bool = False,
    reward_urls: Sequence[str] = (),
    reward_functions: Sequence[str] = (),
    judges: Collection[str] | None = None,
    source_graders: bool = True,
    own_urls: Sequence[str] = (),
    pending: list[str] | None = None,
) -> dict[str, Any]:
    """A copy of ``spec`` with every service reference replaced by a path; raises SpecReferenceError.
    ``model_root``, ``hub_downloads``, ``reward_urls``, ``reward_functions``, ``judges`` (the names) and
    ``source_graders`` are the settings of the same names, ``own_urls`` the settings' ``own_urls``. With a
    ``pending`` list, a ``job:<id>`` of a job that has not finished yet but may still succeed is accepted (a
    pipeline's earlier stage) and its id appended there; without, such a reference is refused."""
    resolved = {**spec, "hyperparameters": dict(spec.get("hyperparameters", {}))}
    job_type = spec["type"]
    resolved["model"] = _model(session, project_id, "model", spec["model"], model_sources(job_type), artifacts,
                               model_root, hub_downloads, pending)  # fmt: skip
    _check_model("model", resolved["model"], JOB_TYPES[job_type].output == "reward_model")

    def named_model(param: str, ref: str, output: str) -> str:
        path = _model(session, project_id, param, ref, output_sources(output), artifacts, model_root, hub_downloads,
                      pending)  # fmt: skip
        _check_model(param, path, scores=output == "reward_model")
        return path

    def reward_model(param: str, ref: str) -> str:
        return named_model(param, ref, "reward_model")

    for field, named in MODEL_FIELDS.items():
        if spec.get(field):
            resolved[field] = named_model(field, spec[field], named.output)
            if named.same_vocabulary and _same_vocabulary(resolved[field], resolved["model"]) is False:
                raise SpecReferenceError(field, "vocabulary_mismatch", vocabulary_mismatch(field))
    for field in ("reward", "eval_reward"):
        if spec.get(field):
            problems = check_allowed(
                parse_grader(spec[field]), reward_urls, reward_functions, judges, source_graders, own_urls
            )
            if problems:
                raise SpecReferenceError(field, "reward_not_allowed", "; ".join(problems))
            resolved[field] = replace_models(spec[field], reward_model, field)
    chat_fields: list[tuple[str, str]] = []  # (field, file) of the datasets holding chat rows
    for field in ("dataset", "eval_dataset"):
        if spec.get(field):
            kind = JOB_TYPES[job_type].dataset
            resolved[field], chat = _dataset(session, project_id, field, spec[field], kind, artifacts)
            chat_fields += [(field, spec[field])] if chat else []
            # the rows each reward reads: the training reward the dataset's, the eval reward (else the training
            # one) the eval dataset's
            grader = "reward" if field == "dataset" or not spec.get("eval_reward") else "eval_reward"
            if spec.get(grader):
                _check_columns(grader, spec[grader], spec[field], resolved[field], kind)
    ptx = resolved["hyperparameters"].get("ptx_dataset")
    if ptx:
        param = "hyperparameters.ptx_dataset"
        resolved["hyperparameters"]["ptx_dataset"], chat = _dataset(session, project_id, param, ptx, "sft", artifacts)
        chat_fields += [(param, ptx)] if chat else []
    if chat_fields and _has_chat_template(resolved["model"]) is False:
        # Chat rows need a model whose tokenizer has a chat template: refused here when that tokenizer is at hand
        # (built-in, a job's or a folder's, a cached hub model); otherwise the worker finds out.
        param, ref = chat_fields[0]
        raise SpecReferenceError(
            param,
            "chat_template_missing",
            f"{ref} holds chat messages, and the tokenizer of {spec['model']!r} has no chat template to render "
            "them with; upload plain-text rows, or train a model whose tokenizer has a chat template",
        )
    _check_context(spec, resolved["model"])
    return resolved


def auto_values(
    session: Session,
    *,
    project_id: str,
    spec: dict[str, Any],
    given: dict[str, Any],
    artifacts: Path,
    model_root: Path | None,
) -> dict[str, Any]:
    """The "auto" hyperparameters (engine/spec/auto.py) of a validated ``spec`` whose request gave ``given``: the epochs
    or steps from its dataset's rows, the learning rate from its model's width, each when it can be told here."""
    return auto_hyperparameters(
        spec["type"],
        given,
        rows=dataset_rows(session, project_id=project_id, ref=spec["dataset"]),
        width=model_width_of(
            session, project_id=project_id, ref=spec["model"], artifacts=artifacts, model_root=model_root
        ),
        lora=spec.get("lora") is not None,
    )


def dataset_rows(session: Session, *, project_id: str, ref: str) -> int | None:
    """The rows of a spec's dataset: a built-in one's, or an uploaded file's as counted at upload."""
    if ref.startswith("builtin:"):
        return _builtin_rows(ref.removeprefix("builtin:"))
    file = crud.get_file(session, file_id=ref, project_id=project_id) if _FILE_ID.match(ref) else None
    return file.rows if file is not None else None


@functools.cache
def _builtin_rows(name: str) -> int | None:
    return len(DATASETS[name][1]()) if name in DATASETS else None


_MAX_JOB_CHAIN = 32
"""How many ``job:`` links :func:`model_width_of` follows back to a model whose config is at hand."""


def model_width_of(
    session: Session, *, project_id: str, ref: str, artifacts: Path, model_root: Path | None, depth: int = 0
) -> int | None:
    """The hidden size of the model a spec's ``model`` names, read from its ``config.json`` without loading it: the
    built-in model's, a folder's, a cached hub model's, a job's saved model, or (a job not finished yet) the model
    that job starts from, since training keeps a model's width. None when it cannot be told here."""
    if ref.startswith("builtin:"):
        return model_width(TINY_CONFIG)
    try:
        resolved = _model(session, project_id, "model", ref, tuple(JOB_TYPES), artifacts, model_root, True, [])
    except SpecReferenceError:
        return None
    folder = model_folder(resolved)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8")) if folder else None
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict):
        return model_width(config)
    match = _JOB_REF.match(ref)
    job = crud.get_job(session, job_id=match.group(1), project_id=project_id) if match else None
    if job is None or depth >= _MAX_JOB_CHAIN:
        return None
    return model_width_of(
        session,
        project_id=project_id,
        ref=job.spec["model"],
        artifacts=artifacts,
        model_root=model_root,
        depth=depth + 1,
    )


def model_weights_of(
    session: Session, *, project_id: str, ref: str, artifacts: Path, model_root: Path | None
) -> Weights | None:
    """The :class:`engine.spec.memory.Weights` of the model ``ref`` names, read from its weight files' headers: the
    built-in model's, a folder's, a cached hub model's or a finished job's; None when they are not at hand here."""
    if ref.startswith("builtin:"):
        return builtin_weights()
    try:
        resolved = _model(session, project_id, "model", ref, tuple(JOB_TYPES), artifacts, model_root, True, [])
    except SpecReferenceError:
        return None
    folder = model_folder(resolved)
    return read_weights(folder) if folder is not None else None


def resolve_stored(session: Session, job: Job, settings: Settings) -> dict[str, Any]:
    """:func:`resolve_spec` of a stored job's spec, under ``settings`` (a worker's, to run or score with it)."""
    return resolve_spec(
        session,
        project_id=job.project_id,
        spec=job.spec,
        artifacts=settings.resolved_artifacts_dir,
        model_root=settings.model_root,
        hub_downloads=settings.hub_downloads,
        reward_urls=settings.reward_urls,
        reward_functions=settings.reward_functions,
        judges=settings.judges.keys(),
        source_graders=settings.source_graders,
        own_urls=settings.own_urls,
    )


def _check_context(spec: dict[str, Any], model: str) -> None:
    """Sequences longer than the resolved ``model``'s context, when its config is at hand: refused before a
    worker loads anything."""
    folder = model_folder(model)
    context = int(TINY_CONFIG["n_positions"]) if model == TINY_MODEL else context_saved(folder) if folder else None
    if context is None:
        return
    config = JOB_TYPES[spec["type"]].config.model_validate(spec.get("hyperparameters", {}))
    for param, (what, tokens) in config.token_lengths().items():
        if tokens > context:
            raise SpecReferenceError(
                param, "exceeds_context", f"{what} is {tokens} tokens; the model attends to {context} positions"
            )


def model_folder(model: str) -> Path | None:
    """The folder holding a resolved ``model``'s config and tokenizer, when it is at hand here: a job's or a local
    folder, or a hub model in this process's Hugging Face cache; None for builtin models and anything else."""
    if model.startswith("builtin:"):
        return None
    if is_hub_id(model):
        config = try_to_load_from_cache(model, "config.json")
        return Path(config).parent if isinstance(config, str) else None
    try:
        return Path(resolve_model_ref(model))
    except (ModelNotFoundError, OSError, ValueError):
        return None


def _check_model(param: str, model: str, scores: bool) -> None:
    """What the worker would fail on, told from the resolved ``model``'s saved files when they are at hand: a local
    model folder without a tokenizer, and (``scores``: a reward model, or a model to train one from) an
    architecture without a sequence-classification class in transformers."""
    folder = model_folder(model)
    if folder is None:
        return
    if not is_hub_id(model) and (folder / "config.json").is_file() and not tokenizer_saved(folder):
        raise SpecReferenceError(
            param,
            "tokenizer_missing",
            f"{folder.name!r} holds a model but no tokenizer: a model folder needs tokenizer.json, or "
            f"tokenizer_config.json with its vocabulary ({', '.join(TOKENIZER_FILES[1:])}); save the tokenizer "
            "there too (tokenizer.save_pretrained)",
        )
    model_type = model_type_saved(folder)
    if scores and model_type is not None and model_type not in SEQUENCE_CLASSIFICATION_TYPES:
        common = [name for name in COMMON_SCORING_TYPES if name in SEQUENCE_CLASSIFICATION_TYPES]
        raise SpecReferenceError(
            param,
            "no_classification_head",
            f"reward model: {model_type} has no sequence-classification head in transformers; architectures that "
            f"do: {', '.join(common)} and {len(SEQUENCE_CLASSIFICATION_TYPES) - len(common)} more",
        )


COMMON_SCORING_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3_text", "phi3", "gpt2")
"""The architectures a refused reward model's message names as examples of ones that can score."""


def _has_chat_template(model: str) -> bool | None:
    """Whether the resolved ``model``'s tokenizer has a chat template; None when it cannot be told here."""
    if model.startswith("builtin:"):
        return False  # the built-in tokenizer has none
    folder = model_folder(model)
    return chat_template_saved(folder) if folder else None


def _same_vocabulary(a: str, b: str) -> bool | None:
    """Whether the resolved models ``a`` and ``b`` have one vocabulary; None when either cannot be told here."""
    first, second = _vocabulary(a), _vocabulary(b)
    return None if first is None or second is None else first == second


def _vocabulary(model: str) -> dict[str, int] | None:
    """Token → id of the resolved ``model``'s saved fast tokenizer (``tokenizer.json``: its model's ``vocab`` and
    its ``added_tokens``, what transformers' ``get_vocab`` gives), when it is at hand here (built-in, a job's or a
    folder's, a cached hub model's); None otherwise, or for a file that does not read as one."""
    folder = model_folder(model)
    path = TOKENIZER_FILE if model == TINY_MODEL else folder / "tokenizer.json" if folder else None
    if path is None:
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        vocab = saved["model"]["vocab"]
        if isinstance(vocab, list):  # Unigram: [piece, score] pairs, the id their index
            vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
        return {**vocab, **{token["content"]: token["id"] for token in saved["added_tokens"]}}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _model(
    session: Session, project_id: str, param: str, ref: str, sources: tuple[str, ...], artifacts: Path,
    model_root: Path | None, hub_downloads: bool, pending: list[str] | None = None,
) -> str:  # fmt: skip
    if ref.startswith("builtin:"):
        return ref
    ref = sampler_save_ref(session, project_id=project_id, ref=ref, param=param) or ref
    match = _JOB_REF.match(ref)
    if match is None:
        # A name that exists under the model root is that folder, even one shaped like a hub id.
        if is_hub_id(ref) and not (model_root is not None and (model_root.resolve() / ref).exists()):
            return _hub_model(param, ref, hub_downloads, model_root)
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
        if pending is not None and job.status in LIVE_STATUSES:
            pending.append(job_id)  # the new job waits for it
            return str(job_dir(artifacts, job_id))
        may_wait = " (or an unfinished one, at submit)" if pending is None else ""
        raise SpecReferenceError(
            param, "job_not_succeeded",
            f"job {job_id} is {job.status}; name a succeeded job{may_wait} or one of its checkpoints",
        )  # fmt: skip
    return str(job_dir(artifacts, job_id))


def sampler_save_ref(session: Session, *, project_id: str, ref: str, param: str) -> str | None:
    """``job:<session>@<step>`` of a training session's sampler weights named as it saved them:
    ``tinker://<model>/sampler_weights/<name>`` or ``job:<session>@<name>`` (a name of digits only is a step); None
    for any other reference. :class:`SpecReferenceError` (``checkpoint_not_found``) when no such save exists, or
    when two models of the session saved that name (then the ``tinker://`` path tells them apart)."""
    tinker = _TINKER_SAVE.match(ref)
    named = _NAMED_SAVE.match(ref) if tinker is None else None
    if tinker is None and named is None:
        return None
    stmt = select(SessionCheckpoint).where(
        SessionCheckpoint.project_id == project_id, SessionCheckpoint.kind == "sampler_weights"
    )
    if tinker is not None:
        stmt = stmt.where(SessionCheckpoint.model_id == tinker.group(1), SessionCheckpoint.name == tinker.group(2))
    else:
        assert named is not None
        stmt = stmt.where(SessionCheckpoint.session_id == named.group(1), SessionCheckpoint.name == named.group(2))
    saves = [row for row in session.scalars(stmt) if row.step is not None]
    if not saves:
        raise SpecReferenceError(param, "checkpoint_not_found", f"no sampler weights saved as {ref!r} in this project")
    if len(saves) > 1:
        paths = ", ".join(sorted(f"tinker://{row.model_id}/sampler_weights/{row.name}" for row in saves))
        raise SpecReferenceError(
            param, "checkpoint_not_found", f"{ref!r} names saves of several models; name one of {paths}"
        )
    return f"job:{saves[0].session_id}@{saves[0].step}"


def dependencies(spec: dict[str, Any]) -> list[str]:
    """The ids of the jobs whose final model ``spec`` names (``job:<id>``, without a step): in ``model``,
    the fields of :data:`MODEL_FIELDS` (``reward_model``, ``teacher``) and the model graders of ``reward`` and
    ``eval_reward``."""
    refs = [spec.get("model"), *(spec.get(field) for field in MODEL_FIELDS)]

    def collect(param: str, ref: str) -> str:
        refs.append(ref)
        return ref

    for field in ("reward", "eval_reward"):
        if spec.get(field):
            replace_models(spec[field], collect, field)
    ids = [m.group(1) for ref in refs if ref and (m := _JOB_REF.match(ref)) and m.group(2) is None]
    return list(dict.fromkeys(ids))


def _hub_model(param: str, ref: str, hub_downloads: bool, model_root: Path | None = None) -> str:
    """A hub id the workers can load: they may download it, or it is in the Hugging Face cache (HF_HOME). Refused,
    the message first says that no folder of that name is under the model root (when there is one), and names the
    folders there nearest to it: a misspelt folder looks like a hub id."""
    if hub_downloads:
        return ref
    try:
        cached = try_to_load_from_cache(ref, "config.json")
    except ValueError:  # an id huggingface_hub refuses (HFValidationError): it cannot be in the cache either
        cached = None
    if isinstance(cached, str):
        return ref
    folder = f"no folder {ref!r} under the model root{_nearest(model_root, ref)}, and " if model_root else ""
    raise SpecReferenceError(
        param,
        "hub_model_unavailable",
        f"{folder}{ref!r} is a Hugging Face hub id that is not in this server's cache, and its workers do not download "
        "models (they run with HF_HUB_OFFLINE=1): put the model in the cache the workers share (HF_HOME) or in a "
        "folder under the model root (RLHF_MODEL_ROOT), or set RLHF_HUB_DOWNLOADS=true where the workers have a "
        "network",
    )


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
    if not path.exists():
        raise SpecReferenceError(
            param, "model_not_found", f"{ref!r}: no such folder under the model root{_nearest(model_root, ref)}"
        )
    return str(path)  # whether a model is in it is for the worker to find out (model_not_found)


def _folders(folder: Path, limit: int) -> list[str]:
    """The names of the folders in ``folder`` (hidden ones left out), of its first ``limit`` entries."""
    names = []
    with contextlib.suppress(OSError):
        for entry in itertools.islice(folder.iterdir(), limit):
            if not entry.name.startswith(".") and entry.is_dir():
                names.append(entry.name)
    return names


NEAREST_SCANNED = 2000
"""Entries of the model root (and of the folder a missing ``org/name`` names first) looked at for the folders nearest
a missing one."""


def _nearest(model_root: Path, ref: str) -> str:
    """`` (the nearest there: 'a', 'b')`` for the folders under ``model_root`` (for ``org/name``, also those in its
    ``org``) whose names are closest to the missing ``ref`` (difflib's ratio of at least 0.6, any case); empty when
    none is."""
    root = model_root.resolve()
    try:
        wanted = Path(ref).resolve().relative_to(root).as_posix() if Path(ref).is_absolute() else ref.strip("./")
    except (OSError, RuntimeError, ValueError):
        return ""
    names = _folders(root, NEAREST_SCANNED)
    head = wanted.split("/")[0]
    if "/" in wanted and head in names and (root / head).resolve().is_relative_to(root):
        names += [f"{head}/{name}" for name in _folders(root / head, NEAREST_SCANNED)]
    by_lower = {name.lower(): name for name in names}
    nearest = [by_lower[name] for name in difflib.get_close_matches(wanted.lower(), by_lower, n=3)]
    return f" (the nearest there: {', '.join(map(repr, nearest))})" if nearest else ""


def _check_columns(field: str, grader: dict[str, Any], ref: str, path: str, kind: str) -> None:
    """``column_not_found`` naming the template of the reward ``field`` whose ``{{ item.<column> }}`` a row of the
    dataset ``ref`` (at ``path``, of ``kind``) lacks: the job would fail on it at its first batch."""
    references = item_references(parse_grader(grader))
    if not references:
        return
    lacking = _rows_lacking(path, kind, tuple(keys for _, keys in references))
    for (where, keys), found in zip(references, lacking, strict=True):
        if found is not None:
            line, missing, columns = found
            raise SpecReferenceError(
                f"{field}.{where}",
                "column_not_found",
                f"{{{{ item.{'.'.join(keys)} }}}} names a column that line {line} of {ref} lacks: it has no {missing} "
                f"(its columns: {', '.join(columns)})",
            )


@functools.lru_cache(maxsize=256)
def _rows_lacking(
    path: str, kind: str, paths: tuple[tuple[str, ...], ...]
) -> tuple[tuple[int, str, tuple[str, ...]] | None, ...]:
    """For each of ``paths`` (an ``item.`` template's keys), the first row of the dataset at ``path`` lacking it, as
    (its line, the ``item.`` part missing, its columns), or None: every row has it. Read once per file (an uploaded
    file never changes); a file that does not read is the worker's to report."""
    found: list[tuple[int, str, tuple[str, ...]] | None] = [None] * len(paths)
    for line, row in _rows(path, kind):
        for i, keys in enumerate(paths):
            if found[i] is None and (missing := missing_item(row, keys)) is not None:
                found[i] = (line, missing, tuple(row))
        if all(found):
            break
    return tuple(found)


def _rows(path: str, kind: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line, row) of a dataset, as the engine reads it (engine.core.data.load_rows: lines split at LF only)."""
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        yield from enumerate(DATASETS[name][1]() if name in DATASETS else [], start=1)
        return
    try:
        with open(path, "rb") as f:
            for line, raw in enumerate(f, start=1):
                text = raw.decode("utf-8").removesuffix("\n").removesuffix("\r")
                if text.strip():
                    yield line, parse_line(text, kind, line)
    except (OSError, ValueError):  # gone, or not rows: the worker fails the job with the reason
        return


def _dataset(session: Session, project_id: str, param: str, ref: str, kind: str, artifacts: Path) -> tuple[str, bool]:
    """The dataset's path, and whether its rows are chat messages."""
    if ref.startswith("builtin:"):
        return ref, False
    if not _FILE_ID.match(ref):
        raise SpecReferenceError(
            param,
            "local_path_refused",
            f"{ref!r}: the server reads no local dataset files; upload it (POST /v1/files) and name its file- id",
        )
    file = crud.get_file(session, file_id=ref, project_id=project_id)
    if file is None:
        raise SpecReferenceError(param, "file_not_found", f"no file {ref!r} in this project")
    if file.kind != dataset_kind(kind):
        raise SpecReferenceError(
            param, "wrong_file_purpose", f"{ref} holds {file.kind} rows; a {dataset_kind(kind)} file is needed"
        )
    return str(artifacts / file.path), file.chat
