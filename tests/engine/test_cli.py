"""The local ``rlhf`` command line (``python -m engine.cli``), run as a real subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine.checkpoint import JOB_FILE


def rlhf(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


TINY_SFT = {
    "type": "sft",
    "model": "builtin:tiny",
    "dataset": "builtin:reviews-sft",
    "hyperparameters": {"max_steps": 3, "batch_size": 8},
    "checkpoint_every": 1000,
}


@pytest.mark.parametrize(("suffix", "dump"), [(".json", json.dumps), (".yaml", yaml.safe_dump)], ids=["json", "yaml"])
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hyperparameters": {"learning_rate": -1}}, "learning_rate"),
        ({"epochs": 3}, "epochs"),
        ({"dataset": "builtin:reviews-prefs"}, "dataset"),
    ],
    ids=["out-of-range", "unknown-field", "wrong-dataset-kind"],
)
def test_train_rejects_an_invalid_spec(tmp_path, suffix, dump, change, field):
    spec_file = tmp_path / f"spec{suffix}"
    spec_file.write_text(dump({**TINY_SFT, **change}))
    out = tmp_path / "job"
    proc = rlhf("train", spec_file, "--out", out, cwd=tmp_path)
    assert proc.returncode != 0
    assert "invalid job spec" in proc.stderr
    assert field in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists(), "a bad spec must never start a job"


def test_train_rejects_a_spec_that_is_not_an_object(tmp_path):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text("- just\n- a list\n")
    proc = rlhf("train", spec_file, "--out", tmp_path / "job", cwd=tmp_path)
    assert proc.returncode != 0
    assert "object" in proc.stderr


def test_train_then_generate(tmp_path):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(TINY_SFT))
    out = tmp_path / "job"
    proc = rlhf("train", spec_file, "--out", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "succeeded at step 3" in proc.stdout
    job = json.loads((out / JOB_FILE).read_text())
    assert job["status"] == "succeeded" and job["final_step"] == 3
    assert (out / "checkpoints" / "step-3" / "policy" / "config.json").is_file()

    prompts = ["we watched the film and it was", "the sequel was"]
    args = ["generate", "--model", out, "--max-new-tokens", "5", "--seed", "1"]
    for prompt in prompts:
        args += ["--prompt", prompt]
    proc = rlhf(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(prompts), proc.stdout
    records = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in records] == prompts
    for record in records:
        assert set(record) == {"prompt", "text", "finish_reason"}
        assert isinstance(record["text"], str)
        assert record["finish_reason"] in ("stop", "length")

    # a checkpoint folder names the same model; sampling is seeded, so the lines are the same
    from_checkpoint = rlhf(*[out / "checkpoints" / "step-3" if a == out else a for a in args], cwd=tmp_path)
    assert from_checkpoint.returncode == 0, from_checkpoint.stderr
    assert from_checkpoint.stdout == proc.stdout


def test_generate_from_an_unfinished_job_fails(tmp_path):
    (tmp_path / "job" / "checkpoints").mkdir(parents=True)
    proc = rlhf("generate", "--model", tmp_path / "job", "--prompt", "hi", cwd=tmp_path)
    assert proc.returncode != 0
    assert "not finished" in proc.stderr
    assert "Traceback" not in proc.stderr  # one clear line, not a stack trace
