"""The built-in pipelines: SFT → reward model → PPO on the reviews task, or SFT → another method (``--method
dpo``; ``--method grpo`` on the verifiable digits task; ``--method distill``: SFT → GRPO as the teacher, then the
SFT model distilled from it), then a before/after table.

Judged on held-out prompts by the task's own rule (never used in training by the reviews methods; the digits
task's GRPO is trained against that very rule, on other prompts): the share of accepted completions from the SFT
model and from the trained policy, their reward-model scores (when a reward model was trained), and the policy's
KL to the SFT reference on its own samples (for distillation: its reverse KL to the teacher, and the teacher's
own accuracy beside).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engine.builtin import reviews
from engine.core.data import encode_prompts, load_rows
from engine.core.generate import sample
from engine.core.models import (
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    resolve_model_ref,
    stop_token_ids,
    token_logprobs,
)
from engine.core.ops import truncate_after_stop
from engine.methods.rm import encode_pairs, evaluate_pairs
from engine.rewards.reward_model import sequence_scores
from engine.spec.config import JOB_TYPES, MODEL_FIELDS, JobSpec


@dataclass(frozen=True)
class Task:
    """A built-in task a demo pipeline trains and judges on."""

    eval_prompts: str
    """The held-out prompt rows the policies are judged on."""
    label: str
    """What the judge measures, for the table."""
    judge: Callable[[dict[str, Any], str], bool]
    """Whether a completion of a row is good, by the task's rule."""
    sft: dict[str, Any] = field(default_factory=dict)
    """The SFT stage's settings on this task, over the ``sft`` entry's demo stage."""


TASKS = {
    "reviews": Task(
        eval_prompts="builtin:reviews-prompts-eval",
        label="positive share (truth)",
        judge=lambda row, text: reviews.is_positive(text),
    ),
    "digits": Task(
        eval_prompts="builtin:digits-prompts-eval",
        label="accuracy (rule)",
        judge=lambda row, text: text == row["answer"],
        sft={"dataset": "builtin:digits-sft", "eval_dataset": "builtin:digits-sft-eval", "epochs": 6},
    ),
}
"""The demo tasks, by name: a job type's demo stage names its task in ``demo_task``."""


SEED = 0
TEMPERATURE = 1.0
EVAL_PROMPTS = 256
STAGE_PREFIX = "stage:"
"""How a demo stage names another stage's model (the pipelines' spelling, ``POST /v1/pipelines``)."""


def named_stages(method: str) -> dict[str, str]:
    """The stages whose models ``method``'s demo stage names in its model fields (``"teacher": "stage:grpo"``):
    field → stage."""
    demo = JOB_TYPES[method].demo
    return {
        name: demo[name].removeprefix(STAGE_PREFIX)
        for name in MODEL_FIELDS
        if isinstance(demo.get(name), str) and demo[name].startswith(STAGE_PREFIX)
    }


def demo_specs(out: Path, method: str = "ppo") -> dict[str, dict[str, Any]]:
    """The job specs of the pipeline, each type's stage as its :data:`JOB_TYPES` entry gives it: SFT, a reward
    model when ``method`` needs one, the stages ``method``'s stage names (:func:`named_stages`; they stay named
    ``stage:<name>`` there), then ``method``; each later stage starts from the SFT folder."""
    info = JOB_TYPES[method]
    needs_rm = info.reward_model and "reward" not in info.demo  # trained against a reward model
    sft = sft_stage(method)
    specs = {sft: {"type": "sft", "name": f"demo-{sft}", "seed": SEED, **JOB_TYPES["sft"].demo}}
    task = TASKS[info.demo_task]
    if task.sft:
        specs[sft].update({k: v for k, v in task.sft.items() if k != "epochs"})
        specs[sft]["hyperparameters"] = {**specs[sft]["hyperparameters"], "epochs": task.sft["epochs"]}
    specs[sft]["model"] = "builtin:tiny"
    for stage in (["rm"] if needs_rm else []) + list(named_stages(method).values()) + [method]:
        specs[stage] = {"type": stage, "name": f"demo-{stage}", "seed": SEED, **JOB_TYPES[stage].demo,
                        "model": str(out / sft)}  # fmt: skip
    if needs_rm:
        specs[method]["reward_model"] = str(out / "rm")
    return specs


def sft_stage(method: str) -> str:
    """The name (and folder) of the SFT stage before ``method``: ``sft`` on the reviews task, ``sft-<task>``
    on another, so that pipelines of different tasks can share an output folder."""
    task = JOB_TYPES[method].demo_task
    return "sft" if task == "reviews" else f"sft-{task}"


@dataclass
class PolicyReport:
    success: float
    """Share of samples the task's rule accepts (reviews: positive; digits: the right digit)."""
    score: float | None
    """Mean reward-model score (None when the pipeline trained no reward model)."""
    kl: float
    """Mean summed per-token log-ratio to the reference (the SFT model; a distilled policy's: its teacher) on the
    policy's own samples."""
    length: float
    """Mean response length in tokens."""


@torch.inference_mode()
def evaluate_policy(
    policy_dir: str, reference_dir: str, reward_dir: str | None, rows: list[dict[str, Any]], task: Task
) -> PolicyReport:
    prompts = [row["prompt"] for row in rows]
    tokenizer = load_tokenizer(policy_dir)
    policy = load_causal_lm(policy_dir, tokenizer, SEED).eval()
    reference = load_causal_lm(reference_dir, tokenizer, SEED).eval()
    queries, query_mask = encode_prompts(tokenizer, prompts, 64)
    generator = torch.Generator().manual_seed(SEED)
    stops = stop_token_ids(policy, tokenizer)
    raw, _ = sample(policy, queries, query_mask, 24, TEMPERATURE, eos_token_id=stops, generator=generator)
    responses, mask, _ = truncate_after_stop(raw, stops, tokenizer.pad_token_id)
    query_responses = torch.cat([queries, responses], 1)
    attention_mask = torch.cat([query_mask, mask], 1)
    P = queries.shape[1]
    logprobs, _ = token_logprobs(policy, query_responses, attention_mask, P, TEMPERATURE)
    ref_logprobs, _ = token_logprobs(reference, query_responses, attention_mask, P, TEMPERATURE)
    texts = tokenizer.batch_decode(responses.masked_fill(mask == 0, tokenizer.pad_token_id), skip_special_tokens=True)
    return PolicyReport(
        success=sum(task.judge(row, text) for row, text in zip(rows, texts, strict=True)) / len(texts),
        score=_score(reward_dir, tokenizer, query_responses, attention_mask),
        kl=((logprobs - ref_logprobs) * mask).sum(1).mean().item(),
        length=mask.sum(1).float().mean().item(),
    )


def _score(
    reward_dir: str | None, tokenizer: PreTrainedTokenizerBase, query_responses: torch.Tensor, mask: torch.Tensor
) -> float | None:
    if reward_dir is None:
        return None
    reward_model = load_scalar_model(reward_dir, tokenizer, SEED).eval()
    return sequence_scores(reward_model, query_responses, mask).mean().item()


def rm_accuracy(reward_dir: str) -> float:
    tokenizer = load_tokenizer(reward_dir)
    model = load_scalar_model(reward_dir, tokenizer, SEED)
    rows = load_rows("builtin:reviews-prefs-eval", "preference")
    batches = [encode_pairs(tokenizer, rows[i : i + 64], 128) for i in range(0, len(rows), 64)]
    return evaluate_pairs(model, batches)[0]


@dataclass
class DemoReport:
    method: str
    """The job type trained after SFT."""
    task: str
    """The built-in task (:data:`TASKS`)."""
    prompts: int
    """Held-out prompts sampled once by each policy."""
    rm_eval_accuracy: float | None
    """Reward model's accuracy on the held-out preference pairs (None: the method trained none)."""
    sft: PolicyReport
    trained: PolicyReport
    """The policy ``method`` trained."""
    teacher: PolicyReport | None = None
    """The teacher a distilled policy learnt from (its KL to itself: 0), None for other methods; the KL of the
    other two is then to the teacher."""
    teacher_stage: str | None = None
    """The stage that trained the teacher."""

    def table(self) -> str:
        accuracy = "" if self.rm_eval_accuracy is None else f"; reward model eval accuracy {self.rm_eval_accuracy:.3f}"
        columns = [self.sft, self.trained] + ([self.teacher] if self.teacher else [])
        teacher = f"{'teacher (' + (self.teacher_stage or '').upper() + ')':>16}" if self.teacher else ""
        lines = [
            f"Held-out evaluation: {self.prompts} prompts, temperature {TEMPERATURE}{accuracy}",
            f"{'':<24}{'SFT':>10}{self.method.upper():>10}{teacher}",
        ]
        for label, attribute in (
            (TASKS[self.task].label, "success"),
            ("reward model score", "score"),
            ("reverse KL to teacher" if self.teacher else "KL to SFT reference", "kl"),
            ("response length", "length"),
        ):
            values = [getattr(report, attribute) for report in columns]
            if values[0] is not None:
                lines.append(
                    f"{label:<24}" + "".join(f"{v:>{w}.3f}" for v, w in zip(values, (10, 10, 16), strict=False))
                )
        return "\n".join(lines)


def run_demo(out: Path, train: Callable[[JobSpec, Path, str], None], method: str = "ppo") -> DemoReport:
    """Train the stages with ``train(spec, folder, label)`` (a ``stage:<name>`` naming that stage's folder), then
    compare the SFT policy with ``method``'s, and with the teacher of a distilled policy."""
    for stage, data in demo_specs(out, method).items():
        folders = {name: str(out / stage_name) for name, stage_name in named_stages(data["type"]).items()}
        train(JobSpec.model_validate({**data, **folders}), out / stage, stage)
    sft_dir, trained_dir = resolve_model_ref(str(out / sft_stage(method))), resolve_model_ref(str(out / method))
    rm_dir = resolve_model_ref(str(out / "rm")) if "rm" in demo_specs(out, method) else None
    teacher_stage = named_stages(method).get("teacher")
    teacher_dir = resolve_model_ref(str(out / teacher_stage)) if teacher_stage else None
    reference = teacher_dir or sft_dir
    task_name = JOB_TYPES[method].demo_task
    task = TASKS[task_name]
    rows = load_rows(task.eval_prompts, "prompts")[:EVAL_PROMPTS]
    return DemoReport(
        method=method,
        task=task_name,
        prompts=len(rows),
        rm_eval_accuracy=rm_accuracy(rm_dir) if rm_dir else None,
        sft=evaluate_policy(sft_dir, reference, rm_dir, rows, task),
        trained=evaluate_policy(trained_dir, reference, rm_dir, rows, task),
        teacher=evaluate_policy(teacher_dir, teacher_dir, rm_dir, rows, task) if teacher_dir else None,
        teacher_stage=teacher_stage,
    )
