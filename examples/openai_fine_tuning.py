"""OpenAI's fine-tuning flow against ``rlhf serve``, with the official ``openai`` client only: for each method
(supervised, dpo, reinforcement with a ``string_check`` grader) upload a ``fine-tune`` file, create the job,
follow its events, list its checkpoints and chat with its ``fine_tuned_model``; then find the jobs in the native
``GET /v1/jobs``.

    RLHF_MODEL_ROOT=models rlhf serve &     # models/llama: a causal LM whose tokenizer has a chat template
    python examples/openai_fine_tuning.py --model llama

The training files are written from the built-in reviews task in OpenAI's formats (a user asking for a review,
the assistant writing one). The key is read from ``rlhf-data/api-key`` unless ``--api-key`` is given.
"""

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

from engine.builtin import reviews

REQUEST = "Finish this review: {prompt}"
GRADER = {
    "type": "string_check",
    "name": "recommended",
    "input": "{{sample.output_text}}",
    "reference": "{{item.word}}",
    "operation": "ilike",  # the response contains the row's word, in any case
}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text.strip()}


def rows(method: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows of ``method``'s format from the reviews task."""
    rng = random.Random(seed)
    if method == "supervised":
        picked = rng.sample(reviews.sft_rows("train"), n)
        return [{"messages": [user(REQUEST.format(prompt=r["prompt"])), assistant(r["completion"])]} for r in picked]
    if method == "dpo":
        picked = rng.sample(reviews.pref_rows("train"), n)
        return [
            {"input": {"messages": [user(REQUEST.format(prompt=r["prompt"]))]},
             "preferred_output": [assistant(r["chosen"])], "non_preferred_output": [assistant(r["rejected"])]}
            for r in picked
        ]  # fmt: skip
    picked = rng.sample(reviews.prompt_rows("train"), n)
    return [{"messages": [user(REQUEST.format(prompt=r["prompt"]))], "word": "recommended"} for r in picked]


METHODS: dict[str, tuple[int, dict[str, Any]]] = {
    "supervised": (64, {"supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 16,
                                                           "learning_rate_multiplier": 3}}}),
    "dpo": (64, {"dpo": {"hyperparameters": {"n_epochs": 1, "batch_size": 16, "beta": 0.1,
                                             "learning_rate_multiplier": 100}}}),
    "reinforcement": (16, {"reinforcement": {"grader": GRADER, "hyperparameters": {
        "n_epochs": 1, "batch_size": 4, "compute_multiplier": 0.5, "learning_rate_multiplier": 10}}}),
}  # fmt: skip
"""Rows and the ``method`` of each job: a few steps each."""


def follow(client: OpenAI, job_id: str, timeout: float) -> Any:
    """Print the job's events as they come (the API pages them newest first) until it ends; the job."""
    printed: set[str] = set()
    deadline = time.monotonic() + timeout
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        new = [e for e in client.fine_tuning.jobs.list_events(job_id, limit=100) if e.id not in printed]
        for event in reversed(new):
            print(f"  [{event.level}] {event.message}")
            printed.add(event.id)
        if job.status in ("succeeded", "failed", "cancelled"):
            return job
        if time.monotonic() > deadline:
            raise SystemExit(f"{job_id} is still {job.status} after {timeout:.0f} s")
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", help="default: the key rlhf serve wrote to rlhf-data/api-key")
    parser.add_argument("--model", default="llama", help="a model the server can load (under RLHF_MODEL_ROOT)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds each job may take")
    args = parser.parse_args()
    key = args.api_key or Path("rlhf-data/api-key").read_text().strip()
    client = OpenAI(base_url=args.base_url, api_key=key)

    created = []
    with tempfile.TemporaryDirectory() as folder:
        for method, (n, settings) in METHODS.items():
            path = Path(folder) / f"{method}.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in rows(method, n)))
            with path.open("rb") as f:
                file = client.files.create(file=f, purpose="fine-tune")
            job = client.fine_tuning.jobs.create(
                model=args.model, training_file=file.id, method={"type": method, **settings}, suffix=method
            )
            print(f"{method}: {file.id} ({file.bytes} bytes) -> {job.id} {job.status}")
            started = time.monotonic()
            job = follow(client, job.id, args.timeout)
            if job.status != "succeeded":
                raise SystemExit(f"{method}: {job.id} {job.status}: {job.error}")
            checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
            print(f"  {job.status} in {time.monotonic() - started:.1f} s; fine_tuned_model {job.fine_tuned_model}; "
                  f"checkpoints {[c.fine_tuned_model_checkpoint for c in checkpoints]}")  # fmt: skip
            chat = client.chat.completions.create(
                model=job.fine_tuned_model or "", max_tokens=12, seed=0,
                messages=[user(REQUEST.format(prompt="we watched the film and it was"))],
            )  # fmt: skip
            print(f"  chat: {chat.choices[0].message.content!r}")
            created.append(job.id)

    native: Any = client.get("/jobs", cast_to=object, options={"params": {"limit": 100}})
    listed = {job["id"]: job["type"] for job in native["data"]}
    print("in GET /v1/jobs:", {job_id: listed.get(job_id) for job_id in created})
    assert all(job_id in listed for job_id in created)


if __name__ == "__main__":
    main()
