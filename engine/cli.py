"""The ``rlhf`` command line: run jobs locally, without any server.

rlhf demo [--out runs/demo] [--method dpo]  the built-in SFT → RM → PPO (or SFT → DPO) pipeline, before/after
rlhf train SPEC.(yaml|json) --out DIR       one job; DIR gets checkpoints/step-N/, spec.json, job.json,
                                            metrics.jsonl, and the trackers the spec switches on (tracking)
           [--restart]                      start over in a DIR holding a run of another spec
rlhf generate --model DIR --prompt TEXT     sample from a job folder, a checkpoint or any causal LM
"""

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from tqdm import tqdm

from engine.callbacks import Callbacks, VllmSettings
from engine.spec.config import JOB_TYPES, JobSpec, format_errors
from engine.spec.rows import Message
from engine.tracking import METRICS_FILE, MetricsFile, Tracker, TrackingOptions, switched_on


class ProgressBar(Callbacks):
    """A tqdm bar with the job's key metrics; events are printed above it."""

    def __init__(self, job_type: str, label: str, vllm: VllmSettings | None = None) -> None:
        self.keys = JOB_TYPES[job_type].metrics[:3]  # the job type's headline metrics
        self.label = label
        self.vllm_settings = vllm
        self.bar: tqdm | None = None
        self.shown: dict[str, float] = {}

    def on_start(self, start_step: int, total_steps: int) -> None:
        self.bar = tqdm(total=total_steps, initial=start_step, desc=self.label, unit="step", dynamic_ncols=True)

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        assert self.bar is not None
        self.shown.update(
            {k.split("/")[-1] if k.startswith("objective") else k: metrics[k] for k in self.keys if k in metrics}
        )
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in self.shown.items()}, refresh=False)
        self.bar.update(step - self.bar.n)

    def on_event(self, kind: str, message: str, data: dict[str, object] | None = None) -> None:
        tqdm.write(f"[{self.label}] {kind}: {message}")

    def vllm(self) -> VllmSettings | None:
        """``--vllm-python`` or ``--vllm-url``, for a ``rollout_engine: vllm`` spec."""
        return self.vllm_settings

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def read_spec(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: a job spec is a JSON/YAML object")
    return data


def parse_spec(data: dict[str, Any], source: str) -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise SystemExit(f"{source}: invalid job spec\n{format_errors(e)}") from None


def train(
    spec: JobSpec, out: Path, label: str | None = None, *, restart: bool = False, vllm: VllmSettings | None = None
) -> None:
    """Train ``spec`` in the job folder ``out``, resuming the run there only when it is of the same spec.

    A folder holding a run of another spec raises :class:`~engine.core.checkpoint.SpecMismatchError` before anything
    loads; ``restart`` deletes that run first. The check lives here, not in ``run_job``: a local ``--out`` may
    name any folder, while on the server every job has a folder of its own, keyed by its id, and its resolved
    references (absolute paths) must not stop it resuming after the artifacts folder has moved.
    """
    from engine.core.checkpoint import check_same_spec, delete_run
    from engine.run import run_job  # torch is imported only for commands that need it

    if restart:
        deleted = delete_run(out)
        print(f"{label or spec.name or spec.type}: restarting; deleted {deleted} checkpoint(s) of {out}")
    else:
        for change in check_same_spec(out, spec):
            print(f"{label or spec.name or spec.type}: resuming as this version trains it: {change}")
    bar = ProgressBar(spec.type, label or spec.name or spec.type, vllm)
    callbacks: Callbacks = MetricsFile(bar, out / METRICS_FILE)
    tracker = None
    if backends := switched_on(spec):  # each into its folder under out, MLflow into a local store there
        tracker = Tracker(callbacks, spec, out, TrackingOptions(backends, run_name=spec.name or out.resolve().name))
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its store's set-up notices, amid the progress bar
    started = time.perf_counter()
    status = "failed"
    try:
        result = run_job(spec, out, tracker or callbacks)
        status = result.status
    finally:
        if tracker is not None:
            tracker.close(status)
        bar.close()
    print(f"{bar.label}: {result.status} at step {result.step} in {time.perf_counter() - started:.1f}s -> {out}")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def cmd_train(args: argparse.Namespace, vllm: VllmSettings | None = None) -> None:
    """``train`` on the vLLM ``--vllm-python`` or ``--vllm-url`` names, else on ``vllm`` (``rlhf train``: the one
    the service's settings name), keeping its start timeout."""
    quiet_transformers()
    if args.vllm_python or args.vllm_url:
        vllm = replace(vllm or VllmSettings(), python=args.vllm_python, url=args.vllm_url)
    train(parse_spec(read_spec(args.spec), str(args.spec)), args.out, restart=args.restart, vllm=vllm)


def cmd_generate(args: argparse.Namespace) -> None:
    from engine.core.generate import generate
    from engine.core.models import load_causal_lm, load_tokenizer, pick_device, resolve_model_ref

    quiet_transformers()

    ref = resolve_model_ref(args.model)
    tokenizer = load_tokenizer(ref)
    model = load_causal_lm(ref, tokenizer, seed=args.seed)
    model.to(pick_device())  # type: ignore[arg-type]
    prompts = chat_prompts(args.prompt, args.system) if args.chat else args.prompt
    completions = generate(model, tokenizer, prompts, args.max_new_tokens, args.temperature, args.top_p, args.seed)
    for c in completions:
        print(json.dumps({"prompt": c.prompt, "text": c.text, "finish_reason": c.finish_reason}))


def cmd_demo(args: argparse.Namespace) -> None:
    from engine.demo import run_demo

    quiet_transformers()

    started = time.perf_counter()
    report = run_demo(args.out, train, args.method)
    print(f"\n{report.table()}\npipeline finished in {time.perf_counter() - started:.0f}s; jobs in {args.out}")


def quiet_transformers() -> None:
    """Keep transformers' own progress bars and notices out of ours (commands that load models call this)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def add_demo_command(sub: argparse._SubParsersAction, name: str = "demo") -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="run the built-in SFT → RM → PPO pipeline in-process and compare before/after")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="folder for the jobs (default runs/demo)")
    methods = [name for name, info in JOB_TYPES.items() if info.generates and name != "sft"]
    p.add_argument(
        "--method", choices=methods, default="ppo", help="what trains the SFT model further (ppo: a reward model first)"
    )
    p.set_defaults(func=cmd_demo)
    return p


def add_train_command(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="run one job spec locally, without a server")
    p.add_argument("spec", type=Path, help="job spec, .json or .yaml (the body of POST /v1/jobs)")
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="job folder: checkpoints, job.json, metrics.jsonl and the trackers' files; resumes a run of the same spec",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="delete the folder's checkpoints, job.json and spec.json first, and start over",
    )
    p.add_argument("--vllm-python", help="rollout_engine vllm: the python of an environment with vLLM, to start one")
    p.add_argument("--vllm-url", help="rollout_engine vllm: or a running vLLM server to sample on")
    p.add_argument("--traceback", action="store_true", help="on an error, show its traceback, not one line")
    p.set_defaults(func=cmd_train)
    return p


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--temperature", type=float, default=0.7, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user turn, rendered with the model's chat template and its generation prompt",
    )
    p.add_argument("--system", help="with --chat: a system turn before each user turn")


def chat_prompts(texts: list[str], system: str | None) -> list[list[Message]]:
    """Each text as a one-turn conversation (after a system turn, when given), as chat rows are."""
    before: list[Message] = [{"role": "system", "content": system}] if system else []
    return [[*before, {"role": "user", "content": text}] for text in texts]


def run_command(args: argparse.Namespace) -> None:
    """Run a parsed command; an error ends it in one line and exit status 1, not a traceback (``--traceback``
    shows it). Errors of the user's making (bad references, rows, sizes: ValueError) and of what a job relies on
    (a vLLM server, a reward service) say only their message; another names its kind too. (Commands that load
    models quiet transformers themselves: the service's commands must run where it is not installed.)"""
    try:
        args.func(args)
    except Exception as e:
        if getattr(args, "traceback", False):
            raise
        raise SystemExit(f"error: {one_line(e)}") from None


def one_line(error: BaseException) -> str:
    """An error's message on one line (its lines joined), after its kind unless it is one the engine raises for
    the job (its module under ``engine``) or a ValueError."""
    message = " | ".join(line.strip() for line in str(error).splitlines() if line.strip()) or "(no message)"
    ours = type(error).__module__.split(".")[0] == "engine" or isinstance(error, ValueError)
    return message if ours else f"{type(error).__name__}: {message}"


def main(argv: list[str] | None = None) -> None:
    """The engine's own command line (``python -m engine.cli``); ``rlhf`` adds the service commands."""
    parser = argparse.ArgumentParser(prog="python -m engine.cli", description="Train models from human feedback.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_command(sub)
    add_train_command(sub)
    p = sub.add_parser("generate", help="sample completions from a model")
    p.add_argument("--model", required=True, help="job folder, checkpoint folder, local model or hub id")
    p.add_argument("--prompt", required=True, action="append", help="prompt text; repeat for several")
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_generate)
    run_command(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
