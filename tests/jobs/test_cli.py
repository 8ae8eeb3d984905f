"""The service's ``rlhf`` command line (``jobs/cli.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_rlhf_train_offers_restart():
    """``rlhf train`` is the engine's command (``add_train_command``), with every option of it."""
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "train", "--help"], capture_output=True, text=True, timeout=120, check=True
    )
    assert "--restart" in proc.stdout
    assert "--out" in proc.stdout


VLLM_GRPO = {
    "type": "grpo",
    "model": "builtin:tiny",
    "dataset": "builtin:digits-prompts",
    "reward": {
        "type": "string_check",
        "name": "digit",
        "input": "{{ sample.output_text }}",
        "reference": "1",
        "operation": "like",
    },
    "hyperparameters": {
        "total_steps": 1,
        "batch_size": 2,
        "group_size": 2,
        "response_length": 4,
        "mini_batch_size": 4,
        "rollout_engine": "vllm",
    },
}


def rlhf_train(spec: Path, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``rlhf train SPEC --out OUT`` with the RLHF_VLLM_* variables of ``env`` alone."""
    kept = {name: value for name, value in os.environ.items() if not name.startswith("RLHF_VLLM")}
    command = [sys.executable, "-m", "jobs.cli", "train", str(spec), "--out", str(out)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env={**kept, **env})


def test_rlhf_train_reads_the_servers_vllm_settings_and_says_an_engine_error_in_one_line(tmp_path: Path) -> None:
    """``rlhf train`` takes the vLLM that ``RLHF_VLLM_PYTHON`` names, waits ``RLHF_VLLM_START_TIMEOUT_SECONDS`` for
    it (the settings the worker reads), says that it starts it, and a server that never answers (here a "python"
    that only sleeps) ends it with one line naming the cause, no traceback, and a non-zero exit."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(VLLM_GRPO))
    hung = tmp_path / "vllm" / "python"
    hung.parent.mkdir()
    hung.write_text("#!/bin/sh\nexec sleep 120\n")
    hung.chmod(0o755)
    env = {"RLHF_VLLM_PYTHON": str(hung), "RLHF_VLLM_START_TIMEOUT_SECONDS": "3"}
    proc = rlhf_train(spec, tmp_path / "job", env)
    assert proc.returncode == 1, proc.stderr
    assert "starting vLLM" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the vLLM server did not answer within 3 s"), proc.stderr
    # a missing environment: the setting the message names is the one the command read
    proc = rlhf_train(spec, tmp_path / "job2", {**env, "RLHF_VLLM_PYTHON": str(tmp_path / "none" / "python")})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: no python at {tmp_path / 'none' / 'python'} (RLHF_VLLM_PYTHON): the vLLM environment is not there"
    )
