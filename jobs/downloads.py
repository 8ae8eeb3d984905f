"""Hub models downloaded before a job loads them, in a child process the worker can stop.

``from_pretrained("org/name")`` downloads inside the worker's own process, where nothing can interrupt it: a hub
that accepts the connection and then sends nothing would hold the worker (and every job queued behind it) for as
long as the hub client waits, and a cancel would wait with it. So a worker that may download (``RLHF_HUB_DOWNLOADS``)
fetches each hub id of a spec first, with ``python -m jobs.downloads ID`` into the Hugging Face cache, and watches
that process once a second:

- a cancel or pause of the job, or the worker shutting down, kills it (:class:`DownloadStopped`);
- so does a download that adds no byte to the cache for ``hub_stall_seconds``, or that takes longer than
  ``hub_download_seconds`` in all (:class:`HubDownloadError`, the job's ``hub_download_failed``);
- a hub that says the model does not exist (or is gated) fails the job as ``model_not_found``.

The engine then loads the downloaded snapshot folder, and never asks the hub itself.

Only what ``from_pretrained`` reads is fetched (:func:`model_files`): the files at the top of the repository,
with one weight format (safetensors when there are any, else PyTorch ``.bin``), and no ``original/`` or ``onnx/``
copies. Torch-free.
"""

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import constants, snapshot_download

from engine.callbacks import StopRequest
from engine.spec.model_refs import ModelNotFoundError

NOT_FOUND_EXIT = 3
"""The child's exit status when the hub says the model does not exist or may not be read."""
_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")
"""Configs, tokenizer files and chat templates (``.py`` files are never run: ``trust_remote_code=False``)."""


class HubDownloadError(RuntimeError):
    """The hub did not deliver a model in time, or the download failed on the way."""


class DownloadStopped(Exception):
    """The job was asked to stop (``request``) while a model downloaded."""

    def __init__(self, request: StopRequest) -> None:
        super().__init__(request)
        self.request: StopRequest = request


def model_files(names: list[str]) -> list[str]:
    """Of a repository's files, those ``from_pretrained`` reads for a model and its tokenizer."""
    top = [name for name in names if "/" not in name]
    weights = [name for name in top if name.endswith(".safetensors")]
    if not weights:
        weights = [name for name in top if name.endswith(".bin") and name != "training_args.bin"]
    index = {"model.safetensors.index.json", "pytorch_model.bin.index.json"}
    other = [name for name in top if name.endswith(_SUFFIXES) and name not in index]
    wanted_index = "model.safetensors.index.json" if any(n.endswith(".safetensors") for n in weights) else None
    indexes = [name for name in top if name == wanted_index or (wanted_index is None and name in index)]
    return sorted({*other, *weights, *indexes})


def cache_bytes(ref: str) -> int:
    """Bytes this machine's Hugging Face cache holds for hub model ``ref``, partial downloads included."""
    folder = Path(constants.HF_HUB_CACHE) / f"models--{ref.replace('/', '--')}"
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder.is_dir() else 0


def cached_snapshot(ref: str) -> str | None:
    """The snapshot folder of hub model ``ref`` in this machine's Hugging Face cache, if it is there."""
    try:
        return snapshot_download(ref, local_files_only=True)
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), or not a valid id
        return None


def download(
    ref: str,
    *,
    stall_s: float,
    timeout_s: float,
    check: Callable[[], StopRequest | None],
    poll_s: float = 1.0,
) -> str:
    """Download hub model ``ref`` into the Hugging Face cache in a child process; returns its snapshot folder.

    ``check`` is called every ``poll_s`` seconds: a stop request it returns kills the child and raises
    :class:`DownloadStopped`. Raises :class:`HubDownloadError` after ``stall_s`` seconds without a new byte in the
    cache or ``timeout_s`` in all, and :class:`ModelNotFoundError` when the hub has no such model."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        command = [sys.executable, "-m", "jobs.downloads", ref]
        child = subprocess.Popen(command, stdout=out, stderr=err, env=_child_env())
        try:
            _watch(child, ref, stall_s=stall_s, timeout_s=timeout_s, check=check, poll_s=poll_s)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        out.seek(0)
        err.seek(0)
        lines = [line for line in err.read().splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {child.returncode}"
        if child.returncode == NOT_FOUND_EXIT:
            raise ModelNotFoundError(reason)
        if child.returncode != 0:
            raise HubDownloadError(f"downloading {ref!r} from the Hugging Face hub failed: {reason}")
        return out.read().strip().splitlines()[-1]


def _watch(
    child: subprocess.Popen[bytes],
    ref: str,
    *,
    stall_s: float,
    timeout_s: float,
    check: Callable[[], StopRequest | None],
    poll_s: float,
) -> None:
    """Wait for ``child`` to exit, raising when the job is stopped or the download stalls or runs out of time."""
    start = progress_at = time.monotonic()
    size = cache_bytes(ref)
    while child.poll() is None:
        request = check()
        if request is not None:
            raise DownloadStopped(request)
        now, fetched = time.monotonic(), cache_bytes(ref)
        if fetched != size:
            size, progress_at = fetched, now
        if now - progress_at > stall_s:
            raise HubDownloadError(
                f"downloading {ref!r}: the Hugging Face hub ({constants.ENDPOINT}) sent nothing for {stall_s:g} s"
            )
        if now - start > timeout_s:
            raise HubDownloadError(f"downloading {ref!r} took longer than {timeout_s:g} s")
        time.sleep(poll_s)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # the bars would fill the error file the last line is read from
    env["HF_HUB_CACHE"] = constants.HF_HUB_CACHE  # this process's cache, also when set after import
    env["HF_ENDPOINT"] = constants.ENDPOINT
    env["HF_HUB_OFFLINE"] = "1" if constants.HF_HUB_OFFLINE else "0"
    return env


def main(ref: str) -> int:
    """The child: download ``ref``'s model files, print the snapshot folder; exit 3 if the hub has no such model."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi().model_info(ref)
        files = model_files([sibling.rfilename for sibling in info.siblings or []])
        folder = snapshot_download(ref, allow_patterns=files)  # main, as from_pretrained: refs/main names it
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as e:
        why = "it is gated" if isinstance(e, GatedRepoError) else "it does not exist or is private"
        sys.stderr.write(f"the Hugging Face hub has no model {ref!r} to download ({why}): {str(e).splitlines()[0]}\n")
        return NOT_FOUND_EXIT
    sys.stdout.write(folder + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
