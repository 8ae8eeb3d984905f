"""The "auto" hyperparameters: what a job spec leaves out, chosen from the size of its training file and the width of
its model. Torch-free and pure; the fine-tuning API (``api/fine_tuning.py``) and ``POST /v1/jobs`` both choose with
these rules, and the README's job-spec section documents them.

- Epochs (sft, rm, dpo) follow OpenAI's documented ``n_epochs: "auto"``: 3, more for a small file so that training
  sees at least 100 examples (at most 25 epochs), fewer past 25,000 examples (at least 1). PPO and GRPO take the same
  number of passes over their prompts, as ``total_steps`` (TRL's PPO and GRPO also default to 3 epochs of prompts).
- The batch of the fine-tuning API's ``batch_size: "auto"`` is about 0.2 % of the rows, 1 to 256 (OpenAI's rule).
- The learning rate (sft, rm, dpo) falls as 1 / the model's hidden size: each type's common full fine-tuning rate
  at a 4096-wide model (TRL's defaults, the papers') × 4096 / width, as μP scales Adam's rate of hidden weights
  (Yang et al., arXiv:2203.03466) and as GPT-3's rates fall from 768 to 4096 wide (arXiv:2005.14165, Table 2.1);
  LoRA trains at 10 × the full rate (as Tinker's ``get_lr`` and common LoRA practice do). PPO and GRPO keep their field
  defaults: their rates depend on the reward's scale as much as on the model.
"""

import math
from collections.abc import Mapping
from typing import Any

from engine.spec.config import JOB_TYPES

MIN_TARGET_EXAMPLES = 100
"""Auto epochs: enough that training sees at least this many examples (at most ``MAX_AUTO_EPOCHS``)..."""
MAX_TARGET_EXAMPLES = 25_000
"""... and few enough that it sees at most this many (at least one epoch); ``DEFAULT_EPOCHS`` in between."""
DEFAULT_EPOCHS = 3
MAX_AUTO_EPOCHS = 25
MAX_AUTO_BATCH = 256

REFERENCE_WIDTH = 4096
"""The hidden size at which the rates of :data:`FULL_RATES` are the common ones (a 7B-class model)."""
FULL_RATES: dict[str, float] = {
    "sft": 2e-5,  # TRL SFTConfig.learning_rate
    "rm": 1e-5,  # InstructGPT's 6B reward model: 9e-6 (arXiv:2203.02155, appendix C.2)
    "dpo": 1e-6,  # TRL DPOConfig.learning_rate; the DPO paper's (arXiv:2305.18290, appendix B)
}
"""Full fine-tuning learning rate of each type at :data:`REFERENCE_WIDTH`; types not listed keep their default."""
LORA_FACTOR = 10.0
"""LoRA's rate over the full fine-tuning rate."""
MAX_AUTO_LEARNING_RATE = 1e-2
"""No auto rate above this, however narrow the model."""
WIDTH_NAMES = ("hidden_size", "n_embd", "d_model")
"""The names a transformers ``config.json`` gives its hidden size (Llama/Qwen2/Mistral/GPT-NeoX, GPT-2, T5/OPT)."""


def auto_epochs(rows: int) -> int:
    """Passes over a training file of ``rows`` examples (OpenAI's documented ``n_epochs: "auto"``)."""
    if rows * DEFAULT_EPOCHS < MIN_TARGET_EXAMPLES:
        return min(MAX_AUTO_EPOCHS, math.ceil(MIN_TARGET_EXAMPLES / rows))
    if rows * DEFAULT_EPOCHS > MAX_TARGET_EXAMPLES:
        return max(1, MAX_TARGET_EXAMPLES // rows)
    return DEFAULT_EPOCHS


def auto_batch_size(rows: int) -> int:
    """About 0.2 % of the examples, between 1 and 256 (OpenAI's documented ``batch_size: "auto"``)."""
    return max(1, min(MAX_AUTO_BATCH, round(rows * 0.002)))


def auto_total_steps(rows: int, batch_size: int) -> int:
    """PPO and GRPO steps of ``batch_size`` prompts making :func:`auto_epochs` passes over ``rows`` prompts."""
    return max(1, math.ceil(auto_epochs(rows) * rows / batch_size))


def model_width(config: Mapping[str, Any]) -> int | None:
    """The hidden size a model's ``config.json`` gives (that of its ``text_config`` for a multimodal one)."""
    for name in WIDTH_NAMES:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    text_config = config.get("text_config")
    return model_width(text_config) if isinstance(text_config, Mapping) else None


def auto_learning_rate(job_type: str, width: int, lora: bool) -> float | None:
    """The learning rate of a ``job_type`` job on a model ``width`` wide (None: the type keeps its default)."""
    if job_type not in FULL_RATES:
        return None
    rate = FULL_RATES[job_type] * REFERENCE_WIDTH / width * (LORA_FACTOR if lora else 1.0)
    return float(f"{min(rate, MAX_AUTO_LEARNING_RATE):.3g}")


def auto_hyperparameters(
    job_type: str, given: Mapping[str, Any], rows: int | None, width: int | None, lora: bool
) -> dict[str, Any]:
    """The hyperparameters chosen for what ``given`` (a spec's ``hyperparameters`` as sent) leaves out, from the
    training file's ``rows`` and the model's ``width`` (None: not known, and nothing is chosen from it). A value
    given always wins; so do ``max_steps`` over auto epochs."""
    chosen: dict[str, Any] = {}
    fields = JOB_TYPES[job_type].config.model_fields
    if rows is not None and rows > 0:
        if "epochs" in fields and "epochs" not in given and given.get("max_steps") is None:
            chosen["epochs"] = float(auto_epochs(rows))
        if "total_steps" in fields and "total_steps" not in given:
            batch_size = given.get("batch_size", fields["batch_size"].default)
            if isinstance(batch_size, int) and batch_size > 0:
                chosen["total_steps"] = auto_total_steps(rows, batch_size)
    if width is not None and "learning_rate" not in given:
        rate = auto_learning_rate(job_type, width, lora)
        if rate is not None:
            chosen["learning_rate"] = rate
    return chosen
