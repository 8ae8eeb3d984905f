"""The official ``tinker`` SDK (0.38) against a real ``rlhf serve``: a user's own loops on this server's workers.

One server for the module, with a tiny chat model (Qwen2 architecture, ChatML template) under its model root. Each
test opens its own ``ServiceClient`` (its own session job)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

tinker = pytest.importorskip("tinker", reason="the tinker SDK is in the dev extra")

from openai import OpenAI  # noqa: E402
from tinker import types  # noqa: E402

from jobs.client import KEY_FILE, Client  # noqa: E402
from jobs.demo import embedded_server  # noqa: E402
from tests.helpers import children_running, free_port  # noqa: E402
from tests.models import build_model  # noqa: E402

MODEL = "qwen2"
"""The name of the tiny chat model under the server's model root."""


class Served:
    def __init__(self, client: Client, data_dir: Path, model_root: Path) -> None:
        self.client, self.data_dir, self.model_root = client, data_dir, model_root
        self.url = client.url
        self.key = (data_dir / KEY_FILE).read_text().strip()

    def service(self) -> Any:
        return tinker.ServiceClient(base_url=self.url, api_key=f"tml-{self.key}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("models")
    build_model(MODEL, root / MODEL)
    data_dir = tmp_path_factory.mktemp("server")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RLHF_MODEL_ROOT", str(root))
        env.setenv("RLHF_LEASE_SECONDS", "6")
        env.setenv("TINKER_TELEMETRY", "0")
        with embedded_server(data_dir, free_port()) as client:
            yield Served(client, data_dir, root)


@pytest.fixture
def service(served: Served) -> Iterator[Any]:
    """A ServiceClient (its own session job), closed after the test whatever happens: a failed test's client would
    otherwise go on beating and hold the server's one train worker from the next test's session."""
    client = served.service()
    yield client
    client.close("errored", "the test ended").result()  # a no-op when the test closed it


def chat_datum(tokenizer: Any, prompt: str, answer: str) -> types.Datum:
    """A supervised datum: the rendered conversation, weights on the assistant's tokens only."""
    messages = [{"role": "user", "content": prompt}]
    context = render(tokenizer, messages, add_generation_prompt=True)
    tokens = render(tokenizer, [*messages, {"role": "assistant", "content": answer}])
    weights = [0.0] * (len(context) - 1) + [1.0] * (len(tokens) - len(context))
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def mean_loss(output: Any, data: list[types.Datum]) -> float:
    tokens = sum(sum(d.loss_fn_inputs["weights"].data) for d in data)
    return float(output.metrics["loss:sum"]) / tokens


def test_supervised_loop_loss_falls_and_the_weights_chat(served: Served, service: Any) -> None:
    training = service.create_lora_training_client(base_model=MODEL, rank=8).result()
    tokenizer = training.get_tokenizer()
    data = [chat_datum(tokenizer, f"Say {word}", f"{word} {word} {word}") for word in ("yes", "no", "maybe", "ok")]
    losses = []
    for _ in range(8):
        fwdbwd = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(mean_loss(fwdbwd.result(), data))
        optim.result()
    assert losses[-1] < 0.7 * losses[0], losses

    saved = training.save_weights_for_sampler("sft").result()
    assert saved.path.startswith("tinker://") and saved.path.endswith("/sampler_weights/sft")
    session_id = training.model_id.split(":")[0]
    job = served.client.get_job(session_id)
    assert job["type"] == "session" and job["status"] == "running"
    assert job["step"] == 8
    history = served.client.request("GET", f"/v1/jobs/{session_id}/metrics",
                                    params={"names": "train/loss_sum"})["data"]["train/loss_sum"]  # fmt: skip
    assert [point["step"] for point in history] == list(range(1, 9))
    [checkpoint] = served.client.request("GET", f"/v1/jobs/{session_id}/checkpoints")["data"]

    openai = OpenAI(base_url=f"{served.url}/v1", api_key=served.key)
    chat = openai.chat.completions.create(
        model=f"job:{session_id}@{checkpoint['step']}", messages=[{"role": "user", "content": "Say yes"}],
        max_tokens=6, temperature=0,
    )  # fmt: skip
    assert chat.choices[0].message.content is not None
    service.close("success").result()
    wait_until(lambda: served.client.get_job(session_id)["status"] == "succeeded")  # the train worker is free

    # the saved weights are a model for any later job, by their name too
    by_name = f"job:{session_id}@sft"
    named = openai.chat.completions.create(
        model=by_name, messages=[{"role": "user", "content": "Say yes"}], max_tokens=6, temperature=0
    )
    assert named.choices[0].message.content == chat.choices[0].message.content
    sft = served.client.create_job({"type": "sft", "model": saved.path,
                                    "dataset": "builtin:reviews-sft",
                                    "hyperparameters": {"max_steps": 2, "batch_size": 4}})  # fmt: skip
    wait_until(lambda: served.client.get_job(sft["id"])["status"] in ("succeeded", "failed"))
    assert served.client.get_job(sft["id"])["status"] == "succeeded", served.client.get_job(sft["id"])["error"]


def test_a_misspelt_base_model_ends_its_session_and_leaves_the_worker_free(served: Served, service: Any) -> None:
    """The refused ``base_model`` of a script's first training client ends its session at once (failed, the reason
    as its error) without holding the server's one train worker: a new client, named by its ``display_name``,
    trains at once."""
    with pytest.raises(tinker.BadRequestError, match="qwen3-misspelt"):
        service.create_lora_training_client(base_model="qwen3-misspelt", rank=4).result()
    listed = served.client.request("GET", "/v1/jobs", params={"type": "session"})["data"]
    [refused] = [job for job in listed if job["status"] == "failed" and "qwen3-misspelt" in str(job["error"])]
    named = tinker.ServiceClient(base_url=served.url, api_key=f"tml-{served.key}", display_name="nightly sweep")
    try:
        training = named.create_lora_training_client(base_model=MODEL, rank=4).result(timeout=60)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
        )
        assert training.forward_backward([datum], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
        job = served.client.get_job(training.model_id.split(":")[0])
        assert (job["name"], job["model"], job["status"]) == ("nightly sweep", MODEL, "running")
        assert job["id"] != refused["id"]
    finally:
        named.close("success").result()


def wait_until(condition: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def even_share(tokens: list[int]) -> float:
    """The rule reward of the RL test: the share of a response's tokens with even ids."""
    return sum(token % 2 == 0 for token in tokens) / max(len(tokens), 1)


def test_rl_loop_importance_sampling_raises_the_reward(service: Any) -> None:
    """The SDK's RL shape: sample groups from the current weights, group-centred advantages in the client, one
    importance_sampling forward_backward and an optim_step per round."""
    training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("count", "say", "go", "list")]
    rewards = []
    for round_ in range(8):
        params = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[], seed=round_)
        sampler = training.save_weights_and_get_sampling_client().result()
        futures = [sampler.sample(types.ModelInput.from_ints(p), 8, params) for p in prompts]
        data, total = [], []
        for prompt, future in zip(prompts, futures, strict=True):
            sequences = future.result().sequences
            scores = [even_share(s.tokens) for s in sequences]
            mean = sum(scores) / len(scores)
            total += scores
            for sequence, score in zip(sequences, scores, strict=True):
                tokens = prompt + sequence.tokens
                n = len(sequence.tokens)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * (len(prompt) - 1) + list(sequence.logprobs),
                        "advantages": [0.0] * (len(prompt) - 1) + [score - mean] * n,
                    },
                ))  # fmt: skip
        rewards.append(sum(total) / len(total))
        training.forward_backward(data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.15, rewards
    service.close("success").result()


def test_custom_loss_and_a_saved_state_that_continues_bit_exactly(served: Served, service: Any) -> None:
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    tokenizer = training.get_tokenizer()
    data = [chat_datum(tokenizer, f"Name {word}", word) for word in ("red", "blue")]

    def weighted_square(batch: list[types.Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        # a user loss the server does not know: the squared weighted negative log-likelihood per datum
        terms = [
            (-(lp * d.loss_fn_inputs["weights"].to_torch()).sum()) ** 2 for d, lp in zip(batch, logprobs, strict=True)
        ]
        loss = sum(terms) / len(terms)
        return loss, {"custom": float(loss.detach())}

    custom = []
    for _ in range(3):
        custom.append(training.forward_backward_custom(data, weighted_square).result().metrics["custom"])
        training.optim_step(types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)).result()
    assert custom[-1] < custom[0], custom

    state = training.save_state("after-custom").result().path
    adam = types.AdamParams(learning_rate=5e-3, beta1=0.8, beta2=0.99)

    def steps(client: Any) -> list[float]:
        losses = []
        for _ in range(2):
            losses.append(client.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            client.optim_step(adam).result()
        return losses

    uninterrupted = steps(training)
    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    assert steps(resumed) == uninterrupted  # bit-exact on CPU

    rest = tinker.RestClient(base_url=served.url, api_key=f"tml-{served.key}")
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [(c.checkpoint_type, c.tinker_path) for c in listed] == [("training", state)]
    service.close("success").result()


def test_a_worker_lost_mid_session_fails_its_futures_and_the_last_save_continues_exactly(
    served: Served, service: Any
) -> None:
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    tokenizer = training.get_tokenizer()
    data = [chat_datum(tokenizer, f"Spell {word}", " ".join(word)) for word in ("cat", "dog")]
    adam = types.AdamParams(learning_rate=5e-3)

    def step(client: Any) -> float:
        fwdbwd = client.forward_backward(data, "cross_entropy")
        client.optim_step(adam).result()
        return float(fwdbwd.result().metrics["loss:sum"])

    step(training)
    state = training.save_state("before-the-loss").result().path
    uninterrupted = [step(training), step(training)]

    serve_pid = json.loads((served.data_dir / "server.json").read_text())["pid"]
    [worker] = children_running(serve_pid, "--queues train")
    os.kill(worker, signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError) as lost:
        training.forward_backward(data, "cross_entropy").result()
    assert lost.value.category == "server" and "create_training_client_from_state" in lost.value.message

    resumed = service.create_training_client_from_state_with_optimizer(state).result()  # on the new worker
    assert [step(resumed), step(resumed)] == uninterrupted
    session_id = training.model_id.split(":")[0]
    kinds = [(e["kind"], e["message"]) for e in served.client.request("GET", f"/v1/jobs/{session_id}/events")["data"]]
    assert ("warning", "worker lost; the job was requeued") in kinds

    # and the session is cancelled like any job: the worker is freed, the client's next request is refused
    assert served.client.request("POST", f"/v1/jobs/{session_id}/cancel")["status"] in ("cancelling", "cancelled")
    wait_until(lambda: served.client.get_job(session_id)["status"] == "cancelled")
    with pytest.raises(tinker.BadRequestError, match="has ended"):
        resumed.forward_backward(data, "cross_entropy").result()


def turns(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[float]]:
    """A conversation's tokens rendered message by message (ChatML renders a prefix as the whole does), weighted 1
    on the assistant's tokens only: the user's and the tool's are context."""
    tokens: list[int] = []
    weights: list[float] = []
    for i, message in enumerate(messages):
        rendered = render(tokenizer, messages[: i + 1])
        assert rendered[: len(tokens)] == tokens
        new = rendered[len(tokens) :]
        tokens, weights = rendered, weights + [float(message["role"] == "assistant")] * len(new)
    return tokens, weights


def test_a_multi_turn_loop_with_a_tool_answer_trains_on_the_models_tokens(service: Any) -> None:
    training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=2).result()
    tokenizer = training.get_tokenizer()
    data = []
    for city, degrees in (("Paris", "18"), ("Oslo", "4")):
        tokens, weights = turns(tokenizer, [
            {"role": "user", "content": f"How warm is {city}?"},
            {"role": "assistant", "content": f"weather({city})"},
            {"role": "tool", "content": f"{degrees} degrees"},
            {"role": "assistant", "content": f"It is {degrees} degrees in {city}."},
        ])  # fmt: skip
        assert 0 < sum(weights) < len(weights)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]}))  # fmt: skip
    losses = []
    for _ in range(8):
        output = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(output.metrics["loss:sum"])
        # the tool's and the user's tokens carry no loss
        for datum, out in zip(data, output.loss_fn_outputs, strict=True):
            unweighted = [x for x, w in zip(out["elementwise_loss"].data, datum.loss_fn_inputs["weights"].data,
                                            strict=True) if w == 0]  # fmt: skip
            assert unweighted and all(x == 0 for x in unweighted)
    assert losses[-1] < 0.7 * losses[0], losses
    service.close("success").result()


def test_dro_and_cispo_s_default_as_tinker_documents_them(service: Any) -> None:
    """The SDK sends ``dro`` (with and without ``beta``) and ``cispo`` without a config: each loss as Tinker's
    losses page writes it, cispo's weight clip(π/π_sampler, 0, 4)."""
    training = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    tokens, targets = [1, 2, 3, 4], [2, 3, 4, 5]
    plain = types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": targets})
    own = training.forward([plain], "cross_entropy").result()
    logprobs = own.loss_fn_outputs[0]["logprobs"].data  # the model's own log-probs of the targets
    ratios, advantages = [1.0, 0.5, 2.0, 6.0], [0.0, 1.0, -1.0, 1.0]
    sampler = [lp - math.log(r) for lp, r in zip(logprobs, ratios, strict=True)]
    inputs = {"target_tokens": targets, "logprobs": sampler, "advantages": advantages}
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)
    cispo = training.forward([datum], "cispo").result()
    weights = [1.0, 0.5, 2.0, 4.0]  # clipped at [0.8, 1.2] they would weigh 1.0, 0.8, 1.2, 1.2
    expected = [-w * a * lp for w, a, lp in zip(weights, advantages, logprobs, strict=True)]
    assert cispo.loss_fn_outputs[0]["elementwise_loss"].data == pytest.approx(expected, rel=1e-4, abs=1e-5)
    for config, beta in ((None, 0.05), ({"beta": 0.5}, 0.5)):
        dro = training.forward_backward([datum], "dro", config).result()
        expected = [
            -(lp * a - 0.5 * beta * (lp - q) ** 2) for lp, a, q in zip(logprobs, advantages, sampler, strict=True)
        ]
        assert dro.loss_fn_outputs[0]["elementwise_loss"].data == pytest.approx(expected, rel=1e-4, abs=1e-5)
        assert dro.metrics["loss:sum"] == pytest.approx(sum(expected), rel=1e-4, abs=1e-5)
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    service.close("success").result()


def test_bad_input_fails_the_request_as_the_users_and_the_session_goes_on(service: Any) -> None:
    training = service.create_lora_training_client(base_model=MODEL, rank=4).result()
    vocab = training.get_tokenizer().vocab_size
    good = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                       loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})  # fmt: skip
    outside = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                          loss_fn_inputs={"target_tokens": [2, vocab + 5, 4], "weights": [1.0, 1.0, 1.0]})  # fmt: skip
    short = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})  # fmt: skip
    for data, loss, named in (
        ([good, outside], "cross_entropy", "data[1].loss_fn_inputs.target_tokens"),
        ([short], "cross_entropy", "data[0].loss_fn_inputs.target_tokens"),
        ([good], "importance_sampling", "data[0].loss_fn_inputs"),
    ):
        with pytest.raises(tinker.RequestFailedError) as failure:
            training.forward_backward(data, loss).result()
        assert failure.value.category == "user" and named in failure.value.message, failure.value.message
    with pytest.raises(tinker.RequestFailedError) as unknown:
        training.forward_backward([good], "stable_reinforce").result()
    assert unknown.value.category == "user" and "loss_fn 'stable_reinforce' is not supported" in unknown.value.message
    # the session and its model are unharmed
    assert training.forward_backward([good], "cross_entropy").result().metrics["loss:sum"] > 0
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    service.close("success").result()


def test_tinker_checkpoint_download_gives_the_saved_adapter_as_peft_loads_it(
    served: Served, service: Any, tmp_path: Path
) -> None:
    """The SDK's CLI against this server: ``tinker checkpoint download`` of a ``save_state`` path loads it in a new
    session, exports it (``save_weights_external``), fetches each file by the URLs the server signed (plain urllib,
    no key), and deletes the export. The files are a PEFT adapter that gives the trained model's log-probs."""
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    tokenizer = training.get_tokenizer()
    data = [chat_datum(tokenizer, "Say hi", "hi there")]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    state = training.save_state("final").result().path
    served_logprobs = training.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    service.close("success").result()
    session_id = training.model_id.split(":")[0]
    wait_until(lambda: served.client.get_job(session_id)["status"] == "succeeded")  # the train worker is free

    env = {**os.environ, "TINKER_API_KEY": f"tml-{served.key}", "TINKER_BASE_URL": served.url, "TINKER_TELEMETRY": "0"}
    command = [sys.executable, "-m", "tinker.cli", "checkpoint", "download", state, "--output", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    folder = tmp_path / state.removeprefix("tinker://").replace("/", "_")
    names = {path.name for path in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= names, names
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == MODEL

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(served.model_root / MODEL, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).eval()
    tokens = torch.tensor([data[0].model_input.to_ints()])  # (1, N)
    targets = torch.tensor(data[0].loss_fn_inputs["target_tokens"].data)  # (N,)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0].float()  # (N, V)
    logprobs = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]  # (N,)
    assert torch.allclose(logprobs, torch.tensor(served_logprobs), atol=1e-4), (logprobs, served_logprobs)

    # the export is gone again, the saved state stays; the CLI's own session ended as a success
    rest = tinker.RestClient(base_url=served.url, api_key=f"tml-{served.key}")
    assert [c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [state]
    runs = rest.list_training_runs().result().training_runs  # newest first: the CLI's is among them
    [exported] = [run for run in runs if run.user_metadata == {"created_by": "tinker checkpoint download"}]
    assert rest.list_checkpoints(exported.training_run_id).result().checkpoints == []
    cli_session = exported.training_run_id.split(":")[0]
    wait_until(lambda: served.client.get_job(cli_session)["status"] == "succeeded")
