"""Per-step overhead of the Tinker-compatible API: the official ``tinker`` SDK's supervised loop against
``rlhf serve``, against the same loop on the engine operations in this process.

The model is the compute size of benchmarks/README.md: 6 layers, 384 dimensions (Qwen2's architecture, the
built-in tokenizer's 574 tokens), random weights, saved under the model root the server is started with. A step is
one ``forward_backward`` with ``cross_entropy`` over 32 datums of 64 tokens (random ids, every target weighted) and
one ``optim_step`` (Adam), on LoRA of rank 32 (the SDK's default) on every linear layer (the SDK makes LoRA training
clients only).

- **Server arm**: a ``ServiceClient`` and its training client; each step submits ``forward_backward`` and
  ``optim_step`` together and waits for both results, as the SDK's examples do. Its time is the client's wall clock
  between the ends of two steps, so it holds all the API adds: the protobuf body built and zstd-compressed, HTTP,
  the request stored in the database, the train worker finding it, the result stored, ``retrieve_future``'s long
  poll and the client decoding it.
- **Local arm**: :class:`engine.session.models.TrainingModel` in this process, built from the same folder with the
  same LoRA seed, given the same datums (decoded once from the SDK's protobuf, as the worker decodes them); each
  step its ``forward_backward`` and ``optim_step``.

The arms take turns in rounds (``--rounds``), each round ``--steps`` steps per arm after ``WARMUP_STEPS`` not
counted; the figure is the ratio of the median step times. Both arms use the same torch thread count
(``--threads``: ``torch.set_num_threads`` here, ``OMP_NUM_THREADS`` in the server's environment, which its train
worker inherits). While one arm runs the other idles: the server's worker only polls its empty queue, and this
process waits. The first step's loss of each arm is printed too: both compute the same function from the same
weights, so they agree to float rounding.

``--size tiny`` runs both arms on ``builtin:tiny`` with one 8-token datum instead, where a step computes next to
nothing: the difference of its arms is the API's fixed cost per step.

Run: ``python -m benchmarks.tinker_overhead [--steps 6] [--rounds 3] [--threads 1] [--size compute|tiny]``.
"""

import argparse
import itertools
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import tinker
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from engine.core.models import load_tokenizer, pick_device
from engine.session.models import Lora, TrainingModel
from engine.session.wire import Datum, decode_datums
from engine.spec.tinker_proto import ForwardBackwardRequest
from jobs.client import KEY_FILE
from jobs.demo import embedded_server

WARMUP_STEPS = 2
"""Steps of each arm and round not counted (the first allocates, the server's first also loads the model)."""
SIZES = {"compute": (32, 64), "tiny": (1, 8)}
"""(datums, tokens each) of a step at each ``--size``."""
MODEL = "compute"
"""The compute-size model's name under the server's model root."""
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0}


def save_model(root: Path) -> Path:
    """The compute-size Qwen2 model with random weights and the built-in tokenizer, in ``root/MODEL``."""
    tokenizer = load_tokenizer("builtin:tiny")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = root / MODEL
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def batch(vocab: int, datums: int, length: int) -> list[types.Datum]:
    rng = random.Random(0)
    data = []
    for _ in range(datums):
        tokens = [rng.randrange(3, vocab) for _ in range(length + 1)]
        targets = types.TensorData(data=tokens[1:], dtype="int64")
        weights = types.TensorData(data=[1.0] * length, dtype="float32")
        inputs = {"target_tokens": targets, "weights": weights}
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return data


def as_the_worker_reads_them(data: list[types.Datum]) -> list[Datum]:
    """The datums as the train worker decodes them from the SDK's request body."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id="local:train:0", seq_id=1,
    )  # fmt: skip
    body = forward_backward_request_to_proto(request).SerializeToString()
    return decode_datums(ForwardBackwardRequest.FromString(body))


def timed(step: Any, count: int) -> tuple[list[float], float]:
    """Step times (the interval between consecutive step ends) after the warm-up, and the first step's loss."""
    ends, first_loss = [time.perf_counter()], 0.0
    for i in range(WARMUP_STEPS + count):
        loss = step()
        ends.append(time.perf_counter())
        if i == 0:
            first_loss = loss
    intervals = [b - a for a, b in itertools.pairwise(ends)]
    return intervals[WARMUP_STEPS:], first_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="counted steps per arm and round (at least 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (local steps, server steps); at least 1")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in both arms")
    parser.add_argument(
        "--size",
        choices=list(SIZES),
        default="compute",
        help="compute (the figure), or tiny: builtin:tiny and one 8-token datum, the fixed cost per step",
    )
    parser.add_argument("--port", type=int, default=8779)
    args = parser.parse_args()
    if args.steps < 2 or args.rounds < 1 or args.threads < 1:
        parser.error("needs --steps >= 2, --rounds >= 1 and --threads >= 1")

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the server's worker processes
    os.environ["TINKER_TELEMETRY"] = "0"
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    lora = Lora(rank=32, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp).resolve() / "models"
        base_model = MODEL if args.size == "compute" else "builtin:tiny"
        local = TrainingModel(str(save_model(root)) if args.size == "compute" else base_model, lora, pick_device())
        datums, length = SIZES[args.size]
        data = batch(local.vocab_size, datums, length)
        decoded = as_the_worker_reads_them(data)

        def local_step() -> float:
            _, metrics = local.forward_backward(decoded, "cross_entropy", {}, backward=True)
            local.optim_step(**ADAM)
            return metrics["loss:sum"]

        os.environ["RLHF_MODEL_ROOT"] = str(root)
        data_dir = Path(tmp) / "server"
        with embedded_server(data_dir, args.port) as c:
            key = (data_dir / KEY_FILE).read_text().strip()
            service = tinker.ServiceClient(base_url=c.url, api_key=f"tml-{key}")
            training = service.create_lora_training_client(base_model=base_model, rank=32, seed=0).result()
            adam = types.AdamParams(**ADAM)

            def server_step() -> float:
                fwdbwd = training.forward_backward(data, "cross_entropy")
                optim = training.optim_step(adam)
                loss = float(fwdbwd.result().metrics["loss:sum"])
                optim.result()
                return loss

            times: dict[str, list[float]] = {"local": [], "server": []}
            first: dict[str, float] = {}
            for i in range(1, args.rounds + 1):
                for arm, step in (("local", local_step), ("server", server_step)):
                    counted, loss = timed(step, args.steps)
                    times[arm] += counted
                    first.setdefault(arm, loss)
                    print(f"round {i} {arm}: median {statistics.median(counted):.3f} s/step")
            service.close("success").result()

    local_s, server_s = statistics.median(times["local"]), statistics.median(times["server"])
    tokens = datums * length
    model = "6 layers, 384 dims" if args.size == "compute" else "builtin:tiny"
    print(f"\nmodel: {model}, LoRA rank 32; "
          f"{datums} datums x {length} tokens; {args.threads} torch thread(s); "
          f"{args.rounds} rounds x {args.steps} counted steps per arm")  # fmt: skip
    print(f"first step's loss:sum  local {first['local']:.4f}  server {first['server']:.4f}")
    print("| arm | s/step (median) | tokens/s |\n|---|---|---|")
    for arm, seconds in (("in-process engine operations", local_s), ("tinker SDK against rlhf serve", server_s)):
        print(f"| {arm} | {seconds:.3f} | {tokens / seconds:.0f} |")
    print(f"API overhead: {server_s - local_s:+.3f} s/step; server / in-process = {server_s / local_s:.3f} "
          f"(goal <= 1.3)")  # fmt: skip
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
