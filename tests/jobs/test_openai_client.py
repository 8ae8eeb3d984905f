"""Acceptance of the OpenAI-compatible endpoints: the official ``openai`` client against a real ``rlhf serve``
(API, train and inference workers as processes) serving two jobs' checkpoints: a tiny model trained one SFT step
from a local folder whose tokenizer has a chat template, and the built-in tiny model, which has none."""

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core.models import load_causal_lm, load_tokenizer, save_model
from engine.run import run_job as run_engine
from engine.spec.config import JobSpec
from jobs.client import KEY_FILE
from jobs.demo import embedded_server
from jobs.store import crud, db, refs
from jobs.store.settings import Settings
from tests.test_e2e import free_port

openai = pytest.importorskip("openai")

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SFT_ONE_STEP = {"max_steps": 1, "batch_size": 4, "learning_rate": 1e-3}


@dataclass
class Served:
    client: Any  # openai.OpenAI
    chat: str
    """job:<id> of the succeeded job whose tokenizer has a chat template."""
    plain: str
    """A checkpoint, job:<id>@<step>, of a job whose tokenizer has none."""
    foreign: str
    """A succeeded job of another project."""


def train_one_step(model: str, out_dir: Path) -> Path:
    spec = {"type": "sft", "model": model, "dataset": "builtin:reviews-sft", "hyperparameters": SFT_ONE_STEP}
    assert run_engine(JobSpec.model_validate(spec), out_dir, device=torch.device("cpu")).status == "succeeded"
    return out_dir


def add_job(settings: Settings, project_id: str, folder: Path, status: str = "succeeded") -> str:
    """A job row of ``project_id`` with the job folder ``folder`` (one checkpoint, step 1), as a worker leaves it."""
    spec = {"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft"}
    with db.session_scope(settings.resolved_database_url) as session:
        job, _ = crud.create_job(session, project_id=project_id, spec=spec, idempotency_key=None)
        job_id = job.id
        shutil.copytree(folder, refs.job_dir(settings.resolved_artifacts_dir, job_id))
        crud.record_checkpoint(session, job_id=job_id, step=1, path=f"jobs/{job_id}/checkpoints/step-1", metrics={},
                               kept_steps=())  # fmt: skip
        assert crud.transition(session, job_id=job_id, from_statuses=("queued",), to=status, output_step=1, step=1)
    return job_id


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("openai")
    data_dir = root / "server"
    with embedded_server(data_dir, free_port()) as c:  # its workers start while the models train
        # A local model whose tokenizer has a chat template: the built-in tiny model, saved with one.
        tokenizer = load_tokenizer("builtin:tiny")
        tokenizer.chat_template = CHAT_TEMPLATE
        save_model(load_causal_lm("builtin:tiny", tokenizer, seed=0), tokenizer, root / "chat-base")
        chat_run = train_one_step(str(root / "chat-base"), root / "chat-run")
        plain_run = train_one_step("builtin:tiny", root / "plain-run")
        assert load_tokenizer(str(chat_run)).chat_template == CHAT_TEMPLATE  # training kept it in the checkpoint
        assert not load_tokenizer(str(plain_run)).chat_template

        settings = Settings(data_dir=data_dir, database_url=None, artifacts_dir=None)
        key = (data_dir / KEY_FILE).read_text().strip()
        with db.session_scope(settings.resolved_database_url) as session:
            project = crud.project_for_key(session, key=key)
            assert project is not None
            project_id = project.id
            other_id = crud.create_project(session, name="other").id
        chat = add_job(settings, project_id, chat_run)
        plain = add_job(settings, project_id, plain_run, status="paused")  # still training: checkpoints only
        foreign = add_job(settings, other_id, plain_run)
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key=key, max_retries=0, timeout=120)
        yield Served(client, f"job:{chat}", f"job:{plain}@1", f"job:{foreign}")
        client.close()


def test_models_list(served: Served) -> None:
    ids = [m.id for m in served.client.models.list()]
    assert ids == [served.chat, f"{served.chat}@1", served.plain]
    assert served.client.models.retrieve(served.plain).id == served.plain


def test_completions_with_n_and_stop(served: Served) -> None:
    prompts = ["The food was", "Service here is"]
    kwargs = {"model": served.plain, "prompt": prompts, "max_tokens": 8, "n": 2, "seed": 3}
    full = served.client.completions.create(**kwargs)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    texts = [c.text for c in full.choices]
    assert texts[0] != texts[1] or texts[2] != texts[3]  # n distinct samples per prompt
    assert full.usage is not None and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    # A stop string taken from the middle of the first text: that choice ends before it.
    first = texts[0]
    stop = first[len(first) // 2 :][:3]
    assert stop.strip(), first
    cut = served.client.completions.create(**kwargs, stop=[stop, "\n\n\n\n"])
    assert cut.choices[0].text == first[: first.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage is not None and cut.usage.completion_tokens < full.usage.completion_tokens
    for before, after in zip(full.choices, cut.choices, strict=True):
        assert before.text.startswith(after.text) and stop not in after.text


def test_chat_completion_with_a_template(served: Served) -> None:
    messages = [{"role": "user", "content": "How was the film?"}]
    chat = served.client.chat.completions.create(model=served.chat, messages=messages, max_tokens=6, seed=1)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    [choice] = chat.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    # The prompt is the template's text: "user: How was the film?\nassistant:".
    as_prompt = served.client.completions.create(
        model=served.chat, prompt="user: How was the film?\nassistant:", max_tokens=6, seed=1
    )
    assert as_prompt.choices[0].text == choice.message.content
    assert chat.usage is not None and chat.usage.prompt_tokens == as_prompt.usage.prompt_tokens


def test_chat_without_a_template_is_400(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        served.client.chat.completions.create(model=served.plain, messages=[{"role": "user", "content": "hi"}])
    assert error.value.status_code == 400
    assert error.value.code == "chat_template_missing"
    assert served.plain in error.value.message and "/v1/completions" in error.value.message


def test_streaming_matches_the_unstreamed_text(served: Served) -> None:
    kwargs = {"model": served.plain, "prompt": "The food was", "max_tokens": 10, "seed": 5}
    full = served.client.completions.create(**kwargs)
    chunks = list(served.client.completions.create(**kwargs, stream=True))
    assert len(chunks) >= 2
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason

    messages = [{"role": "user", "content": "Tell me"}]
    chat = served.client.chat.completions.create(model=served.chat, messages=messages, max_tokens=10, seed=5)
    stream = served.client.chat.completions.create(
        model=served.chat,
        messages=messages,
        max_tokens=10,
        seed=5,
        stream=True,
    )
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_another_projects_model_is_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        served.client.completions.create(model=served.foreign, prompt="hi", max_tokens=2)
    assert error.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(model=f"{served.foreign}@1", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve(served.foreign)
