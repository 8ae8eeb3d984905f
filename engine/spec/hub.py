"""Hugging Face hub ids: which model references name a model on the hub, and how to load one without hanging.

With no network, ``from_pretrained("org/name")`` retries for about 50 s before it fails. :func:`hub_kwargs`
asks the hub once, with a short timeout, and when it cannot be reached (or ``HF_HUB_OFFLINE`` is set) tells
``from_pretrained`` to read the local cache only: a cached model then loads without a network call, and a
missing one fails at once, explained by :func:`explain_missing`::

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False, **hub_kwargs(path))
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False, **hub_kwargs(path, model=True))
    except OSError as e:
        raise ModelNotFoundError(explain_missing(ref, e)) from e

Torch-free, and reads no environment variable: ``HF_HUB_OFFLINE``, ``HF_ENDPOINT`` and the cache folder come
from ``huggingface_hub.constants``, which reads them when huggingface_hub is imported.
"""

import re
import time
from pathlib import Path

import httpx
from huggingface_hub import constants

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
"""``name`` or ``org/name`` of letters, digits, ``-``, ``_`` and ``.``; :func:`is_hub_id` also refuses ``..`` and
``--``."""
PROBE_TIMEOUT = 3.0
"""Seconds the one request to the hub may take before it counts as unreachable."""
PROBE_TTL = 60.0
"""Seconds a probe's answer is kept for this process."""

_answers: dict[str, tuple[float, bool]] = {}
"""endpoint → (time.monotonic() of the probe, reachable)."""


def is_hub_id(ref: str) -> bool:
    """A hub id that transformers would not mistake for a folder of this machine: ``from_pretrained`` loads a
    local folder of that name first, so a hub-id-shaped name that exists here counts as a local path."""
    if not HUB_ID.match(ref) or ".." in ref or "--" in ref:
        return False
    return not Path(ref).exists()


def probe(endpoint: str) -> bool:
    """Whether ``endpoint`` answers one request within :data:`PROBE_TIMEOUT` (any HTTP status counts)."""
    try:
        httpx.head(endpoint, timeout=PROBE_TIMEOUT)
    except httpx.HTTPError:
        return False
    return True


def hub_reachable() -> bool:
    """:func:`probe` of the hub endpoint, asked at most once per :data:`PROBE_TTL` seconds."""
    endpoint = constants.ENDPOINT
    now = time.monotonic()
    answer = _answers.get(endpoint)
    if answer is None or now - answer[0] > PROBE_TTL:
        answer = (now, probe(endpoint))
        _answers[endpoint] = answer
    return answer[1]


def hub_kwargs(ref: str, *, model: bool = False) -> dict[str, object]:
    """The keyword arguments ``from_pretrained(ref, ...)`` needs so that it never waits on a hub it cannot reach:
    ``{}`` for a local folder or ``builtin:`` model and when the hub answers, ``{"local_files_only": True}``
    with ``HF_HUB_OFFLINE`` set or when the hub does not answer.

    ``model``: for a model class (``AutoModelFor...``). Its from_pretrained looks for a PEFT adapter config with
    ``adapter_kwargs`` and not ``local_files_only`` (transformers 5.24, ``models/auto/auto_factory.py``), and that
    lookup alone would retry for ~30 s: ``adapter_kwargs`` say it too. Not for a tokenizer, which would keep
    ``adapter_kwargs`` in its saved config."""
    if not is_hub_id(ref) or (not constants.HF_HUB_OFFLINE and hub_reachable()):
        return {}
    if model:
        return {"local_files_only": True, "adapter_kwargs": {"local_files_only": True}}
    return {"local_files_only": True}


def explain_missing(ref: str, error: BaseException) -> str:
    """The message for ``error``, raised by ``from_pretrained(ref, **hub_kwargs(ref))``: for a hub id that could
    only be looked for in the cache, why, and what to do about it."""
    if not hub_kwargs(ref):
        return f"cannot load {ref!r}: {error}"
    if constants.HF_HUB_OFFLINE:
        why = "HF_HUB_OFFLINE is set"
    else:
        why = f"the Hugging Face hub ({constants.ENDPOINT}) cannot be reached from this machine"
    return (
        f"cannot load {ref!r}: {why} and the model is not in this machine's Hugging Face cache "
        f"({constants.HF_HUB_CACHE}); download it where there is a network, copy the cache here and set "
        "HF_HUB_OFFLINE=1, or name a local folder"
    )
