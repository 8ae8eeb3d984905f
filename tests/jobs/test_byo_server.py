"""Bring your own model through a real ``rlhf serve``: a Llama-architecture model from the server's model root
with chat data, trained SFT → RM → PPO with LoRA, answering ``/v1/chat/completions``; and fine-tuned through OpenAI's
fine-tuning API with the official ``openai`` client."""

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from statistics import mean
from typing import Any

import openai
import pytest
import torch

from engine.core.generate import generate
from engine.core.models import load_causal_lm, load_tokenizer
from engine.run import run_job
from engine.spec.config import JobSpec
from jobs.client import Client, ClientError
from jobs.demo import embedded_server
from tests.models import SYSTEM_PROMPT, build_model, chat_rows, openai_rows, write_jsonl
from tests.test_e2e import finished, free_port, wait_for

LORA = {"r": 8, "alpha": 16}
JUDGE = "llama-judge"
"""The judge the server offers to model graders (``RLHF_JUDGES``)."""
PPO_STEPS = 30
ROWS = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, Path]]:
    """``rlhf serve`` whose model root holds a tiny Llama at ``llama/``: pretrained (a full SFT on the chat
    data, standing in for the pretrained checkpoint a user brings), so that LoRA has something to adapt."""
    work = tmp_path_factory.mktemp("pretrain")
    data = write_jsonl(chat_rows("sft_messages", ROWS), work / "sft.jsonl")
    hyperparameters = {"max_steps": 50, "batch_size": 32, "learning_rate": 3e-3, "warmup_steps": 5}
    spec = {"type": "sft", "model": str(build_model("llama", work / "random")), "dataset": str(data),
            "hyperparameters": hyperparameters}  # fmt: skip
    assert run_job(JobSpec.model_validate(spec), work / "job", device=torch.device("cpu")).status == "succeeded"
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(work / "job" / "checkpoints" / "step-50" / "policy", root / "llama")
    # the operator offers a judge: a checkpoint this very server serves at /v1 (a short LoRA SFT of the llama)
    data_dir, port = tmp_path_factory.mktemp("server"), free_port()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RLHF_MODEL_ROOT", str(root))
        with embedded_server(data_dir, port) as client:
            file = client.upload_file(data, "sft")["id"]
            judge = client.create_job({"type": "sft", "model": "llama", "dataset": file, "lora": LORA,
                                       "hyperparameters": {"max_steps": 2, "batch_size": 8}})  # fmt: skip
            assert wait_for(client, judge["id"], finished)["status"] == "succeeded"
        key = client.http.headers["Authorization"].removeprefix("Bearer ")
        judges = {JUDGE: {"url": f"http://127.0.0.1:{port}/v1", "model": f"job:{judge['id']}",
                          "api_key_env": "RLHF_TEST_JUDGE_KEY", "timeout_s": 120}}  # fmt: skip
        env.setenv("RLHF_JUDGES", json.dumps(judges))
        env.setenv("RLHF_TEST_JUDGE_KEY", key)
        with embedded_server(data_dir, port) as client:
            yield client, root


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


def test_the_openai_sdk_fine_tunes_a_llama_three_ways_and_chats_with_it(
    server: tuple[Client, Path], tmp_path: Path
) -> None:
    """OpenAI's fine-tuning flow with the official client alone (upload → create → follow the events →
    checkpoints → chat with ``fine_tuned_model``), for the supervised, dpo and reinforcement (string_check grader)
    methods; the jobs are the native API's jobs too."""
    c, _ = server
    key = c.http.headers["Authorization"].removeprefix("Bearer ")
    oa = openai.OpenAI(api_key=key, base_url=f"{c.url}/v1", max_retries=0)
    # OpenAI's RFT grader kinds in one multi: a judge (this server's llama, RLHF_JUDGES), python source, string_check
    judge = {"type": "score_model", "name": "judge", "model": JUDGE, "range": [0, 10],
             "sampling_params": {"max_completions_tokens": 4, "temperature": 1.0, "seed": 1},
             "input": [{"role": "system", "content": "Rate how {{item.mood}} this review is, from 0 to 10."},
                       {"role": "user", "content": "{{sample.output_text}}"}]}  # fmt: skip
    words = "def grade(sample, item):\n    return min(len(sample['output_text'].split()) / 8, 1.0)\n"
    mood = {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.mood}}",
            "operation": "ilike"}  # fmt: skip
    grader = {"type": "multi", "name": "graded", "calculate_output": "mood + 0.05 * judge + 0.5 * words",
              "graders": {"judge": judge, "words": {"type": "python", "source": words}, "mood": mood}}  # fmt: skip
    methods: dict[str, tuple[int, dict[str, Any]]] = {
        "supervised": (32, {"supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 8,
                                                               "learning_rate_multiplier": 3}}}),
        "dpo": (32, {"dpo": {"hyperparameters": {"n_epochs": 1, "batch_size": 8, "beta": 0.1,
                                                 "learning_rate_multiplier": 100}}}),
        "reinforcement": (8, {"reinforcement": {"grader": grader, "hyperparameters": {
            "n_epochs": 1, "batch_size": 4, "compute_multiplier": 0.25, "learning_rate_multiplier": 10}}}),
    }  # fmt: skip
    created = {}
    for method, (rows, settings) in methods.items():
        path = write_jsonl(openai_rows(method, rows), tmp_path / f"{method}.jsonl")
        with path.open("rb") as f:
            file = oa.files.create(file=f, purpose="fine-tune")
        assert (file.purpose, file.status) == ("fine-tune", "processed")
        job = oa.fine_tuning.jobs.create(
            model="llama", training_file=file.id, method={"type": method, **settings}, suffix=method, seed=3
        )
        assert job.status == "queued" and job.method is not None and job.method.type == method
        created[method] = job.id

    for method, job_id in created.items():
        seen: list[str] = []  # event ids, newest first as the API pages them
        deadline = time.monotonic() + 300
        while (job := oa.fine_tuning.jobs.retrieve(job_id)).status not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, (method, job.status)
            seen += [e.id for e in oa.fine_tuning.jobs.list_events(job_id, limit=100) if e.id not in seen]
            time.sleep(0.5)
        events = list(oa.fine_tuning.jobs.list_events(job_id, limit=100))
        messages = [e.message for e in reversed(events)]
        assert job.status == "succeeded", (method, job.error, messages)
        assert messages[0] == "running" and messages[-1] == "succeeded", messages
        assert set(seen) <= {e.id for e in events} and any(m.startswith("checkpoint at step") for m in messages)
        assert job.fine_tuned_model == f"job:{job_id}" and job.finished_at is not None

        checkpoints = oa.fine_tuning.jobs.checkpoints.list(job_id).data
        assert checkpoints and checkpoints[0].fine_tuned_model_checkpoint.startswith(f"job:{job_id}@")
        for model in (job.fine_tuned_model, checkpoints[-1].fine_tuned_model_checkpoint):
            chat = oa.chat.completions.create(
                model=model, max_tokens=6, seed=1, messages=[{"role": "user", "content": "Write a positive review."}]
            )
            assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
            assert chat.usage is not None and chat.usage.completion_tokens >= 1

    native = {job["id"]: job for job in c.request("GET", "/v1/jobs", params={"limit": 100})["data"]}
    assert [native[job_id]["type"] for job_id in created.values()] == ["sft", "dpo", "grpo"]
    assert [native[job_id]["name"] for job_id in created.values()] == list(methods)
    # 8 prompts in batches of 4: two steps, each logging the multi and its components; the judge was asked
    names = ["reward/graded", "reward/mood", "reward/judge", "reward/judge/invalid", "reward/words",
             "reward/words/errors", "reward/judge_tokens"]  # fmt: skip
    rewards = c.request("GET", f"/v1/jobs/{created['reinforcement']}/metrics", params={"names": ",".join(names)})
    assert {name: len(rewards["data"][name]) for name in names} == dict.fromkeys(names, 2), rewards
    print({name: [round(point["value"], 3) for point in rewards["data"][name]] for name in names})
    # the tiny judge rarely answers with a number: those samples score 0, and the job says so once
    warnings = [e.message for e in oa.fine_tuning.jobs.list_events(created["reinforcement"], limit=100)
                if e.message.startswith("grader 'judge' scored 0")]  # fmt: skip
    assert len(warnings) == int(any(point["value"] > 0 for point in rewards["data"]["reward/judge/invalid"]))
    assert all(point["value"] > 0 for point in rewards["data"]["reward/judge_tokens"])
    assert all(point["value"] == 0 for point in rewards["data"]["reward/words/errors"])
    for point, words_point in zip(rewards["data"]["reward/graded"], rewards["data"]["reward/words"], strict=True):
        assert point["value"] >= 0.5 * words_point["value"] - 1e-6  # the other components are never negative


def test_rlhf_generate_chats_with_a_job_and_with_a_model_folder(server: tuple[Client, Path], tmp_path: Path) -> None:
    c, root = server
    dataset = c.upload_file(write_jsonl(chat_rows("sft_messages", 16), tmp_path / "sft.jsonl"), "sft")["id"]
    sft = c.create_job({"type": "sft", "model": "llama", "dataset": dataset,
                        "hyperparameters": {"max_steps": 2, "batch_size": 8}})  # fmt: skip
    assert wait_for(c, sft["id"], finished)["status"] == "succeeded"
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "the film was"}]
    sampling = ["--chat", "--system", SYSTEM_PROMPT, "--temperature", "0", "--max-new-tokens", "6"]
    key = c.http.headers["Authorization"].removeprefix("Bearer ")

    # the server's job: its chat template renders the turns, as /v1/chat/completions does
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "generate", sft["id"], "the film was", *sampling, "--url", c.url,
         "--api-key", key],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    chat = c.request("POST", "/v1/chat/completions", json={
        "model": f"job:{sft['id']}", "messages": messages, "max_tokens": 6, "temperature": 0})  # fmt: skip
    assert line["prompt"] == messages and line["text"] == chat["choices"][0]["message"]["content"]

    # a local folder, no server: the same rendering as a chat prompt row gets in training
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "generate", "--model", str(root / "llama"), "--prompt", "the film was",
         *sampling],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    tokenizer = load_tokenizer(str(root / "llama"))
    model = load_causal_lm(str(root / "llama"), tokenizer, seed=0)
    [expected] = generate(model, tokenizer, [messages], max_new_tokens=6, temperature=0)
    assert line["prompt"] == messages and line["text"] == expected.text
