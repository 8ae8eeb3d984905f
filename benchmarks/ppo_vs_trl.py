"""Our PPO update against TRL's PPOTrainer (1.12.0) on the identical workload, and against the floor.

Both trainers start from the same saved weights (a random GPT-2 policy and a random GPT-2 reward model
with a scalar head, which also initialises the critic), use the same tokenizer (the built-in one) and the
same prompts (all exactly 16 tokens), batch size, response length (no stop token: every response is
full length), 2 minibatches, 1 PPO epoch, temperature 0.7 and dtype. Each contestant is a process of its
own (its own heap, so TRL's ``gc.collect()`` calls walk TRL's objects only); once all have loaded their
models they take turns, one update at a time (ours, TRL, floor, ours, ...), so a slow phase of this
shared machine hits all of them alike. The first two updates of each are warm-up and not counted.

The floor is what no PPO implementation can skip: one ``generate`` for the batch (Hugging Face's own),
one no-grad forward of the reference, reward and value models, and for each minibatch the forward,
backward and optimizer step of policy and value.

Peak memory is each contestant process's: RSS on CPU (peak ``ru_maxrss``; in brackets the peak above
the RSS the process had before loading any model), ``torch.cuda.max_memory_allocated`` on CUDA. The
memory races run ours and TRL at the memory size, full fine-tuning and LoRA, without and with
gradient checkpointing.

Setup: ``make bench-deps`` (TRL for benchmarks only, next to the pinned stack, changing nothing of it:
``pip install --no-deps trl==1.12.0``, then ``datasets``, ``accelerate`` and ``jinja2``).

Run: ``python benchmarks/ppo_vs_trl.py [--sizes tiny compute] [--updates 8] [--no-memory]`` (about
20 minutes on 2 cores).
On a GPU: ``python benchmarks/ppo_vs_trl.py --sizes small --dtype bfloat16`` (GPT-2-small shapes).

``--lora-speed`` races ours alone instead (TRL not needed): full fine-tuning, LoRA r=8 with the adapters folded
into the weights for the rollout (as jobs run), and LoRA unfused (every sampling step through the adapters).
``--logits --sizes vocab`` races ours (log-probs over the vocabulary in chunks of at most 256 MiB of logits) against
ours making each forward's whole (B, T, V) logits at once: time and peak memory.
"""

import argparse
import contextlib
import json
import multiprocessing
import os
import resource
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerBase

from engine.builtin import reviews
from engine.callbacks import Callbacks
from engine.config import JobSpec
from engine.models import load_tokenizer, pick_device
from engine.ops import logprobs_from_logits
from engine.run import run_job

PROMPT_TOKENS = 16
MINIBATCHES = 2
WARMUP = 2
TEMPERATURE = 0.7
LEARNING_RATE = 1e-5


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


def update_flops(size: Size) -> float:
    """Floating-point operations one PPO update needs at ``size`` (2 per multiply-add; backward twice the
    forward): sampling the responses (a forward per new token, with the LM head), the rollout's reference,
    reward and value forwards over prompt + response, and per minibatch the policy's and value's forward and
    backward. Attention's score and mix products are counted at their mean context."""
    d, L, vocab = size.n_embd, size.n_layer, size.vocab or 574
    context = PROMPT_TOKENS + size.response

    def per_token(head: bool, mean_context: float) -> float:
        return 2 * (12 * L * d * d + (d * vocab if head else d)) + 4 * L * d * mean_context

    sampled = size.batch * size.response * per_token(True, PROMPT_TOKENS + size.response / 2)
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

    @property
    def policy(self) -> str:
        return str(self.dir / "policy")

    @property
    def reward(self) -> str:
        return str(self.dir / "reward")

    @property
    def prompts(self) -> Path:
        return self.dir / "prompts.jsonl"

    def prompt_ids(self) -> list[list[int]]:
        return [json.loads(line)["ids"] for line in self.prompts.read_text().splitlines()]


def sixteen_token_prompts(tokenizer: PreTrainedTokenizerBase, n: int) -> list[tuple[str, list[int]]]:
    """Windows of exactly PROMPT_TOKENS tokens cut from the reviews corpus that survive decode + encode."""
    text = " ".join(r["prompt"] + r["completion"] for r in reviews.sft_rows("train"))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = []
    for start in range(0, len(ids) - PROMPT_TOKENS, PROMPT_TOKENS + 1):
        window = ids[start : start + PROMPT_TOKENS]
        decoded = tokenizer.decode(window)
        if tokenizer(decoded, add_special_tokens=False)["input_ids"] == window:
            prompts.append((decoded, window))
        if len(prompts) == n:
            return prompts
    raise RuntimeError("not enough prompts")


def make_workload(size: Size, root: Path) -> Workload:
    """Save the starting weights, tokenizer and prompts that both trainers load."""
    work = Workload(root, size)
    tokenizer = load_tokenizer("builtin:tiny")
    config = GPT2Config(
        vocab_size=size.vocab or len(tokenizer),
        n_positions=max(128, PROMPT_TOKENS + size.response),
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
    GPT2LMHeadModel(config).save_pretrained(work.policy)
    GPT2ForSequenceClassification(config).save_pretrained(work.reward)
    for path in (work.policy, work.reward):
        tokenizer.save_pretrained(path)
    prompts = sixteen_token_prompts(tokenizer, 256)
    work.prompts.write_text("".join(json.dumps({"prompt": p, "ids": ids}) + "\n" for p, ids in prompts))
    return work


class Turn:
    """A contestant's side of the turn-taking: wait for "go", run one update, report its seconds.

    Each contestant is a process of its own (its own heap, so TRL's ``gc.collect()`` walks only TRL's
    objects, and its own peak memory). The parent hands out turns one at a time, round robin, only after
    every contestant has loaded its models, so no two ever compute at once.
    """

    def __init__(self, conn: Connection, device: torch.device) -> None:
        self.conn = conn
        self.device = device
        self.baseline_mib = rss_mib()
        """RSS before any model is loaded."""
        self._started = 0.0

    def begin(self) -> None:
        """Models are loaded: say so, wait for the first turn, start the clock."""
        self.conn.send("ready")
        self._wait()

    def end(self) -> None:
        """One update is done: report it and wait for the next turn."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.conn.send(time.perf_counter() - self._started)
        self._wait()

    def _wait(self) -> None:
        self.conn.recv()
        self._started = time.perf_counter()


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


# --- the three contestants: each runs `updates` PPO updates, calling begin() once and end() per update ----


def run_ours(work: Workload, updates: int, setting: Setting, turn: Turn, out: Path) -> None:

    class Timed(Callbacks):
        def on_start(self, start_step: int, total_steps: int) -> None:
            turn.begin()

        def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
            turn.end()

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
                "total_steps": updates,
                "batch_size": s.batch,
                "mini_batch_size": s.batch // MINIBATCHES,
                "ppo_epochs": 1,
                "max_prompt_length": PROMPT_TOKENS,
                "response_length": s.response,
                "stop_token": None,
                "temperature": TEMPERATURE,
                "learning_rate": LEARNING_RATE,
                "dtype": setting.dtype,
                "gradient_checkpointing": setting.gradient_checkpointing,
            },
        }
    )
    run_job(spec, out, Timed())


def run_trl(work: Workload, updates: int, setting: Setting, turn: Turn, out: Path) -> None:
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

    s = work.size
    torch_dtype = getattr(torch, setting.dtype)
    lora = setting.lora
    tokenizer = load_tokenizer(work.policy)
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
        stop_token=None,
        temperature=TEMPERATURE,
        learning_rate=LEARNING_RATE,
        total_episodes=s.batch * updates,
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


def run_floor(work: Workload, updates: int, setting: Setting, turn: Turn, out: Path) -> None:
    """The parts of an update every implementation has to do, each done once, the plain Hugging Face way."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    s, device, torch_dtype = work.size, pick_device(), getattr(torch, setting.dtype)

    def causal() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(work.policy, dtype=torch_dtype).to(device)

    def scalar() -> torch.nn.Module:
        return AutoModelForSequenceClassification.from_pretrained(work.reward, num_labels=1, dtype=torch_dtype).to(
            device
        )

    policy, ref, value, reward = causal(), causal().eval(), scalar(), scalar().eval()
    optimizer = torch.optim.AdamW([*policy.parameters(), *value.parameters()], lr=LEARNING_RATE)
    prompts = torch.tensor(work.prompt_ids(), device=device)
    mask = torch.ones_like(prompts)
    mb = s.batch // MINIBATCHES
    turn.begin()
    for update in range(updates):
        queries = prompts[update * s.batch % len(prompts) :][: s.batch]
        with torch.no_grad():
            qr = policy.generate(
                input_ids=queries,
                attention_mask=mask[: len(queries)],
                do_sample=True,
                max_new_tokens=s.response,
                min_new_tokens=s.response,
                temperature=TEMPERATURE,
                top_k=0,
                pad_token_id=0,
            )
        full = torch.ones_like(qr)
        with torch.inference_mode():
            ref(input_ids=qr, attention_mask=full)
            reward(input_ids=qr, attention_mask=full)
            value(input_ids=qr, attention_mask=full)
        for start in range(0, s.batch, mb):
            batch, batch_mask = qr[start : start + mb], full[start : start + mb]
            logits = policy(input_ids=batch, attention_mask=batch_mask).logits[:, PROMPT_TOKENS - 1 : -1]
            policy_loss = -logprobs_from_logits(logits / TEMPERATURE, batch[:, PROMPT_TOKENS:]).mean()
            hidden = value.transformer(input_ids=batch, attention_mask=batch_mask).last_hidden_state
            values = value.score(hidden)[:, PROMPT_TOKENS - 1 : -1]
            (policy_loss + values.float().square().mean()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        turn.end()


def run_ours_lora(work: Workload, updates: int, setting: Setting, turn: Turn, out: Path) -> None:
    run_ours(work, updates, replace(setting, lora=True), turn, out)


def run_ours_lora_unfused(work: Workload, updates: int, setting: Setting, turn: Turn, out: Path) -> None:
    """Ours with LoRA as before rollouts folded the adapters: every sampling step through the adapters."""
    import engine.rollout

    engine.rollout.folded_adapters = lambda model: contextlib.nullcontext()  # type: ignore[assignment]
    run_ours_lora(work, updates, setting, turn, out)


def run_ours_whole_logits(work: Workload, updates: int, setting: Setting, turn: Turn, out: Path) -> None:
    """Ours with each forward's (B, T, V) logits made at once, as before log-probs were taken in chunks."""
    import engine.models

    engine.models.LOGITS_CHUNK_BYTES = 2**62
    run_ours(work, updates, setting, turn, out)


CONTESTANTS = {
    "ours": run_ours,
    "trl": run_trl,
    "floor": run_floor,
    "ours-lora": run_ours_lora,
    "ours-lora-unfused": run_ours_lora_unfused,
    "ours-whole-logits": run_ours_whole_logits,
}
"""The PPO races' contestants: ours, TRL's and the floor; the LoRA speed race's: ours full, with LoRA (adapters
folded into the weights for the rollout), and with LoRA unfused; the logits race's: ours (log-probs in chunks
of at most 256 MiB of logits) and ours with the whole logits at once."""


def contestant(name: str, work: Workload, updates: int, setting: Setting, conn: Connection) -> None:
    """A child process: run ``updates`` updates of ``name`` in turns, then send its peak memory."""
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    device = pick_device()
    turn = Turn(conn, device)
    with tempfile.TemporaryDirectory() as tmp:
        CONTESTANTS[name](work, updates, setting, turn, Path(tmp))
    conn.send(peak_memory_mib(device, turn.baseline_mib))


@dataclass
class Result:
    seconds: list[float]
    """Per counted update (after the warm-up)."""
    peak_mib: float
    above_baseline_mib: float | None


def race(work: Workload, names: list[str], updates: int, setting: Setting) -> dict[str, Result]:
    """The contestants in processes of their own, taking turns one update at a time."""
    context = multiprocessing.get_context("spawn")
    conns, processes = {}, []
    for name in names:
        conns[name], child = context.Pipe()
        processes.append(context.Process(target=contestant, args=(name, work, WARMUP + updates, setting, child)))
        processes[-1].start()
    for name in names:
        if conns[name].recv() != "ready":
            raise RuntimeError(f"{name} did not start")
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(WARMUP + updates):
        for name in names:
            conns[name].send("go")
            seconds[name].append(conns[name].recv())
    results = {}
    for name in names:
        conns[name].send("go")  # past the last update: finish (a checkpoint, cleanup) and report memory
        peak, above = conns[name].recv()
        results[name] = Result(seconds[name][WARMUP:], peak, above)
    for process in processes:
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"a contestant failed (exit code {process.exitcode})")
    return results


# --- report ----------------------------------------------------------------------------------------------


def report(
    title: str, size: Size, results: dict[str, Result], peak_tflops: float = BF16_PEAK_TFLOPS
) -> dict[str, float]:
    """Print one race; returns each contestant's memory figure (above baseline on CPU, CUDA peak on GPU)."""
    tokens = size.batch * size.response
    median = {name: statistics.median(r.seconds) for name, r in results.items()}
    print(f"\n{title}: {asdict(size)}, prompts {PROMPT_TOKENS} tokens, {MINIBATCHES} minibatches, 1 epoch")
    memory_unit = "peak MiB" if results["ours"].above_baseline_mib is None else "peak RSS MiB (above baseline)"
    print(f"{'':<18}{'s/update':>9}{'min':>8}{'max':>8}{'tokens/s':>10}  {memory_unit}")
    if pick_device().type == "cuda":
        flops = update_flops(size)
        print(f"one update needs {flops / 1e12:.2f} TFLOP; at the bf16 peak ({peak_tflops:g} TFLOP/s) "
              f"{flops / 1e12 / peak_tflops:.3f} s")  # fmt: skip
        for name in median:
            achieved = flops / median[name] / 1e12
            print(f"{name}: {achieved:.1f} TFLOP/s, {achieved / peak_tflops:.1%} of the peak")
    memory = {}
    for name, r in results.items():
        above = "" if r.above_baseline_mib is None else f" ({r.above_baseline_mib:.0f})"
        print(
            f"{name:<18}{median[name]:>9.3f}{min(r.seconds):>8.3f}{max(r.seconds):>8.3f}{tokens / median[name]:>10.0f}"
            f"  {r.peak_mib:.0f}{above}"
        )
        memory[name] = r.peak_mib if r.above_baseline_mib is None else r.above_baseline_mib
    if "trl" in median:
        print(f"ours / trl: time {median['ours'] / median['trl']:.3f}, memory {memory['ours'] / memory['trl']:.3f}")
    for lora in ("ours-lora", "ours-lora-unfused"):
        if lora in median:
            print(f"{lora} / ours (full): time {median[lora] / median['ours']:.3f}")
    if "ours-whole-logits" in median:
        whole = "ours-whole-logits"
        print(f"ours / {whole}: time {median['ours'] / median[whole]:.3f}, memory {memory['ours'] / memory[whole]:.3f}")
    if "floor" in median:
        print(f"ours / floor: time {median['ours'] / median['floor']:.3f}")
    return memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", default=["tiny", "compute"], choices=SIZES, help="speed races")
    parser.add_argument("--updates", type=int, default=8, help="counted updates per contestant, after 2 warm-up")
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
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    print(f"device {pick_device()}, dtype {args.dtype}, torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        for size_name in args.sizes:
            work = make_workload(SIZES[size_name], Path(tmp) / size_name)
            if args.lora_speed:
                names = ["ours", "ours-lora", "ours-lora-unfused"]
                results = race(work, names, args.updates, Setting(args.dtype))
                report(f"{size_name}, full vs LoRA r=8", work.size, results, args.peak_tflops)
                continue
            if args.logits:
                results = race(work, ["ours", "ours-whole-logits"], args.updates, Setting(args.dtype))
                report(f"{size_name}, log-probs in chunks vs whole logits", work.size, results, args.peak_tflops)
                continue
            results = race(work, ["ours", "trl", "floor"], args.updates, Setting(args.dtype))
            report(f"{size_name}, full fine-tuning", work.size, results, args.peak_tflops)
        if args.no_memory or args.lora_speed or args.logits:
            return
        # Peak memory is reached within the first update; one counted update after the warm-up is enough.
        work = make_workload(SIZES[args.memory_size], Path(tmp) / f"memory-{args.memory_size}")
        for checkpointing in (False, True):
            memory = {}
            for lora in (False, True):
                setting = Setting(args.dtype, lora, checkpointing)
                title = f"{args.memory_size}, {'LoRA r=8' if lora else 'full fine-tuning'}"
                title += ", gradient checkpointing" if checkpointing else ""
                memory[lora] = report(title, work.size, race(work, ["ours", "trl"], 1, setting))
            print(f"memory, ours LoRA / ours full: {memory[True]['ours'] / memory[False]['ours']:.3f}")


if __name__ == "__main__":
    main()
