"""What a job wrote to its experiment trackers, read back with each tool's own reader: TensorBoard's event
accumulator, an MLflow client on the store, and W&B's offline run files (records of W&B's own protobuf schema,
``wandb.proto.wandb_internal_pb2.Record``, in the LevelDB log framing W&B writes them in: this version of the
library ships no Python reader of them).

    require_trackers()                      # skips without the tracking extra, fails under CI=true
    tensorboard_series(out / "tensorboard") # {"loss/sft": [(1, 2.3), (2, 2.1), ...], ...}
"""

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.services import unavailable

Series = list[tuple[int, float]]
"""(step, value) in step order."""


def require_trackers() -> None:
    """Skip without the ``tracking`` extra (outside CI; under CI=true it must be there)."""
    try:
        import mlflow  # noqa: F401
        import tensorboard  # noqa: F401
        import wandb  # noqa: F401
    except ImportError as e:
        unavailable("the tracking extra (make install)", e)


def quiet_wandb(monkeypatch: Any, folder: Path) -> None:
    """W&B's own caches and settings under ``folder``, and no network (the tracker asks for offline anyway)."""
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(folder / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def recorded(metrics: dict[int, dict[str, float]], name: str) -> Series:
    """``name`` as a :class:`tests.recorder.Recorder` saw it."""
    return [(step, values[name]) for step, values in sorted(metrics.items()) if name in values]


def float32(series: Series) -> Series:
    """``series`` at TensorBoard's precision (its scalars are float32)."""
    return [(step, float(struct.unpack("f", struct.pack("f", value))[0])) for step, value in series]


# --- TensorBoard -----------------------------------------------------------------------------------


def tensorboard_series(folder: Path) -> dict[str, Series]:
    """Every scalar tag of the event files in ``folder``, as TensorBoard shows it (purged steps left out)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={SCALARS: 0})  # 0: keep every point
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()[SCALARS]}


# --- MLflow ----------------------------------------------------------------------------------------


def mlflow_store(out_dir: Path) -> str:
    """The tracking URI of the local store in a job folder."""
    return f"sqlite:///{out_dir / 'mlruns' / 'mlflow.db'}"


def mlflow_run_id(out_dir: Path) -> str:
    run_id: str = json.loads((out_dir / "tracking.json").read_text())["mlflow"]["run_id"]
    return run_id


def mlflow_series(tracking_uri: str, run_id: str, name: str) -> Series:
    from mlflow import MlflowClient

    history = MlflowClient(tracking_uri).get_metric_history(run_id, name)
    return sorted((m.step, m.value) for m in history)


# --- Weights & Biases ------------------------------------------------------------------------------

WANDB_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
"""A W&B run file's first 7 bytes: identifier, magic number, version."""
BLOCK_BYTES = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
"""LevelDB log record types: a record whole, or its first, middle and last fragments."""


def wandb_records(run_file: Path) -> Iterator[Any]:
    """The records of a ``run-<id>.wandb`` file, parsed as ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:7] == WANDB_HEADER, data[:7]
    offset, pending = 7, b""
    while offset + 7 <= len(data):
        if BLOCK_BYTES - offset % BLOCK_BYTES < 7:  # a block's tail too short for a header is padding
            offset += BLOCK_BYTES - offset % BLOCK_BYTES
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run_files(out_dir: Path) -> list[Path]:
    """The offline run files of a job folder, oldest first (a resumed run adds one per attempt)."""
    return sorted((out_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def wandb_history(run_files: list[Path]) -> dict[str, Series]:
    """Every logged key (W&B's own ``_step``, ``_runtime``, ``_timestamp`` left out), in step order."""
    series: dict[str, Series] = {}
    for run_file in run_files:
        for record in wandb_records(run_file):
            if record.WhichOneof("record_type") != "history":
                continue
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    series.setdefault(key, []).append((step, json.loads(item.value_json)))
    return {key: sorted(points) for key, points in series.items()}


def wandb_run(run_file: Path) -> Any:
    """The run record of a run file: its id, project, display name and config."""
    return next(r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run")
