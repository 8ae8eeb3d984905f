"""The one settings object of the service, read from ``RLHF_*`` environment variables by ``api/`` and ``jobs/``.

The engine never reads it: workers pass what it needs as arguments.
"""

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.rewards.judge import Endpoint
from engine.spec.config import TrackingBackend


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
    reward_urls: list[str] = []
    """The reward services an ``http`` grader may call: URL prefixes such as ``https://rewards.internal/``, or
    ``loopback`` (http or https to 127.0.0.0/8, ::1 or localhost, any port: every service of the workers' own
    machines); none by default. A spec naming another is refused at submit (``reward_not_allowed``), and a worker
    checks again before it runs a job."""
    reward_functions: list[str] = []
    """The ``module:function`` reward functions a ``python`` grader may name (importable on the workers); none by
    default. Others are refused at submit (``reward_not_allowed``). The local ``rlhf train`` allows any."""
    judges: dict[str, JudgeSetting] = {}
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
    tracking: list[TrackingBackend] = []
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
    device_memory: dict[str, ByteSize] = {}
    """The memory of one GPU of each train queue's workers, as JSON in ``RLHF_DEVICE_MEMORY``, e.g. ``{"train":
    "80GB", "train-h200": "141GB"}``: a job whose models cannot fit its queue's GPUs as its ``resources`` hold them
    is refused at submit (``model_does_not_fit``, with the bytes per rank and the setting that would fit). None
    declared: the API checks nothing, and a GPU worker checks against its own GPU before it loads the models."""
    max_attempts: int = 3
    """Runs of a job (the first plus retries after a lost worker) before it fails with ``worker_lost``."""
    node_address: str = "127.0.0.1"
    """This worker's address on the network its hosts share, for jobs across hosts (``resources.num_nodes``): the
    other hosts' ranks reach the claiming worker there, and torchrun's rendezvous and process group bind to it.
    The default takes jobs across hosts on this machine only."""
    vllm_python: str | None = None
    """The python of a separate environment with vLLM installed (``RLHF_VLLM_PYTHON``, e.g.
    ``/opt/vllm/bin/python``): a job with ``rollout_engine: vllm`` starts its own vLLM server with it, on loopback,
    for as long as it runs. vLLM pins its own torch and transformers, so it never shares the worker's environment."""
    vllm_url: str | None = None
    """Or a running vLLM server's base URL (``RLHF_VLLM_URL``) that the worker's jobs sample on, one job at a time:
    started with ``VLLM_SERVER_DEV_MODE=1`` (its weight reload), ``--enable-lora`` for LoRA jobs, the job's base
    model, and ``--logprobs-mode processed_logprobs``. Taken before ``vllm_python``."""
    vllm_start_timeout_seconds: float = Field(default=600, gt=0)
    """How long a job waits for the vLLM server it started to answer (``rollout_engine_failed`` after)."""
    join_timeout_seconds: float = Field(default=600, gt=0)
    """How long a job across hosts waits for its other hosts' train workers to join it before it fails
    (``hosts_unavailable``)."""
    session_timeout_seconds: int = Field(default=120, ge=1)
    """A training session of the Tinker-compatible API ends (its worker freed, its saved weights kept) once its
    client has sent no heartbeat for this long; the SDK sends one every 10 s."""
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
    cors_origins: list[str] = []
    """Browser origins allowed to call the API cross-origin (e.g. ``["https://dash.example.com"]``);
    empty: no CORS headers, so browsers refuse cross-origin calls."""
    url: str | None = None
    """Server URL for the ``rlhf`` client commands; default: the one ``rlhf serve`` wrote in ``data_dir``."""
    api_key: str | None = None
    """API key for the client commands; default: ``data_dir/api-key``."""
    visibility_timeout_seconds: int = 7 * 24 * 3600
    """Redis visibility timeout: longer than any job, so a running job is never redelivered."""

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


@lru_cache
def get_settings() -> Settings:
    return Settings()
