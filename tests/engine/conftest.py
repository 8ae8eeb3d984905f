"""Shared fixtures for the engine's integration tests: deterministic algorithms, and a tiny SFT model plus
reward model trained once per session (PPO tests start from them). The helpers (spec builders, ``train``,
the recording callback) are in ``tests.engine.helpers`` and ``tests.recorder``.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.core.vllm import VllmServer
from engine.spec.config import JobSpec
from tests.engine.helpers import EVAL_DATASETS, RM_FIXTURE_STEPS, Pretrained, make_spec, train
from tests.vllm_server import tiny_server


@pytest.fixture
def deterministic() -> Iterator[None]:
    """Deterministic algorithms for tests that assert exact equality; restored afterwards."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Pretrained:
    """SFT (60 steps of 32, lr 3e-3) on the reviews task, then a reward model on top of it."""
    root = tmp_path_factory.mktemp("pretrained")
    sft_spec = make_spec(
        "sft",
        hyperparameters={"max_steps": 60, "batch_size": 32, "learning_rate": 3e-3, "warmup_steps": 5},
        eval_dataset=EVAL_DATASETS["sft"],
    )
    sft_result, sft_rec = train(sft_spec, root / "sft")
    assert sft_result.status == "succeeded"
    rm_spec = make_spec(
        "rm",
        model=root / "sft",
        hyperparameters={"max_steps": RM_FIXTURE_STEPS, "batch_size": 32, "learning_rate": 1e-3, "eval_every": 10},
        eval_dataset=EVAL_DATASETS["rm"],
    )
    rm_result, rm_rec = train(rm_spec, root / "rm")
    assert rm_result.status == "succeeded"
    return Pretrained(root / "sft", root / "rm", sft_rec.metrics, rm_rec.metrics)


@pytest.fixture(scope="session")
def sft_dir(pretrained: Pretrained) -> Path:
    return pretrained.sft


@pytest.fixture(scope="session")
def rm_dir(pretrained: Pretrained) -> Path:
    return pretrained.rm


@pytest.fixture(scope="session")
def digits_sft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after SFT on the digits task's careless demonstrations (about a third of answers right):
    GRPO and PPO with rule rewards start from it."""
    out = tmp_path_factory.mktemp("digits") / "sft"
    spec = JobSpec.model_validate(
        {
            "type": "sft",
            "model": "builtin:tiny",
            "dataset": "builtin:digits-sft",
            "hyperparameters": {"max_steps": 500, "batch_size": 32, "learning_rate": 3e-3, "warmup_steps": 10},
            "checkpoint_every": 1000,
        }
    )
    result, _ = train(spec, out)
    assert result.status == "succeeded"
    return out


@pytest.fixture(scope="session")
def tiny_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One vLLM server of ``builtin:tiny`` for the session's ``rollout_engine: vllm`` jobs on it (tests.vllm_server)."""
    server = tiny_server(tmp_path_factory.mktemp("vllm"))
    yield server
    server.close()
