"""Experiment tracking: a job's metrics also go to TensorBoard, MLflow and Weights & Biases, whichever are switched
on, and (the local ``rlhf train``) to a JSON-lines file.

The trackers' libraries are optional (``pip install 'rlhf-server[tracking]'``) and imported only when one is on.
They write from a thread of their own, so a slow or unreachable tracker never holds a step up; one that fails is
reported once, as a warning event through the job's callbacks, and written to no more. In a job folder:

    <out>/tensorboard/       TensorBoard event files: one scalar per metric (tag = metric name), step = step
    <out>/mlruns/mlflow.db   MLflow's store when no tracking URI is given (SQLite: MLflow's own local store)
    <out>/wandb/             W&B's run files (``offline-run-*``, for ``wandb sync``) and logs
    <out>/tracking.json      the ids of the job's MLflow and W&B runs, which a resumed job continues
    <out>/metrics.jsonl      (``rlhf train``) one ``{"step": N, "metrics": {...}}`` line per step

A job resumed from its checkpoint at step N continues its runs; the steps after N that an interrupted attempt
reported are computed again, so TensorBoard is told to hide them (``purge_step``) and metrics.jsonl drops them.
A job starting from step 0 starts new MLflow and W&B runs.
"""

import json
import math
import os
import queue
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

from engine.callbacks import Callbacks, StopRequest, VllmSettings
from engine.rewards.judge import Endpoint
from engine.spec.config import JobSpec, TrackingBackend

BACKENDS: tuple[TrackingBackend, ...] = get_args(TrackingBackend)
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
RUNS_FILE = "tracking.json"
CLOSE_TIMEOUT_S = 30.0
"""How long the end of a job waits for the trackers to write what is left and close their runs."""
PARAM_CHARS = 500
"""MLflow params are cut to this length (the limit of older MLflow servers)."""
MLFLOW_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED", "paused": "SCHEDULED"}
"""An MLflow run's status for how the job ended (MLflow has no "paused": a paused job is scheduled to go on)."""


class Forward(Callbacks):
    """Callbacks that pass every call on to ``inner``; subclasses add to the calls they override."""

    def __init__(self, inner: Callbacks) -> None:
        self.inner = inner

    def on_start(self, start_step: int, total_steps: int) -> None:
        self.inner.on_start(start_step, total_steps)

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.inner.on_metrics(step, metrics)

    def on_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        self.inner.on_samples(step, samples)

    def on_event(self, kind: str, message: str, data: dict[str, object] | None = None) -> None:
        self.inner.on_event(kind, message, data)

    def on_checkpoint(self, step: int, path: Path, metrics: dict[str, float]) -> None:
        self.inner.on_checkpoint(step, path, metrics)

    def should_stop(self) -> StopRequest | None:
        return self.inner.should_stop()

    def judge(self, model: str) -> Endpoint | None:
        return self.inner.judge(model)

    def vllm(self) -> VllmSettings | None:
        return self.inner.vllm()


class MetricsFile(Forward):
    """Appends each step's metrics to a JSON-lines file, ``{"step": N, "metrics": {name: value}}`` per line
    (a value that is not finite as null). A run starting at step N first drops the lines of later steps, which
    it computes again: a resumed run appends, and the file holds every step once."""

    def __init__(self, inner: Callbacks, path: Path) -> None:
        super().__init__(inner)
        self.path = path

    def on_start(self, start_step: int, total_steps: int) -> None:
        if self.path.exists():
            lines = self.path.read_text(encoding="utf-8").splitlines()
            kept = [line for line in lines if (step := _line_step(line)) is not None and step <= start_step]
            self.path.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        super().on_start(start_step, total_steps)

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        values = {name: value if math.isfinite(value) else None for name, value in metrics.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "metrics": values}) + "\n")
        super().on_metrics(step, metrics)


def _line_step(line: str) -> int | None:
    """The step of a metrics.jsonl line; None for a blank line or one a crash cut short."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class TrackingOptions:
    """Which trackers a job writes to, and where; the service fills it in from its settings, ``rlhf train`` from
    the spec alone."""

    backends: tuple[TrackingBackend, ...]
    """The trackers switched on."""
    run_name: str
    """The MLflow run's and the W&B run's name: the job's id on the service, the spec's name locally."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server or store; None: SQLite in the job folder (``<out>/mlruns/mlflow.db``)."""
    mlflow_experiment: str = "rlhf-server"
    """The MLflow experiment of the run, created when missing."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """W&B's mode: run files in ``<out>/wandb/`` for ``wandb sync``, or straight to the W&B server."""
    wandb_project: str = "rlhf-server"
    """The W&B project of the run."""


def quiet_environment(folder: Path, environment: Mapping[str, str]) -> dict[str, str]:
    """The environment variables, of those ``environment`` does not set already, that keep the trackers' libraries
    to the places a job configures: no usage telemetry (MLflow's, and any library honouring ``DO_NOT_TRACK``), no
    error reports (W&B's), and W&B's own cache, config and data folders (its service's logs, an artifact cache)
    under ``folder`` instead of the user's home.

    The libraries read them when they start, so the process that runs jobs sets them first, before any job: the
    train worker (``jobs/runner.py``) and ``rlhf train`` (``jobs/cli.py``); the engine itself reads no environment.
    A variable the operator sets keeps the operator's value.
    """
    wanted = {
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_CACHE_DIR": str(folder / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(folder / "wandb-config"),
        "WANDB_DATA_DIR": str(folder / "wandb-data"),
    }
    return {name: value for name, value in wanted.items() if name not in environment}


def switched_on(spec: JobSpec, server_wide: Iterable[str] = ()) -> tuple[TrackingBackend, ...]:
    """The trackers ``spec`` switches on, with those the server switches on for every job."""
    asked = {name for name in BACKENDS if spec.tracking is not None and getattr(spec.tracking, name)}
    return tuple(name for name in BACKENDS if name in asked or name in server_wide)


class Backend(Protocol):
    name: str
    where: str
    """What the run lives in (a tracking URI, a project): a stored run id is reused only in the same place."""
    run_id: str | None

    def start(self, start_step: int, resume_id: str | None) -> None: ...
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def finish(self, status: str) -> None: ...


class Tracker(Forward):
    """Passes everything on to ``inner`` and writes each step's metrics to the trackers of ``options``.

    The trackers start with the job (``on_start``) and write from a thread of their own; call :meth:`close` with
    the job's outcome when it ends, whichever way. Non-finite values are left out, as the service's history
    leaves them out.
    """

    def __init__(self, inner: Callbacks, spec: JobSpec, out_dir: Path, options: TrackingOptions) -> None:
        super().__init__(inner)
        self.runs_file = out_dir / RUNS_FILE
        self.backends: list[Backend] = [TRACKERS[name](spec, out_dir, options) for name in options.backends]
        self._messages: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._failures: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        """(tracker, message): failures the writer thread leaves for the job's thread to report."""
        self._busy = ""
        """The tracker the writer thread is calling now."""
        self._writer = threading.Thread(target=self._write, name="tracking", daemon=True)
        self._writer.start()

    def on_start(self, start_step: int, total_steps: int) -> None:
        self._messages.put(("start", start_step, None))
        super().on_start(start_step, total_steps)

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        finite = {name: float(value) for name, value in metrics.items() if math.isfinite(value)}
        self._messages.put(("log", step, finite))
        super().on_metrics(step, metrics)
        self._report_failures()

    def close(self, status: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """End the runs with the job's ``status`` (succeeded, failed, cancelled or paused), waiting up to
        ``timeout_s`` for the trackers to write what is left."""
        self._messages.put(("finish", status, None))
        self._writer.join(timeout_s)
        if self._writer.is_alive():
            self._failures.put((self._busy, f"still writing after {timeout_s:.0f} s; the job ends without waiting"))
        self._report_failures()

    def _report_failures(self) -> None:
        while not self._failures.empty():
            name, message = self._failures.get()
            self.inner.on_event("warning", f"tracking with {name}: {message}", {"tracker": name})

    # --- the writer thread ---------------------------------------------------------------------

    def _write(self) -> None:
        started = False
        while True:
            kind, value, metrics = self._messages.get()
            if kind == "finish" and not started:  # the job ended before training began: no run to end
                return
            started = started or kind == "start"
            for backend in list(self.backends):
                self._busy = backend.name
                try:
                    self._send(backend, kind, value, metrics)
                except Exception as e:  # the job goes on without this tracker
                    self.backends.remove(backend)
                    text = " ".join(f"{type(e).__name__}: {e}".split())[:300]
                    if isinstance(e, ImportError):
                        text = f"its library is not installed here ({text}): pip install 'rlhf-server[tracking]'"
                    self._failures.put((backend.name, f"{text}; no more metrics go to it"))
            if kind == "start":
                self._save_run_ids()
            if kind == "finish":
                return

    def _send(self, backend: Backend, kind: str, value: Any, metrics: Any) -> None:
        if kind == "start":
            backend.start(value, self._resume_id(backend, value))
        elif kind == "log":
            backend.log(value, metrics)
        else:
            backend.finish(value)

    def _resume_id(self, backend: Backend, start_step: int) -> str | None:
        """The run ``backend`` had in this job folder, to continue when the job resumes from a checkpoint."""
        if start_step == 0 or not self.runs_file.is_file():
            return None
        stored = json.loads(self.runs_file.read_text()).get(backend.name) or {}
        return stored.get("run_id") if stored.get("where") == backend.where else None

    def _save_run_ids(self) -> None:
        runs = {b.name: {"run_id": b.run_id, "where": b.where} for b in self.backends if b.run_id is not None}
        if runs:
            tmp = self.runs_file.with_name(f".{RUNS_FILE}.tmp")
            tmp.write_text(json.dumps(runs, indent=2))
            os.replace(tmp, self.runs_file)


# --- the trackers (each imports its library when it starts) ---------------------------------------


class TensorBoard:
    """Event files in ``<out>/tensorboard/``, written by PyTorch's ``SummaryWriter``."""

    name = "tensorboard"

    def __init__(self, spec: JobSpec, out_dir: Path, options: TrackingOptions) -> None:
        self.folder = out_dir / TENSORBOARD_DIR
        self.where = str(self.folder)
        self.run_id: str | None = None  # event files have no run to continue

    def start(self, start_step: int, resume_id: str | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard hides the events from this step on in earlier files: steps an interrupted attempt reported
        # after its last checkpoint, computed again now.
        self.writer = SummaryWriter(str(self.folder), purge_step=start_step + 1, flush_secs=10)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def finish(self, status: str) -> None:
        self.writer.close()


class MLflow:
    """One MLflow run per job: params are the spec's fields (``hyperparameters.learning_rate``), metrics are
    logged in one batch per step."""

    name = "mlflow"

    def __init__(self, spec: JobSpec, out_dir: Path, options: TrackingOptions) -> None:
        self.spec = spec
        self.options = options
        self.local = out_dir / MLFLOW_DIR
        self.where = options.mlflow_tracking_uri or f"sqlite:///{(self.local / 'mlflow.db').resolve()}"
        self.run_id: str | None = None

    def start(self, start_step: int, resume_id: str | None) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        if self.options.mlflow_tracking_uri is None:
            self.local.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(self.where)
        if resume_id is not None:
            self.client.update_run(resume_id, status="RUNNING")
            self.run_id = resume_id
            return
        run = self.client.create_run(self._experiment_id(), run_name=self.options.run_name)
        self.run_id = run.info.run_id
        params = [Param(mlflow_key(k), v) for k, v in flat_params(self.spec).items()]
        for i in range(0, len(params), 100):  # MLflow takes up to 100 params a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def _experiment_id(self) -> str:
        """The experiment's id, created when missing (in the local store, with its artifacts in the job folder)."""
        from mlflow.exceptions import MlflowException

        name = self.options.mlflow_experiment
        if (experiment := self.client.get_experiment_by_name(name)) is not None:
            return str(experiment.experiment_id)
        artifacts = None if self.options.mlflow_tracking_uri else (self.local / "artifacts").resolve().as_uri()
        try:
            return str(self.client.create_experiment(name, artifact_location=artifacts))
        except MlflowException:  # another job created it meanwhile
            if (experiment := self.client.get_experiment_by_name(name)) is None:
                raise
            return str(experiment.experiment_id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        assert self.run_id is not None
        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, now_ms, step) for k, v in metrics.items()])

    def finish(self, status: str) -> None:
        assert self.run_id is not None
        self.client.set_terminated(self.run_id, status=MLFLOW_STATUS[status])


class WandB:
    """One W&B run per job, its config the spec; offline, its run files go to ``<out>/wandb/``."""

    name = "wandb"

    def __init__(self, spec: JobSpec, out_dir: Path, options: TrackingOptions) -> None:
        self.spec = spec
        self.out_dir = out_dir
        self.options = options
        self.where = f"{options.wandb_mode}:{options.wandb_project}"
        self.run_id: str | None = None

    def start(self, start_step: int, resume_id: str | None) -> None:
        import wandb

        self.out_dir.mkdir(parents=True, exist_ok=True)
        # no console capture (the worker's log stays its own), no system metrics, no code or git state
        quiet = wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False, disable_git=True)
        self.run = wandb.init(
            dir=self.out_dir,
            project=self.options.wandb_project,
            name=self.options.run_name,
            id=resume_id,
            resume="allow" if resume_id else None,
            mode=self.options.wandb_mode,
            config=self.spec.model_dump(mode="json"),
            reinit="create_new",  # a run of its own, whatever else this process runs
            settings=quiet,
        )
        self.run_id = self.run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self, status: str) -> None:
        import wandb

        self.run.finish(exit_code=1 if status == "failed" else 0)
        wandb.teardown()  # its wandb-core service process ends with the job, not with the worker


def mlflow_key(name: str) -> str:
    """``name`` as MLflow takes it: characters other than letters, digits, ``_ - . /`` and spaces become ``_``."""
    return re.sub(r"[^\w./ -]", "_", name)


def flat_params(spec: JobSpec) -> dict[str, str]:
    """The spec as MLflow params: nested fields by dotted name (``hyperparameters.collapse.window``), values as
    JSON (strings as they are), cut to :data:`PARAM_CHARS`; ``metadata`` and ``tracking`` left out."""
    flat: dict[str, str] = {}

    def add(value: Any, name: str) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                add(item, f"{name}.{key}" if name else key)
        else:
            flat[name] = (value if isinstance(value, str) else json.dumps(value))[:PARAM_CHARS]

    add(spec.model_dump(mode="json", exclude={"metadata", "tracking"}), "")
    return flat


TRACKERS: dict[TrackingBackend, type[TensorBoard | MLflow | WandB]] = {
    "tensorboard": TensorBoard,
    "mlflow": MLflow,
    "wandb": WandB,
}
