"""Our PPO update against TRL's PPOTrainer (1.12.0) on the identical workload, and against the floor.

Both trainers start from the same saved weights (a random GPT-2 policy and a random GPT-2 reward model
with a scalar head, which also initialises the critic), use the same tokenizer (the built-in one) and the
same prompts, batch size, response length, 2 minibatches, 1 PPO epoch, temperature 0.7 and dtype, in one
of two cases:

- ``fixed``: every prompt exactly 16 tokens, no stop token (every response is full length): the same shapes
  at every step;
- ``real``: what a real job looks like: prompts of 4 to 48 tokens (left-padded, so the masks are padded),
  ``stop_token: "eos"``, and a policy that really stops: its end-of-sequence logit is raised (a random policy
  at GPT-2's vocabulary would almost never emit it) so that about 1.5 EOS fall in a response's length on
  average, and responses end at varied lengths. TRL runs with ``stop_token="eos"``, the floor's ``generate``
  with ``eos_token_id``.

Each contestant is a process of its own (its own heap, so TRL's ``gc.collect()`` calls walk TRL's objects
only). The warm-up updates (2 unless told) run in all contestants at once and are not counted; then they take
turns, one update at a time (ours, TRL, floor, ours, ...), so a slow phase of this shared machine hits all of
them alike (``benchmarks/race.py``). A contestant that dies leaves the race, which goes on without it.

The floor is what no PPO implementation can skip: one ``generate`` for the batch (Hugging Face's own),
one no-grad forward of the reference, reward and value models, and for each minibatch the forward,
backward and optimizer step of policy and value.

Peak memory is each contestant process's: RSS on CPU (peak ``ru_maxrss``; in brackets the peak above
the RSS the process had before loading any model), ``torch.cuda.max_memory_allocated`` on CUDA. The
memory races run ours and TRL at the memory size, full fine-tuning and LoRA, without and with
gradient checkpointing.

Ours reports the engine's own figures with each update (``time/rollout_s``, ``time/train_s``, the share of
decoding steps run compiled, the responses' EOS share and mean length) and at its end the decode statistics the
engine logs on ``engine.core.generate`` (which decode path ran, compiles and CUDA-graph recordings per shape).

Setup: ``make bench-deps`` (TRL for benchmarks only, next to the pinned stack, changing nothing of it:
``pip install --no-deps trl==1.12.0``, then ``datasets``, ``accelerate`` and ``jinja2``).

Run from the repository root: ``python -m benchmarks.ppo_vs_trl [--sizes tiny compute] [--updates 8]
[--no-memory]`` (about 20 minutes on 2 cores). On a GPU: ``python -m benchmarks.ppo_vs_trl --sizes small
--cases fixed real --dtype bfloat16 --contestants ours ours-lora trl floor``; ``bash benchmarks/gpu_check.sh``
runs the whole GPU check.

``--lora-speed`` races ours alone instead (TRL not needed): full fine-tuning, LoRA r=8 with the adapters folded
into the weights for the rollout (as jobs run), and LoRA unfused (every sampling step through the adapters).
``--logits --sizes vocab`` races ours (log-probs over the vocabulary in chunks of at most 256 MiB of logits) against
ours making each forward's whole (B, T, V) logits at once: time and peak memory.
"""

import argparse
import contextlib
import json
import logging
import os
import random
import resource
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from benchmarks.gpu_summary import memory_mib, race_section
from benchmarks.race import RaceOver, Result, Turn, race
from engine.builtin import reviews
from engine.callbacks import Callbacks, StopRequest
from engine.core.models import load_tokenizer, pick_device
from engine.core.ops import logprobs_from_logits, truncate_after_stop
from engine.run import run_job
from engine.spec.config import JobSpec

PROMPT_TOKENS = 16
"""The fixed case's prompt length."""
REAL_PROMPT_TOKENS = (4, 48)
"""The real case's shortest and longest prompt."""
EOS_PER_RESPONSE = 1.5
"""The real case: mean end-of-sequence tokens per response length, were sampling not stopped at the first
(per token, ``EOS_PER_RESPONSE / response``): about 78 % of responses stop before their last token."""
MINIBATCHES = 2
WARMUP = 2
TEMPERATURE = 0.7
LEARNING_RATE = 1e-5
Case = Literal["fixed", "real"]


@dataclass(frozen=True)
class Size:
    n_layer: int
    n_head: int
    n_embd: int
    batch: int
    response: int
    vocab: int | None = None
    """None: the built-in tokenizer's 574 tokens."""


SIZES = {
    "tiny": Size(n_layer=2, n_head=4, n_embd=128, batch=16, response=32),
    "compute": Size(n_layer=6, n_head=6, n_embd=384, batch=32, response=64),
    # The compute shapes with GPT-2's vocabulary and 2,048 response positions a minibatch: the logits race's size.
    "vocab": Size(n_layer=6, n_head=6, n_embd=384, batch=64, response=64, vocab=50257),
    # GPT-2 small's shapes and vocabulary (sampled ids beyond the built-in tokenizer are never decoded).
    "small": Size(n_layer=12, n_head=12, n_embd=768, batch=64, response=128, vocab=50257),
    # A 1B-class shape (16 layers, 2048 wide, GPT-2's vocabulary): how the ratios hold as models grow.
    "1b": Size(n_layer=16, n_head=16, n_embd=2048, batch=64, response=128, vocab=50257),
}
BF16_PEAK_TFLOPS = 790.0
"""The dense bf16 peak the report compares with on CUDA (an H200's sustained figure; ``--peak-tflops``)."""


def update_flops(size: Size, prompt_tokens: int = PROMPT_TOKENS) -> float:
    """Floating-point operations one PPO update needs at ``size`` with prompts padded to ``prompt_tokens`` and
    full-length responses (2 per multiply-add; backward twice the forward): sampling the responses (a forward
    per new token, with the LM head), the rollout's reference, reward and value forwards over prompt + response,
    and per minibatch the policy's and value's forward and backward. Attention's score and mix products are
    counted at their mean context. Padding and tokens after a stop are computed like any other."""
    d, L, vocab = size.n_embd, size.n_layer, size.vocab or 574
    context = prompt_tokens + size.response

    def per_token(head: bool, mean_context: float) -> float:
        return 2 * (12 * L * d * d + (d * vocab if head else d)) + 4 * L * d * mean_context

    sampled = size.batch * size.response * per_token(True, prompt_tokens + size.response / 2)
    tokens = size.batch * context
    forward_lm, forward_scalar = tokens * per_token(True, context / 2), tokens * per_token(False, context / 2)
    rollout = forward_lm + 2 * forward_scalar  # reference; reward and value
    training = 3 * (forward_lm + forward_scalar)  # policy and value, forward + backward
    return sampled + rollout + training


@dataclass(frozen=True)
class Setting:
    dtype: str = "float32"
    lora: bool = False
    """LoRA r=8 on all linear layers (TRL: on the policy only; its critic stays fully trained)."""
    gradient_checkpointing: bool = False


@dataclass(frozen=True)
class Workload:
    dir: Path
    size: Size
    case: Case = "fixed"

    @property
    def policy(self) -> str:
        return str(self.dir / "policy")

    @property
    def reward(self) -> str:
        return str(self.dir / "reward")

    @property
    def prompts(self) -> Path:
        return self.dir / "prompts.jsonl"

    @property
    def prompt_tokens(self) -> int:
        """The longest prompt: every batch is left-padded to about this."""
        return PROMPT_TOKENS if self.case == "fixed" else REAL_PROMPT_TOKENS[1]

    @property
    def stop_token(self) -> Literal["eos"] | None:
        return None if self.case == "fixed" else "eos"

    def prompt_ids(self) -> list[list[int]]:
        return [json.loads(line)["ids"] for line in self.prompts.read_text().splitlines()]


def corpus_prompts(tokenizer: PreTrainedTokenizerBase, lengths: list[int]) -> list[tuple[str, list[int]]]:
    """Prompts of the given token ``lengths``: consecutive windows of the reviews corpus that survive decode +
    encode, so each trainer's tokenization gives back the same ids."""
    text = " ".join(r["prompt"] + r["completion"] for r in reviews.sft_rows("train"))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts: list[tuple[str, list[int]]] = []
    start = 0
    while len(prompts) < len(lengths):
        window = ids[start : start + lengths[len(prompts)]]
        if len(window) < lengths[len(prompts)]:
            raise RuntimeError("not enough prompts")
        decoded = tokenizer.decode(window)
        if tokenizer(decoded, add_special_tokens=False)["input_ids"] == window:
            prompts.append((decoded, window))
        start += len(window) + 1
    return prompts


@torch.no_grad()
def raise_eos_logit(policy: GPT2LMHeadModel, eos: int, rate: float, probe: torch.Tensor) -> float:
    """Make a random policy emit ``eos`` at about ``rate`` per sampled token (at TEMPERATURE): its final layer
    norm gets a bias of norm 4 along a random direction u, and EOS's (tied) embedding becomes k·u, with k found by
    bisection so that the mean EOS probability over the positions of ``probe`` (B, L), token ids that are not
    EOS, is ``rate``. The other tokens' logits move by noise (their embeddings are nearly orthogonal to u). Returns
    that mean probability."""
    d = policy.config.n_embd
    u = torch.randn(d, generator=torch.Generator().manual_seed(1), device="cpu").to(policy.device)
    u /= u.norm()
    policy.transformer.ln_f.bias += 4.0 * u
    hidden = policy.transformer(input_ids=probe).last_hidden_state.float()  # (B, L, d)
    logits = hidden @ policy.lm_head.weight.float().T / TEMPERATURE  # (B, L, V)
    logits[..., eos] = float("-inf")
    others = logits.logsumexp(-1)  # (B, L)
    along = hidden @ u / TEMPERATURE  # (B, L): EOS's logit per unit of k

    def eos_probability(k: float) -> float:
        return torch.sigmoid(k * along - others).mean().item()

    low, high = 0.0, 1.0
    while eos_probability(high) < rate:
        high *= 2
    for _ in range(40):
        low, high = (low, (low + high) / 2) if eos_probability((low + high) / 2) > rate else ((low + high) / 2, high)
    policy.transformer.wte.weight[eos] = high * u  # the LM head's row too: GPT-2 ties them
    return eos_probability(high)


def make_workload(size: Size, root: Path, case: Case = "fixed", dtype: str = "float32") -> Workload:
    """Save the starting weights (in ``dtype``), tokenizer and prompts that every contestant loads; the weights
    are made on the GPU when there is one."""
    work = Workload(root, size, case)
    tokenizer = load_tokenizer("builtin:tiny")
    config = GPT2Config(
        vocab_size=size.vocab or len(tokenizer),
        n_positions=max(128, work.prompt_tokens + size.response),
        n_layer=size.n_layer,
        n_head=size.n_head,
        n_embd=size.n_embd,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    torch.manual_seed(0)
    with torch.device(pick_device()):
        policy, reward = GPT2LMHeadModel(config), GPT2ForSequenceClassification(config)
        if case == "real":
            probe = torch.randint(2, config.vocab_size, (16, 64))  # ids 0 and 1: pad and EOS
            rate = raise_eos_logit(policy, tokenizer.eos_token_id, EOS_PER_RESPONSE / size.response, probe)
            print(f"{size}: EOS logit raised to a mean EOS probability of {rate:.4f} per token")
    for model, path in ((policy, work.policy), (reward, work.reward)):
        model.to(getattr(torch, dtype)).save_pretrained(path)
        tokenizer.save_pretrained(path)
    del policy, reward, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the contestants' memory, not this process's
    rng = random.Random(0)
    lengths = [PROMPT_TOKENS if case == "fixed" else rng.randint(*REAL_PROMPT_TOKENS) for _ in range(256)]
    prompts = corpus_prompts(tokenizer, lengths)
    work.prompts.write_text("".join(json.dumps({"prompt": p, "ids": ids}) + "\n" for p, ids in prompts))
    return work


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def peak_memory_mib(device: torch.device, baseline_mib: float) -> tuple[float, float | None]:
    """(peak, peak above ``baseline_mib``): CUDA allocations, or the process's RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20, None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak, peak - baseline_mib


# --- the contestants: each runs up to `updates` PPO updates, calling turn.begin() once and turn.end() per
# update, and stops when the race says so; each returns what it knows at the end beyond memory ----------------

KEPT_METRICS = (
    "time/rollout_s",
    "time/train_s",
    "time/step_s",
    "rollout/compiled_fraction",
    "response/eos_fraction",
    "response/length_mean",
)
"""The engine's metrics that ours reports with each update."""


class DecodeStats(logging.Handler):
    """Keeps the decoding statistics the engine logs at the end of a job: a record on ``engine.core.generate`` whose
    ``decode_stats`` is a dict (``path``, ``compiled_steps``, ``eager_steps``, ``compiles`` and ``recordings``
    per shape, ``cudagraph_skips``, ``fallback``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.stats: dict[str, Any] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        stats = getattr(record, "decode_stats", None)
        if isinstance(stats, dict):
            self.stats = stats


def run_ours(work: Workload, updates: int, setting: Setting, turn: Turn, out: Path) -> dict[str, Any]:
    class Timed(Callbacks):
        def on_start(self, start_step: int, total_steps: int) -> None:
            turn.begin()

        def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
            turn.end({name: metrics[name] for name in KEPT_METRICS if name in metrics})

        def should_stop(self) -> StopRequest | None:
            return "cancel" if turn.stopped else None

    decode = DecodeStats()
    logger = logging.getLogger("engine.core.generate")
    logger.setLevel(logging.INFO)
    logger.addHandler(decode)
    s = work.size
    spec = JobSpec.model_validate(
        {
            "type": "ppo",
            "model": work.policy,
            "reward_model": work.reward,
            "dataset": str(work.prompts),
            "checkpoint_every": 1_000_000,
            "lora": {"r": 8, "alpha": 16} if setting.lora else None,
            "hyperparameters": {
                "total_steps": updates + 1,  # never reached (it would checkpoint): the race stops the job first
                "batch_size": s.batch,
                "mini_batch_size": s.batch // MINIBATCHES,
                "ppo_epochs": 1,
                "max_prompt_length": work.prompt_tokens,
                "response_length": s.response,
                "stop_token": work.stop_token,
                "temperature": TEMPERATURE,
                "learning_rate": LEARNING_RATE,
                "dtype": setting.dtype,
                "gradient_checkpointing": setting.gradient_checkpointing,
            },
        }
    )
    result = run_job(spec, out, Timed())
    print(f"ours{' with LoRA' if setting.lora else ''}: the job ended {result.status} at step {result.step}")
    return {"decode_stats": decode.stats}


def run_trl(work: Workload, updates: int, setting: Setting, turn: Turn, out: Path) -> dict[str, Any]:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    class Timed(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            turn.begin()

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            turn.end()
            if turn.stopped:  # TRL's PPO loop reads no control.should_training_stop
                raise RaceOver

    s = work.size
    torch_dtype = getattr(torch, setting.dtype)
    lora = setting.lora
    tokenizer = load_tokenizer(work.policy)
    tokenizer.padding_side = "left"  # TRL's collator pads the prompts; the built-in tokenizer's side already
    policy = AutoModelForCausalLM.from_pretrained(work.policy, dtype=torch_dtype)
    ref = None if lora else AutoModelForCausalLM.from_pretrained(work.policy, dtype=torch_dtype)
    value = AutoModelForSequenceClassification.from_pretrained(work.reward, num_labels=1, dtype=torch_dtype)
    reward = AutoModelForSequenceClassification.from_pretrained(work.reward, num_labels=1, dtype=torch_dtype)
    dataset = Dataset.from_dict({"input_ids": work.prompt_ids()})
    config = PPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=s.batch,
        gradient_accumulation_steps=1,
        num_mini_batches=MINIBATCHES,
        num_ppo_epochs=1,
        local_rollout_forward_batch_size=s.batch,
        response_length=s.response,
        stop_token=work.stop_token,
        temperature=TEMPERATURE,
        learning_rate=LEARNING_RATE,
        total_episodes=s.batch * (updates + 1),  # never reached: the race stops it first
        num_sample_generations=0,
        save_strategy="no",
        bf16=False,  # the weights are loaded in `dtype` already, as ours are
        gradient_checkpointing=setting.gradient_checkpointing,
        report_to=[],
        log_level="error",
        seed=0,
    )
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM") if lora else None
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=dataset,
        eval_dataset=dataset,
        callbacks=[Timed()],
        peft_config=peft_config,
    )
    for quiet in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(quiet)
    trainer.train()
    return {}


def left_padded(batch: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids left-padded to the longest and their mask: (B, P) each."""
    P = max(map(len, batch))
    ids = torch.tensor([[pad] * (P - len(seq)) + seq for seq in batch], device=device)
    mask = torch.tensor([[0] * (P - len(seq)) + [1] * len(seq) for seq in batch], device=device)
    return ids, mask


def run_floor(work: Workload, updates: int, setting: Setting, turn: Turn, out: Path) -> dict[str, Any]:
    """The parts of an update every implementation has to do, each done once, the plain Hugging Face way."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    s, device, torch_dtype = work.size, pick_device(), getattr(torch, setting.dtype)

    def causal() -> PreTrainedModel:
        return AutoModelForCausalLM.from_pretrained(work.policy, dtype=torch_dtype).to(device)

    def scalar() -> PreTrainedModel:
        return AutoModelForSequenceClassification.from_pretrained(work.reward, num_labels=1, dtype=torch_dtype).to(
            device
        )

    policy, ref, value, reward = causal(), causal().eval(), scalar(), scalar().eval()
    optimizer = torch.optim.AdamW([*policy.parameters(), *value.parameters()], lr=LEARNING_RATE)
    prompts, eos, pad = work.prompt_ids(), policy.config.eos_token_id, policy.config.pad_token_id
    stops = [] if work.stop_token is None else [eos]
    # the fixed case: full-length responses whatever is sampled; the real one: stop once every row has EOS
    lengths = {"min_new_tokens": s.response} if work.stop_token is None else {"eos_token_id": eos}
    mb = s.batch // MINIBATCHES
    turn.begin()
    for update in range(updates + 1):  # the last is never reached: the race stops it first
        start = update * s.batch % len(prompts)
        queries, query_mask = left_padded((prompts[start:] + prompts)[: s.batch], pad, device)  # (B, P)
        P = queries.shape[1]
        with torch.no_grad():
            qr = policy.generate(
                input_ids=queries,
                attention_mask=query_mask,
                do_sample=True,
                max_new_tokens=s.response,
                temperature=TEMPERATURE,
                top_k=0,
                pad_token_id=pad,
                **lengths,
            )
        responses, response_mask, _ = truncate_after_stop(qr[:, P:], stops, pad)  # (B, T)
        qr, mask = torch.cat([queries, responses], 1), torch.cat([query_mask, response_mask], 1)  # (B, P + T)
        with torch.inference_mode():
            ref(input_ids=qr, attention_mask=mask)
            reward(input_ids=qr, attention_mask=mask)
            value(input_ids=qr, attention_mask=mask)
        for start in range(0, s.batch, mb):
            batch, batch_mask, kept = (
                qr[start : start + mb],
                mask[start : start + mb],
                response_mask[start : start + mb],
            )
            logits = policy(input_ids=batch, attention_mask=batch_mask).logits[:, P - 1 : -1]
            logprobs = logprobs_from_logits(logits / TEMPERATURE, batch[:, P:])  # (mb, T)
            policy_loss = -(logprobs * kept).sum() / kept.sum()
            hidden = value.transformer(input_ids=batch, attention_mask=batch_mask).last_hidden_state
            values = value.score(hidden)[:, P - 1 : -1, 0]  # (mb, T)
            (policy_loss + (values.float().square() * kept).sum() / kept.sum()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        turn.end()
        if turn.stopped:
            break
    return {}


def run_ours_lora(work: Workload, updates: int, setting: Setting, turn: Turn, out: Path) -> dict[str, Any]:
    return run_ours(work, updates, replace(setting, lora=True), turn, out)


def run_ours_lora_unfused(work: Workload, updates: int, setting: Setting, turn: Turn, out: Path) -> dict[str, Any]:
    """Ours with LoRA as before rollouts folded the adapters: every sampling step through the adapters (by
    replacing ``engine.core.rollout.folded_adapters``, where the rollout's sampling and critic call it)."""
    import engine.core.rollout

    engine.core.rollout.folded_adapters = lambda model, rounded=False: contextlib.nullcontext()  # type: ignore[assignment]
    return run_ours_lora(work, updates, setting, turn, out)


def run_ours_whole_logits(work: Workload, updates: int, setting: Setting, turn: Turn, out: Path) -> dict[str, Any]:
    """Ours with each forward's (B, T, V) logits made at once, as before log-probs were taken in chunks."""
    import engine.core.models

    engine.core.models.LOGITS_CHUNK_BYTES = 2**62
    return run_ours(work, updates, setting, turn, out)


CONTESTANTS: dict[str, Callable[[Workload, int, Setting, Turn, Path], dict[str, Any]]] = {
    "ours": run_ours,
    "trl": run_trl,
    "floor": run_floor,
    "ours-lora": run_ours_lora,
    "ours-lora-unfused": run_ours_lora_unfused,
    "ours-whole-logits": run_ours_whole_logits,
}
"""The PPO races' contestants: ours, TRL's and the floor, and ours with LoRA (adapters folded into the weights for
the rollout where the engine folds them); the CPU LoRA speed race's: ours full, with LoRA, and with LoRA never
folded; the logits race's: ours (log-probs in chunks of at most 256 MiB of logits) and ours with the whole logits
at once."""


def contestant(name: str, work: Workload, updates: int, setting: Setting, conn: Connection) -> None:
    """A child process: run up to ``updates`` updates of ``name`` in turns, then send its peak memory and what
    else it reports at its end."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s")
    transformers.logging.disable_progress_bar()
    device = pick_device()
    turn = Turn(conn, torch.cuda.synchronize if device.type == "cuda" else lambda: None)
    baseline_mib = rss_mib()
    """RSS before any model is loaded."""
    final: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.suppress(RaceOver):  # RaceOver: stopped before update 1
        final = CONTESTANTS[name](work, updates, setting, turn, Path(tmp))
    peak, above = peak_memory_mib(device, baseline_mib)
    turn.finish({**final, "peak_mib": peak, "above_baseline_mib": above})


def race_record(
    size_name: str, work: Workload, setting: Setting, results: dict[str, Result], peak_tflops: float
) -> dict[str, Any]:
    """One race as the report and the GPU check's summary read it (JSON-ready)."""
    return {
        "size": size_name,
        "shape": asdict(work.size),
        "case": work.case,
        "prompt_tokens": work.prompt_tokens,
        "minibatches": MINIBATCHES,
        "setting": asdict(setting),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "flops": update_flops(work.size, work.prompt_tokens),
        "peak_tflops": peak_tflops,
        "contestants": {name: asdict(r) for name, r in results.items()},
    }


class Report:
    """The races of one run: each printed when it ends, all saved to ``path`` (JSON, when given) after every round,
    so a run killed from outside leaves what it had measured."""

    def __init__(self, path: Path | None, peak_tflops: float) -> None:
        self.path = path
        self.peak_tflops = peak_tflops
        self.records: list[dict[str, Any]] = []

    def race(
        self,
        size_name: str,
        work: Workload,
        names: list[str],
        updates: int,
        setting: Setting,
        warmup: int = WARMUP,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """Race ``names`` on ``work``; returns the race's record."""
        contestants = {name: (contestant, (name, work, warmup + updates, setting)) for name in names}
        index = len(self.records)
        self.records.append({})

        def save(results: dict[str, Result]) -> None:
            self.records[index] = race_record(size_name, work, setting, results, self.peak_tflops)
            if self.path is not None:
                self.path.write_text(json.dumps(self.records, indent=1))

        save(race(contestants, updates, warmup, deadline, on_round=save))
        print(race_section(self.records[index]), flush=True)
        return self.records[index]


def main() -> None:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", default=["tiny", "compute"], choices=SIZES, help="speed races")
    parser.add_argument("--cases", nargs="+", default=["fixed"], choices=["fixed", "real"], help="speed races")
    parser.add_argument(
        "--contestants", nargs="+", default=["ours", "trl", "floor"], choices=CONTESTANTS, help="speed races"
    )
    parser.add_argument("--updates", type=int, default=8, help="counted updates per contestant, after the warm-up")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="warm-up updates, all contestants at once")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--peak-tflops", type=float, default=BF16_PEAK_TFLOPS, help="CUDA: the peak to compare with")
    parser.add_argument("--memory-size", default="compute", choices=SIZES, help="size of the memory races")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory races")
    parser.add_argument(
        "--lora-speed", action="store_true", help="race ours full, with LoRA, and with LoRA unfused instead (no TRL)"
    )
    parser.add_argument(
        "--logits", action="store_true", help="race ours against ours with whole logits instead (no TRL)"
    )
    parser.add_argument(
        "--time-limit", type=float, help="seconds from the start: no counted update begins that would end past it"
    )
    parser.add_argument("--json", type=Path, help="save every race's figures here (after each round)")
    args = parser.parse_args()
    transformers.logging.disable_progress_bar()
    deadline = None if args.time_limit is None else started + args.time_limit
    report = Report(args.json, args.peak_tflops)

    print(f"device {pick_device()}, dtype {args.dtype}, torch threads {torch.get_num_threads()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for size_name in args.sizes:
            for case in args.cases:
                work = make_workload(SIZES[size_name], Path(tmp) / f"{size_name}-{case}", case, args.dtype)
                names = args.contestants
                if args.lora_speed:
                    names = ["ours", "ours-lora", "ours-lora-unfused"]
                elif args.logits:
                    names = ["ours", "ours-whole-logits"]
                report.race(size_name, work, names, args.updates, Setting(args.dtype), args.warmup, deadline)
        if args.no_memory or args.lora_speed or args.logits:
            return
        # Peak memory is reached within the first update; one counted update after the warm-up is enough.
        work = make_workload(SIZES[args.memory_size], Path(tmp) / f"memory-{args.memory_size}")
        for checkpointing in (False, True):
            memory = {}
            for lora in (False, True):
                setting = Setting(args.dtype, lora, checkpointing)
                record = report.race(args.memory_size, work, ["ours", "trl"], 1, setting, args.warmup)
                memory[lora] = memory_mib(record["contestants"]["ours"])
            print(f"memory, ours LoRA / ours full: {memory[True] / memory[False]:.3f}")


if __name__ == "__main__":
    main()
