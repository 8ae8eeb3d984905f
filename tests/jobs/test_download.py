"""``rlhf download`` end to end: jobs trained by the worker's runner (SFT in full and with LoRA, a reward model), the
API served by uvicorn over a real socket, and the command line unpacking what it streams into folders that plain
transformers and peft load to the job's own logits; another project's job is a 404."""

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import uvicorn
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from api.main import create_app
from engine.core.models import load_causal_lm, load_tokenizer
from jobs import cli, runner
from jobs.store.settings import Settings
from tests.factories import create_job, make_settings, new_project
from tests.jobs.helpers import LEASE_SECONDS, sft_spec

TWO_STEPS = {"max_steps": 2, "batch_size": 8, "learning_rate": 1e-2}
LORA = {"r": 4, "alpha": 8}


@dataclass
class Served:
    settings: Settings
    url: str
    key: str
    other_key: str
    """A key of another project."""
    sft: str
    lora: str
    rm: str

    def download(self, *argv: str, key: str | None = None) -> None:
        cli.main(["download", *argv, "--url", self.url, "--api-key", key or self.key])

    def checkpoint(self, job_id: str, step: int) -> Path:
        return self.settings.resolved_artifacts_dir / "jobs" / job_id / "checkpoints" / f"step-{step}"


@pytest.fixture(scope="module")
def served(sqlite_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Three tiny jobs of two steps each (a checkpoint at each step), then the API on a free port."""
    settings = make_settings(tmp_path_factory.mktemp("download"), sqlite_url, lease_seconds=LEASE_SECONDS)
    project, other = new_project(settings), new_project(settings, name="other")
    rm = {"type": "rm", "model": "builtin:tiny", "dataset": "builtin:reviews-prefs", "hyperparameters": TWO_STEPS}
    specs = [
        sft_spec(hyperparameters=TWO_STEPS, checkpoint_every=1),
        sft_spec(hyperparameters=TWO_STEPS, lora=LORA),
        rm,
    ]
    jobs = [create_job(settings, project.id, spec) for spec in specs]
    for job_id in jobs:
        assert runner.run_job(job_id, settings=settings, worker="w:1") == "succeeded"
    app = create_app(settings, enqueue=lambda job_id, queue: None, recovery_interval=None)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        host, port = listener.getsockname()
        try:
            yield Served(settings, f"http://{host}:{port}", project.key, other.key, *jobs)
        finally:
            server.should_exit = True
            thread.join(timeout=10)


def loaded(auto: type, folder: Path) -> PreTrainedModel:
    """``auto.from_pretrained(folder)``, checking that every weight came from the folder."""
    model, info = auto.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def logits(model: torch.nn.Module, folder: Path) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(["the film was", "service was slow and"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out: torch.Tensor = model(**batch).logits
    return out


def test_a_downloaded_model_loads_in_plain_transformers_to_the_jobs_logits(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sft"
    served.download(served.sft, "-o", str(out))
    assert capsys.readouterr().out.strip() == str(out)
    policy = served.checkpoint(served.sft, 2) / "policy"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in policy.iterdir())
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    model = loaded(AutoModelForCausalLM, out)
    assert torch.equal(logits(model, out), logits(loaded(AutoModelForCausalLM, policy), policy))

    # a checkpoint, into ./<job>-step-<step> by default; a non-empty folder only with --force
    monkeypatch.chdir(tmp_path)
    served.download(f"{served.sft}@1")
    first = tmp_path / f"{served.sft}-step-1"
    saved = served.checkpoint(served.sft, 1) / "policy" / "model.safetensors"
    assert (first / "model.safetensors").read_bytes() == saved.read_bytes()
    with pytest.raises(SystemExit, match="not empty; pass --force"):
        served.download(served.sft, "-o", str(first))
    (first / "notes.txt").write_text("mine")
    served.download(served.sft, "-o", str(first), "--force")
    assert (first / "model.safetensors").read_bytes() == (policy / "model.safetensors").read_bytes()
    assert (first / "notes.txt").read_text() == "mine"  # what the model does not bring is left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["sft", first.name])  # no staging folder left


def test_a_lora_jobs_download_is_the_merged_model_with_an_adapter_peft_loads(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "lora"
    served.download(f"job:{served.lora}", "-o", str(out))
    merged = loaded(AutoModelForCausalLM, out)
    policy = served.checkpoint(served.lora, 2) / "policy"
    expected = logits(loaded(AutoModelForCausalLM, policy), policy)
    assert torch.equal(logits(merged, out), expected)

    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / "adapter").iterdir()}
    base = load_causal_lm("builtin:tiny", load_tokenizer("builtin:tiny"), seed=0).eval()  # the job's starting model
    assert not torch.allclose(logits(base, out), expected)  # the adapter has something to add
    adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
    torch.testing.assert_close(logits(adapted, out), expected, rtol=1e-5, atol=1e-5)


def test_a_reward_model_downloads_as_its_sequence_classifier(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "rm"
    served.download(served.rm, "-o", str(out))
    policy = served.checkpoint(served.rm, 2) / "policy"
    scores = logits(loaded(AutoModelForSequenceClassification, out), out)
    assert scores.shape == (2, 1)
    assert torch.equal(scores, logits(loaded(AutoModelForSequenceClassification, policy), policy))


def test_another_projects_job_is_not_found(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "theirs"
    with pytest.raises(SystemExit, match=f"404 not_found: no job '{served.sft}' in this project"):
        served.download(served.sft, "-o", str(out), key=served.other_key)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []
