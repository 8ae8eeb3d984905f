"""The one settings object of the service, read from ``RLHF_*`` environment variables by ``api/`` and ``jobs/``.

The engine never reads it: workers pass what it needs as arguments.
"""

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from pydantic_settings import SettingsError as SourceError

from engine.callbacks import VllmSettings
from engine.rewards.judge import Endpoint
from engine.spec.config import TrackingBackend
from engine.spec.tinker_proto import DEFAULT_BUDGET, Bound, ElementBudget


class JudgeSetting(BaseModel):
    """One judge of model graders: where it answers, and how it is asked."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1)
    """The OpenAI-compatible API's base URL (``/chat/completions`` is appended)."""
    model: str | None = None
    """The model name sent to it (None: the name graders use)."""
    api_key_env: str | None = None
    """The environment variable of the workers (and the API, for ``graders/run``) holding its key."""
    timeout_s: float = Field(default=60.0, gt=0, le=600)
    """Seconds one request may take."""
    retries: int = Field(default=2, ge=0, le=10)
    """Attempts after the first, on connection errors, timeouts, 429 and 5xx."""
    concurrency: int = Field(default=8, ge=1, le=256)
    """Requests in flight at once."""

    def endpoint(self, name: str) -> Endpoint:
        """The engine's endpoint of this judge, its key read from the environment now."""
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return Endpoint(url=self.url, model=self.model or name, api_key=key, timeout_s=self.timeout_s,
                        retries=self.retries, concurrency=self.concurrency)  # fmt: skip


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLHF_", use_attribute_docstrings=True, extra="ignore")

    environment: Literal["development", "production"] = "development"
    """``production`` refuses the embedded defaults (SQLite database and broker)."""
    data_dir: Path = Path("rlhf-data")
    """Folder of the embedded defaults: database, broker, artifacts and the API key file."""
    database_url: str | None = None
    """SQLAlchemy URL, e.g. ``postgresql+psycopg://user@host/db``; default: SQLite in ``data_dir``."""
    broker_url: str | None = None
    """Celery broker, e.g. ``redis://host:6379/0``; default: a SQLite-backed broker in ``data_dir``."""
    result_backend_url: str | None = None
    """Celery result backend, used only by generate requests; default: the Redis broker, or SQLite."""
    artifacts_dir: Path | None = None
    """Checkpoints and uploaded files (a shared volume when workers run on several machines); default
    ``data_dir/artifacts``."""
    model_root: Path | None = None
    """Local model folders a job spec may name (paths under this root); None: local paths are refused."""
    hub_downloads: bool = False
    """Let workers download hub ids (``org/name``) from the Hugging Face hub: only where they have a network.
    Off: workers run with ``HF_HUB_OFFLINE=1``, and a job naming a hub id is accepted only when the model is in
    the Hugging Face cache the API sees (``HF_HOME``, to be shared with the workers), else refused at submit."""
    hub_stall_seconds: float = 60
    """A worker gives up downloading a hub model that adds no byte for this long (``hub_download_failed``)."""
    hub_download_seconds: float = 2 * 3600
    """A worker gives up downloading a hub model that takes longer than this in all (``hub_download_failed``)."""
    max_processes: int = Field(default=8, ge=1)
    """The most processes one job may train in (``resources.num_processes``), at most the GPUs of the largest
    train worker: a spec asking for more is refused at submit (``too_many_processes``)."""
    reward_urls: Annotated[list[str], NoDecode] = []
    """The reward services an ``http`` grader may call: URL prefixes such as ``https://rewards.internal/``, or
    ``loopback`` (http or https to 127.0.0.0/8, ::1 or localhost, any port: every service of the workers' own
    machines); none by default. A spec naming another is refused at submit (``reward_not_allowed``), and a worker
    checks again before it runs a job."""
    reward_functions: Annotated[list[str], NoDecode] = []
    """The ``module:function`` reward functions a ``python`` grader may name (importable on the workers); none by
    default. Others are refused at submit (``reward_not_allowed``). The local ``rlhf train`` allows any."""
    judges: Annotated[dict[str, JudgeSetting], NoDecode] = {}
    """The judges ``score_model`` and ``label_model`` graders may name in ``model``, each an OpenAI-compatible
    chat endpoint (this server's own ``/v1``, serving a checkpoint, is one): as JSON in ``RLHF_JUDGES``, e.g.
    ``{"judge-small": {"url": "http://127.0.0.1:8000/v1", "model": "job:job_0123@40", "api_key_env":
    "RLHF_JUDGE_KEY"}}``. A grader naming another is refused at submit (``reward_not_allowed``)."""
    source_graders: bool = True
    """Whether ``python`` graders may give ``source`` (OpenAI's ``grade(sample, item)``), run in a sandbox: a process
    per batch without network or files, under CPU, memory and time limits. Off (``RLHF_SOURCE_GRADERS=false``):
    refused at submit."""
    grader_run_seconds: float = Field(default=60, gt=0, le=3600)
    """The wall-clock budget of one ``graders/run`` request, all its graders together: past it the request is
    answered 400 (``grader_run_timeout``) and its grading stops (a source grader's sandbox killed, a judge or a
    reward service no longer waited for). Grading stops as well when the client leaves."""
    grader_runs_per_project: int = Field(default=4, ge=1)
    """The ``graders/run`` requests one project may have grading at once: one more is refused (429,
    ``too_many_grader_runs``). A request stopped by its budget or by its client's leaving counts until its grading
    has stopped."""
    tracking: Annotated[list[TrackingBackend], NoDecode] = []
    """Experiment trackers every job's metrics go to, as if each spec switched them on (``tracking``), e.g.
    ``["tensorboard", "mlflow"]``: ``tensorboard``, ``mlflow``, ``wandb``. The workers need the ``tracking`` extra
    (``pip install 'rlhf-server[tracking]'``); a tracker they cannot use is a warning event, not a failed job."""
    mlflow_tracking_uri: str | None = None
    """The MLflow tracking server (``http://mlflow:5000``) or store (``sqlite:////shared/mlflow.db``) jobs log to;
    None: each job logs to a local store in its own folder, ``<artifacts>/jobs/<id>/mlruns/mlflow.db``."""
    mlflow_experiment: str = "rlhf-server"
    """The MLflow experiment the jobs' runs go to (created when missing); one run per job, named by its id."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline``: W&B run files in the job's folder (``<artifacts>/jobs/<id>/wandb/``; ``wandb sync`` uploads
    them later); ``online``: straight to W&B, with the workers logged in (``WANDB_API_KEY``, ``WANDB_BASE_URL``)."""
    wandb_project: str = "rlhf-server"
    """The W&B project of the jobs' runs; one run per job, named by its id."""
    lease_seconds: int = 120
    """How long a training worker's claim on a job lasts without a heartbeat."""
    device_memory: Annotated[dict[str, Annotated[ByteSize, Field(gt=0)]], NoDecode] = {}
    """The memory of one GPU of each train queue's workers, as JSON in ``RLHF_DEVICE_MEMORY``, e.g. ``{"train":
    "80GB", "train-h200": "141GB"}``: a job whose models cannot fit its queue's GPUs as its ``resources`` hold them
    is refused at submit (``model_does_not_fit``, with the bytes per rank and the setting that would fit). None
    declared: the API checks nothing, and a GPU worker checks against its own GPU before it loads the models. A
    size of zero or less is refused when the settings are read."""
    max_attempts: int = 3
    """Runs of a job (the first plus retries after a lost worker) before it fails with ``worker_lost``."""
    node_address: str = "127.0.0.1"
    """This worker's address on the network its hosts share, for jobs across hosts (``resources.num_nodes``): the
    other hosts' workers and ranks reach the claiming worker's channel there (jobs/channel.py).
    The default takes jobs across hosts on this machine only."""
    vllm_python: str | None = None
    """The python of a separate environment with vLLM installed (``RLHF_VLLM_PYTHON``, e.g.
    ``/opt/vllm/bin/python``): a job with ``rollout_engine: vllm`` starts its own vLLM server with it, on a Unix
    socket only this user reaches, with a key of its own, for as long as it runs. vLLM pins its own torch and
    transformers, so it never shares the worker's environment."""
    vllm_url: str | None = None
    """Or a running vLLM server's base URL (``RLHF_VLLM_URL``) that the worker's jobs sample on, one job at a time:
    started with ``VLLM_SERVER_DEV_MODE=1`` (its weight reload), ``--enable-lora`` and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` for LoRA jobs, the job's base model, and ``--logprobs-mode
    processed_logprobs``, on an address only the worker reaches. Taken before ``vllm_python``; never a reward
    service (``own_urls``)."""
    vllm_start_timeout_seconds: float = Field(default=600, gt=0)
    """How long a job waits for the vLLM server it started to answer (``rollout_engine_failed`` after)."""
    join_timeout_seconds: float = Field(default=60, gt=0)
    """How long a job across hosts waits for its other hosts' train workers to join it before it fails
    (``hosts_unavailable``). An idle worker of the queue takes an invitation within seconds; while the job waits,
    nothing of it runs, and the workers that joined are let go the moment it gives up."""
    session_timeout_seconds: int = Field(default=120, ge=1)
    """A training session of the Tinker-compatible API ends (its worker freed, its saved weights kept) once its
    client has sent no heartbeat for this long; the SDK sends one every 10 s. It ends ``cancelled`` with error code
    ``session_abandoned`` (a clean close by the client ends ``succeeded``)."""
    session_idle_seconds: int = Field(default=600, ge=0)
    """A session whose client sent no request for this long (a forgotten notebook, still beating) ends and frees its
    train worker, after saving each of its models' state as ``tinker://<model>/weights/ended-<step>``: the error code
    ``session_idle``. 0: never."""
    session_max_seconds: int = Field(default=0, ge=0)
    """The longest a session may hold a train worker, from when a worker first took it; past it the session ends as
    an idle one does (its models' state saved), with error code ``session_expired``. 0: no limit."""
    max_sessions_per_project: int = Field(default=8, ge=1)
    """The most training sessions a project may have unfinished (waiting, queued or running): another
    ``create_session`` is refused (429, ``too_many_sessions``) until one ends. Each running session holds a train
    worker."""
    session_max_sample_tokens: int = Field(default=262144, ge=1)
    """The most tokens one Tinker sample request may make its worker decode: ``num_samples`` × ``max_tokens`` (a
    request without ``max_tokens`` counts up to the model's context). A request past it fails before it runs
    (400 at submit when ``max_tokens`` is given, else a ``user`` error), naming this bound."""
    session_max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """The largest forward/forward_backward body of a training session once decompressed (its zstd is read with
    this bound, so a small body never inflates past it): more is refused (413, ``request_too_large``). Bodies are
    kept compressed until the worker runs them."""
    session_max_datum_elements: int = Field(default=DEFAULT_BUDGET.datum, ge=1)
    """The most elements one datum of a forward/forward_backward may carry once dense: its tokens and every
    ``loss_fn_inputs`` tensor, a sparse one counted by its shape (what the worker would allocate). More: 413."""
    session_max_request_elements: int = Field(default=DEFAULT_BUDGET.request, ge=1)
    """The same over all the datums of one request. The API checks both before it stores a request, the worker
    again before it decodes one."""
    session_max_pending_requests: int = Field(default=256, ge=1)
    """The most requests of one training session waiting for its worker: a new one past it is refused (429,
    ``too_many_pending_requests``), which the SDK retries until earlier ones have run."""
    resend_seconds: int = Field(default=600, ge=1)
    """A queued job no worker has claimed this long after its message went to the broker is sent again, once per
    this many seconds (a message the broker lost; a duplicate is a no-op, the claim being guarded). A job whose
    message never went out (the API stopped between the commit and the send) is sent at the next sweep."""
    max_pending_jobs: int = Field(default=1000, ge=1)
    """The most queued and waiting jobs a project may have: a submit past it is refused (429,
    ``too_many_pending_jobs``) until some of them start or end."""
    inference_cache_size: int = 2
    """Checkpoints an inference worker keeps loaded (least recently used are evicted)."""
    min_free_bytes: int = 256 * 1024 * 1024
    """``/readyz`` answers not ready (``storage``) when the artifacts folder's disk has fewer free bytes."""
    max_upload_bytes: int = 200 * 1024 * 1024
    """Largest accepted dataset file."""
    max_line_bytes: int = 1024 * 1024
    """Longest accepted line of an uploaded dataset, in bytes (its line ending not counted)."""
    max_request_bytes: int = 1024 * 1024
    """Largest accepted request body other than a file upload (a job spec, a generate request)."""
    allow_remote: bool = False
    """Let ``rlhf api`` / ``rlhf serve`` listen on an address other than loopback (as ``--allow-remote``).
    Every request needs an API key either way; this is an explicit opt-in to being reachable."""
    cors_origins: Annotated[list[str], NoDecode] = []
    """Browser origins allowed to call the API cross-origin (e.g. ``["https://dash.example.com"]``);
    empty: no CORS headers, so browsers refuse cross-origin calls."""
    url: str | None = None
    """Server URL for the ``rlhf`` client commands; default: the one ``rlhf serve`` wrote in ``data_dir``."""
    api_key: str | None = None
    """API key for the client commands; default: ``data_dir/api-key``."""
    visibility_timeout_seconds: int = 7 * 24 * 3600
    """Redis visibility timeout: longer than any job, so a running job is never redelivered."""

    @field_validator("reward_urls", "reward_functions", "tracking", "cors_origins", mode="before")
    @classmethod
    def _list_variable(cls, value: Any) -> Any:
        """A list setting's variable: a JSON list (``["a", "b"]``), or a bare word or a comma list (``loopback``,
        ``tensorboard,mlflow``)."""
        if not isinstance(value, str):
            return value
        if value.strip().startswith("["):
            return _json(value, "a JSON list")
        return [item.strip() for item in value.split(",") if item.strip()]

    @field_validator("judges", "device_memory", mode="before")
    @classmethod
    def _dict_variable(cls, value: Any) -> Any:
        """A dict setting's variable: a JSON object."""
        return _json(value, "a JSON object") if isinstance(value, str) else value

    @property
    def session_budget(self) -> ElementBudget:
        """The dense elements a training session's forward/forward_backward may carry."""
        return ElementBudget(datum=self.session_max_datum_elements, request=self.session_max_request_elements)

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'rlhf.db').resolve()}"

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{(self.data_dir / 'broker.db').resolve()}"

    @property
    def resolved_result_backend(self) -> str:
        if self.result_backend_url:
            return self.result_backend_url
        if self.broker_url and self.broker_url.startswith(("redis://", "rediss://")):
            return self.broker_url
        return f"db+sqlite:///{(self.data_dir / 'results.db').resolve()}"

    @property
    def resolved_artifacts_dir(self) -> Path:
        return (self.artifacts_dir or self.data_dir / "artifacts").resolve()

    @property
    def own_urls(self) -> list[str]:
        """The service's own servers that a URL could name (the operator's vLLM server): never a reward service,
        whatever ``reward_urls`` allows. (A job's own vLLM server listens on a Unix socket: no URL reaches it.)"""
        return [self.vllm_url] if self.vllm_url else []

    def vllm(self) -> VllmSettings | None:
        """The vLLM a ``rollout_engine: vllm`` job samples on (``RLHF_VLLM_URL``, else ``RLHF_VLLM_PYTHON``), or None:
        what a train worker offers its jobs and ``rlhf train`` uses unless told another."""
        if self.vllm_url is None and self.vllm_python is None:
            return None
        return VllmSettings(python=self.vllm_python, url=self.vllm_url, start_timeout=self.vllm_start_timeout_seconds)

    def prepare_data_dir(self) -> None:
        """Create ``data_dir`` and the SQLite stores of the embedded defaults (database, broker, results) owner-only
        (0600, as uploads and the key file are), before anything opens them: they hold every project's specs,
        metrics and task messages. SQLite gives its -wal and -shm files the database file's mode.

        From here on this process (and those it starts: torchrun's, ``rlhf serve``'s) creates every file owner-only
        (umask 077: folders 0700, files 0600): job folders hold specs with grader URLs and their credentials,
        checkpoints and uploads. Every process of the service runs as the one user that owns the data."""
        os.umask(0o077)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for url in (self.resolved_database_url, self.resolved_broker_url, self.resolved_result_backend):
            scheme, _, path = url.partition(":///")
            if not scheme.endswith("sqlite") or not path:
                continue
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
            for store in (Path(path), Path(f"{path}-wal"), Path(f"{path}-shm")):
                if store.exists():
                    store.chmod(0o600)  # a store an earlier version created readable by all

    def check(self) -> None:
        """Refuse development defaults in production."""
        if self.environment == "production" and (self.database_url is None or self.broker_url is None):
            raise ValueError(
                "production needs RLHF_DATABASE_URL and RLHF_BROKER_URL; the SQLite defaults are for one machine"
            )


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not {what} ({e.msg} at character {e.pos})") from None


class InvalidSettings(Exception):
    """``RLHF_*`` variables that do not read as their settings: one line per variable, naming it."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def variable(field: str) -> str:
    """The environment variable of the setting ``field``."""
    return f"{Settings.model_config['env_prefix']}{field.upper()}"


def _problems(error: ValidationError) -> list[str]:
    """``RLHF_X: what is wrong`` for each variable with errors (the value itself left out: it may be a secret)."""
    by_variable: dict[str, list[str]] = {}
    for item in error.errors(include_input=False, include_url=False):
        field, *inside = item["loc"]
        where = " ".join(f"item {part}" if isinstance(part, int) else repr(part) for part in inside)
        message = item["msg"].removeprefix("Value error, ")
        by_variable.setdefault(variable(str(field)), []).append(f"{where}: {message}" if where else message)
    return [f"{name}: {'; '.join(messages)}" for name, messages in by_variable.items()]


def load_settings() -> Settings:
    """The settings from the environment, or :class:`InvalidSettings` naming every variable that does not read."""
    try:
        return Settings()
    except ValidationError as e:
        raise InvalidSettings(_problems(e)) from None
    except SourceError as e:  # pydantic-settings' own decoding, should a setting escape the validators above
        raise InvalidSettings([str(e)]) from None


SESSION_BOUNDS: dict[Bound, str] = {
    "body": "RLHF_SESSION_MAX_BODY_BYTES",
    "datum": "RLHF_SESSION_MAX_DATUM_ELEMENTS",
    "request": "RLHF_SESSION_MAX_REQUEST_ELEMENTS",
}
"""The setting behind each bound of a forward_backward body, named in the error of a body past it."""


@lru_cache
def get_settings() -> Settings:
    """The settings (read once per process); :class:`InvalidSettings` names the variables that do not read."""
    return load_settings()
