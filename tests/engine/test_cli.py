"""The local ``rlhf`` command line (``python -m engine.cli``), run as a real subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine import cli
from engine.builtin import digits
from engine.core.checkpoint import JOB_FILE, SPEC_FILE, check_same_spec, list_checkpoints
from engine.spec.config import JobSpec
from tests.engine.helpers import make_spec, train
from tests.recorder import Recorder


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


# Resuming into an output folder: only a run of the same spec (issue 12, item 4).
TWO_STEPS = {"max_steps": 2, "batch_size": 4}


def write_spec(path: Path, spec: JobSpec) -> Path:
    path.write_text(json.dumps(spec.model_dump(mode="json")))
    return path


def snapshot(folder: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_train_refuses_a_folder_holding_another_spec(tmp_path):
    out = tmp_path / "job"
    first, _ = train(make_spec("sft", hyperparameters=TWO_STEPS), out)
    assert first.status == "succeeded"
    before, job_before = snapshot(out / "checkpoints"), (out / JOB_FILE).read_text()

    other = make_spec("sft", model=tmp_path / "other-model", hyperparameters={**TWO_STEPS, "max_steps": 3})
    proc = rlhf("train", write_spec(tmp_path / "other.json", other), "--out", out, cwd=tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.startswith(f"error: {out} holds a run of a different spec: "), proc.stderr
    assert f"model 'builtin:tiny' → '{tmp_path / 'other-model'}'" in proc.stderr
    assert "hyperparameters.max_steps 2 → 3" in proc.stderr
    assert "--restart" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert snapshot(out / "checkpoints") == before, "nothing may be trained, written or deleted"
    assert (out / JOB_FILE).read_text() == job_before


def test_train_resumes_a_paused_run_of_the_same_spec(tmp_path, capsys):
    out = tmp_path / "job"
    spec = make_spec("sft", hyperparameters=TWO_STEPS)
    paused, _ = train(spec, out, Recorder(stop_after=1))
    assert paused.status == "paused"
    assert json.loads((out / SPEC_FILE).read_text()) == spec.model_dump(mode="json")

    cli.train(spec, out)
    shown = capsys.readouterr().out
    assert "info: resumed from step 1" in shown
    assert "succeeded at step 2" in shown
    assert [step for step, _ in list_checkpoints(out)] == [1, 2]


def test_train_restart_starts_over_with_the_new_spec(tmp_path):
    out = tmp_path / "job"
    train(make_spec("sft", hyperparameters={**TWO_STEPS, "max_steps": 3}), out)
    (out / "notes.txt").write_text("mine")
    spec = make_spec("sft", hyperparameters=TWO_STEPS, seed=1)

    proc = rlhf("train", write_spec(tmp_path / "new.json", spec), "--out", out, "--restart", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "deleted 1 checkpoint(s)" in proc.stdout
    assert "resumed" not in proc.stdout
    assert "succeeded at step 2" in proc.stdout
    assert [step for step, _ in list_checkpoints(out)] == [2]
    assert json.loads((out / SPEC_FILE).read_text()) == spec.model_dump(mode="json")
    assert json.loads((out / JOB_FILE).read_text())["spec"]["seed"] == 1
    assert (out / "notes.txt").read_text() == "mine", "--restart deletes the run only"


def test_train_resumes_under_another_name_metadata_queue_or_trackers(tmp_path, capsys):
    out = tmp_path / "job"
    train(make_spec("sft", hyperparameters=TWO_STEPS), out)
    relabelled = make_spec(
        "sft",
        hyperparameters=TWO_STEPS,
        name="renamed",
        metadata={"team": "b"},
        resources={"queue": "train-a100"},
        tracking={"tensorboard": True},
    )
    before = snapshot(out / "checkpoints")

    cli.train(relabelled, out)
    assert "succeeded at step 2" in capsys.readouterr().out
    assert snapshot(out / "checkpoints") == before, "a finished run has nothing left to train"


def test_a_folder_without_a_stored_spec_resumes(tmp_path):
    """A folder written before spec.json existed (no spec.json, no job.json) resumes as it did."""
    out = tmp_path / "job"
    train(make_spec("sft", hyperparameters=TWO_STEPS), out, Recorder(stop_after=1))
    (out / SPEC_FILE).unlink()
    check_same_spec(out, make_spec("sft", hyperparameters={**TWO_STEPS, "max_steps": 3}))


def test_a_grpo_folder_stored_with_k3_in_the_reward_resumes_upgraded(tmp_path):
    """An earlier version filled GRPO's kl_estimator in as k3, which this version refuses where the KL is in the
    reward (reinforce_pp's default): the folder's stored spec is upgraded to k1 there, compares equal to the same
    spec given now, and what changed is reported."""
    out = tmp_path / "job"
    spec = JobSpec.model_validate(
        {
            "type": "grpo",
            "model": "builtin:tiny",
            "dataset": "builtin:digits-prompts",
            "reward": digits.GRADER,
            "hyperparameters": {"advantage_estimator": "reinforce_pp"},
        }
    )
    out.mkdir()
    stored = spec.model_dump(mode="json")
    stored["hyperparameters"]["kl_estimator"] = "k3"
    (out / JOB_FILE).write_text(json.dumps({"status": "running", "spec": stored}))
    changes = check_same_spec(out, spec)
    assert len(changes) == 1 and changes[0].startswith("hyperparameters.kl_estimator k3 → k1"), changes
