"""Bring your own model through a real ``rlhf serve``: a Llama-architecture model from the server's model root
with chat data, trained SFT → RM → PPO with LoRA, answering ``/v1/chat/completions``."""

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from statistics import mean

import pytest
import torch

from engine.config import JobSpec
from engine.run import run_job
from jobs.client import Client, ClientError
from jobs.demo import embedded_server
from tests.models import build_model, chat_rows, write_jsonl
from tests.test_e2e import finished, free_port, wait_for

LORA = {"r": 8, "alpha": 16}
PPO_STEPS = 60
ROWS = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, Path]]:
    """``rlhf serve`` whose model root holds a tiny Llama at ``llama/``: pretrained (a full SFT on the chat
    data, standing in for the pretrained checkpoint a user brings), so that LoRA has something to adapt."""
    work = tmp_path_factory.mktemp("pretrain")
    data = write_jsonl(chat_rows("sft_messages", ROWS), work / "sft.jsonl")
    hyperparameters = {"max_steps": 150, "batch_size": 32, "learning_rate": 3e-3, "warmup_steps": 5}
    spec = {"type": "sft", "model": str(build_model("llama", work / "random")), "dataset": str(data),
            "hyperparameters": hyperparameters}  # fmt: skip
    assert run_job(JobSpec.model_validate(spec), work / "job", device=torch.device("cpu")).status == "succeeded"
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(work / "job" / "checkpoints" / "step-150" / "policy", root / "llama")
    before = os.environ.get("RLHF_MODEL_ROOT")
    os.environ["RLHF_MODEL_ROOT"] = str(root)
    try:
        with embedded_server(tmp_path_factory.mktemp("server"), free_port()) as client:
            yield client, root
    finally:
        if before is None:
            os.environ.pop("RLHF_MODEL_ROOT")
        else:
            os.environ["RLHF_MODEL_ROOT"] = before


def test_a_llama_with_chat_data_trains_sft_rm_ppo_with_lora_and_chats(
    server: tuple[Client, Path], tmp_path: Path
) -> None:
    c, _ = server
    files = {}
    for purpose, kind in (("sft", "sft_messages"), ("rm", "preference"), ("ppo", "prompts")):
        uploaded = c.upload_file(write_jsonl(chat_rows(kind, ROWS), tmp_path / f"{kind}.jsonl"), purpose)
        assert uploaded["chat"] is True
        files[purpose] = uploaded["id"]

    # a model without a chat template cannot take chat rows: refused at submit, naming the field
    with pytest.raises(ClientError) as refused:
        c.create_job({"type": "sft", "model": "builtin:tiny", "dataset": files["sft"]})
    assert refused.value.status == 422 and refused.value.code == "chat_template_missing"
    assert refused.value.param == "dataset"

    # "llama" is the folder under the model root, not a hub id
    sft = c.create_job({"type": "sft", "model": "llama", "dataset": files["sft"], "lora": LORA,
                        "hyperparameters": {"max_steps": 20, "batch_size": 16, "learning_rate": 3e-3}})  # fmt: skip
    assert wait_for(c, sft["id"], finished)["status"] == "succeeded"
    rm = c.create_job({"type": "rm", "model": f"job:{sft['id']}", "dataset": files["rm"], "lora": LORA,
                       "hyperparameters": {"max_steps": 40, "batch_size": 16, "learning_rate": 3e-3}})  # fmt: skip
    assert wait_for(c, rm["id"], finished)["status"] == "succeeded"
    ppo = c.create_job(
        {"type": "ppo", "model": f"job:{sft['id']}", "reward_model": f"job:{rm['id']}", "dataset": files["ppo"],
         "lora": LORA, "checkpoint_every": 10,
         "hyperparameters": {"total_steps": PPO_STEPS, "batch_size": 32, "mini_batch_size": 16, "response_length": 12,
                             "learning_rate": 1e-2, "kl_coef": 0.02, "temperature": 1.0, "missing_eos_penalty": 0.0}}
    )  # fmt: skip
    job = wait_for(c, ppo["id"], finished, timeout=600)
    assert job["status"] == "succeeded", job

    # the policy's reward-model score rises over the run
    history = c.request("GET", f"/v1/jobs/{ppo['id']}/metrics", params={"names": "objective/scores"})
    scores = [point["value"] for point in history["data"]["objective/scores"]]
    assert len(scores) == PPO_STEPS
    print(f"objective/scores: first 5 steps {mean(scores[:5]):.3f}, last 5 steps {mean(scores[-5:]):.3f}")
    assert mean(scores[-5:]) > mean(scores[:5]), scores

    chat = c.request("POST", "/v1/chat/completions", json={
        "model": f"job:{ppo['id']}", "max_tokens": 8, "seed": 1,
        "messages": [{"role": "user", "content": "Finish this review: the film was"}]})  # fmt: skip
    assert chat["object"] == "chat.completion" and isinstance(chat["choices"][0]["message"]["content"], str)
    assert chat["usage"]["completion_tokens"] >= 1
