"""Memory planning: what one rank of a job holds of its models' weights, gradients and optimizer state, told from
the models' weight files without loading them (torch-free: the API refuses at submit a job that cannot fit).

The engine runs a job in one dtype (``hyperparameters.dtype``: 4 bytes a value in float32, 2 in bfloat16) for
weights, gradients and AdamW's two moments alike, so a trained parameter costs 4 values and a frozen one 1. Which
models a job holds is read from its type's entry in ``JOB_TYPES``:

- the policy, trained (a reward model's: its backbone and a scalar head, no LM head); with LoRA only its adapters
  are trained and the base is frozen;
- a frozen reference, the starting policy (``reference``); with LoRA none (the policy with its adapters off);
- a trained critic (``critic``): the reward model's backbone (the policy's where there is no reward model), with
  LoRA adapters on a base that is also the reward model; and the reward model itself, frozen;
- a frozen teacher (``teacher``); a frozen ``reward_model`` of another type that takes one.

Under ``resources.sharding: "fsdp"`` each of the job's ``world_size`` ranks holds ``1/world_size`` of the trained
models and of the frozen reference or teacher; a reward model stays whole on each rank. ``cpu_offload`` keeps the
shards in host memory between uses: on the device, only what a block gathers as it computes. This is the engine's
``memory/state_bytes`` on a rank, before activations: :data:`HEADROOM` of the device is left for those.
"""

import json
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.builtin import TINY_CONFIG, TOKENIZER_FILE
from engine.spec.config import JOB_TYPES, JobSpec
from engine.spec.model_refs import ModelNotFoundError

HEADROOM = 0.15
"""The share of a device's memory a plan leaves for activations, the blocks FSDP gathers, the CUDA context and
the allocator's fragmentation: a job fits when its state takes at most 85 % of the device. (A job that fits can
still run out of memory on activations: smaller micro-batches and ``gradient_checkpointing`` lower them.)"""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "dense",
                "query_key_value", "dense_h_to_4h", "dense_4h_to_h", "qkv_proj", "gate_up_proj", "c_attn", "c_proj",
                "c_fc", "fc1", "fc2", "out_proj", "w1", "w2", "w3")  # fmt: skip
"""The transformer blocks' linear layers across architectures: LoRA's ``target_modules: "auto"`` adapts these."""
GIB = 1024**3
BLOCK = re.compile(r"^(.*?\.\d+)\.")
"""A tensor's block: its name up to its first number (``model.layers.3``, ``transformer.h.0``), a unit of FSDP."""
MAX_HEADER_BYTES = 100_000_000
"""The longest safetensors header read: safetensors' own limit (``MAX_HEADER_SIZE``, safetensors
``safetensors/src/tensor.rs``), past which it refuses the file too."""


class WeightsUnreadable(ModelNotFoundError):
    """A ``*.safetensors`` file whose header does not read as one (a length past the limit or the file, not JSON, a
    tensor without a shape): the message names the file."""


@dataclass(frozen=True)
class Weights:
    """What a model's weight files hold: its parameter count, that of its LM head stored apart (0 when tied to the
    embeddings), the (name, input, output) of each linear layer inside its blocks (for LoRA's adapters), and the
    parameters of its largest FSDP unit."""

    params: int
    lm_head: int = 0
    linears: tuple[tuple[str, int, int], ...] = ()
    largest_unit: int | None = None
    """The parameters of the largest part FSDP shards as one unit (engine/core/distributed.py: each transformer
    block, and the root: the rest, embeddings and head among them), which a rank gathers whole to compute; None
    when not known: the whole model counts."""

    @property
    def unit(self) -> int:
        """:attr:`largest_unit`, or the whole model when it is not known."""
        return self.params if self.largest_unit is None else self.largest_unit

    @property
    def backbone(self) -> int:
        """A scalar model's parameters: the backbone without the LM head (the head's few are not counted)."""
        return self.params - self.lm_head

    def adapters(self, r: int, targets: str | list[str]) -> int:
        """The parameters of LoRA adapters of rank ``r`` on ``targets`` ("auto": every block's linear layer)."""
        names = LINEAR_NAMES if targets == "auto" else tuple(targets)
        return sum(r * (fan_in + fan_out) for name, fan_in, fan_out in self.linears if name.rsplit(".", 1)[-1] in names)


def read_weights(folder: Path) -> Weights | None:
    """The :class:`Weights` of a model folder's ``*.safetensors`` files, from their headers; None without them.
    :class:`WeightsUnreadable` names a file whose header does not read."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    params = lm_head = 0
    linears = []
    blocks: dict[str, int] = {}  # a block's name (``model.layers.3``) → its parameters
    for name, shape in _tensors(files):
        count = 1
        for size in shape:
            count *= size
        params += count
        if block := BLOCK.match(name):
            blocks[block.group(1)] = blocks.get(block.group(1), 0) + count
        if name.startswith("lm_head.") or name.endswith(".lm_head.weight") or name == "embed_out.weight":
            lm_head += count
        module, _, kind = name.rpartition(".")
        if kind == "weight" and len(shape) == 2 and module.rsplit(".", 1)[-1] in LINEAR_NAMES:
            out_features, in_features = shape  # torch's Linear stores (out, in); GPT-2's Conv1D (in, out): a sum
            linears.append((module, in_features, out_features))
    root = params - sum(blocks.values())
    return Weights(params, lm_head, tuple(linears), largest_unit=max([root, *blocks.values()]))


def _tensors(files: list[Path]) -> Iterator[tuple[str, list[int]]]:
    for file in files:
        for name, info in _header(file).items():
            if name == "__metadata__":
                continue
            shape = info.get("shape") if isinstance(info, dict) else None
            if not (isinstance(shape, list) and all(type(size) is int and size >= 0 for size in shape)):
                raise WeightsUnreadable(f"{_named(file)}: tensor {name[:100]!r} has no shape of sizes")
            yield name, shape


def _header(file: Path) -> dict[str, Any]:
    """A safetensors file's header (8 bytes of its length, little-endian, then that much JSON), read no further than
    :data:`MAX_HEADER_BYTES` and the file's own size."""
    with file.open("rb") as f:
        start = f.read(8)
        size = os.fstat(f.fileno()).st_size
        (length,) = struct.unpack("<Q", start) if len(start) == 8 else (None,)
        if length is None or length > min(MAX_HEADER_BYTES, size - 8):
            declared = "no header length" if length is None else f"a header of {length:,} bytes"
            raise WeightsUnreadable(
                f"{_named(file)} is not a safetensors file: it declares {declared}, in a file of {size:,} bytes "
                f"(safetensors reads at most {MAX_HEADER_BYTES:,})"
            )
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deeply
            header = None
    if not isinstance(header, dict):
        raise WeightsUnreadable(f"{_named(file)} is not a safetensors file: its header is not a JSON object")
    return header


def _named(file: Path) -> str:
    """A weight file as a message names it: its folder's name and its own."""
    return f"{file.parent.name}/{file.name}"


def builtin_weights() -> Weights:
    """The built-in model's weights (``builtin:tiny``: a GPT-2 over the built-in tokenizer's vocabulary)."""
    tokenizer = json.loads(TOKENIZER_FILE.read_text(encoding="utf-8"))
    ids = set(tokenizer["model"]["vocab"].values()) | {token["id"] for token in tokenizer.get("added_tokens", [])}
    return gpt2_weights(TINY_CONFIG, len(ids))


def gpt2_weights(config: dict[str, Any], vocab_size: int) -> Weights:
    """A GPT-2 model's weights from its config (the built-in model's: its LM head tied to the embeddings)."""
    h, layers, positions = int(config["n_embd"]), int(config["n_layer"]), int(config.get("n_positions", 1024))
    inner = int(config.get("n_inner") or 4 * h)
    block = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)  # ln, attn, mlp
    linears = tuple(
        (f"transformer.h.{i}.{name}", fan_in, fan_out) for i in range(layers)
        for name, fan_in, fan_out in (("attn.c_attn", h, 3 * h), ("attn.c_proj", h, h), ("mlp.c_fc", h, inner),
                                      ("mlp.c_proj", inner, h))
    )  # fmt: skip
    root = vocab_size * h + positions * h + 2 * h  # embeddings (the head tied to them) and the final norm
    return Weights(root + layers * block, 0, linears, largest_unit=max(root, block))


@dataclass(frozen=True)
class Plan:
    """Bytes one rank holds on its device."""

    weights: int
    gradients: int
    optimizer: int
    world_size: int
    layout: str
    """How the models are held, in words (``ddp``, ``fsdp over 4 ranks``, ``fsdp over 4 ranks, cpu offload``)."""
    gathered: int = 0
    """Under ``cpu_offload``, the bytes of the largest unit a rank gathers whole on its device to compute (its
    weights and, trained, its gradients), which the state kept on the host leaves the device to hold."""

    @property
    def total(self) -> int:
        """The state a rank keeps on its device between uses (the engine's ``memory/state_bytes``)."""
        return self.weights + self.gradients + self.optimizer

    def fits(self, device_bytes: int) -> bool:
        return self.total + self.gathered <= (1 - HEADROOM) * device_bytes

    def describe(self) -> str:
        gathered = f", and {gib(self.gathered)} gathered from the host at a time" if self.gathered else ""
        return (
            f"{gib(self.weights)} of weights, {gib(self.gradients)} of gradients and {gib(self.optimizer)} of "
            f"optimizer state, {gib(self.total)} in all ({self.total:,} bytes){gathered}"
        )


def gib(n: int) -> str:
    """Bytes in GiB (in MiB below one)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 1024**2:.2f} MiB"


def plan(spec: JobSpec, models: dict[str, Weights]) -> Plan:
    """One rank's plan for ``spec``, from the :class:`Weights` of its models by spec field (``model``, and
    ``reward_model`` and ``teacher`` where it names them)."""
    info, policy, lora = JOB_TYPES[spec.type], models["model"], spec.lora
    trained = frozen_sharded = frozen_whole = 0  # parameters
    base = policy.backbone if info.output == "reward_model" else policy.params
    if lora is None:
        trained += base
    else:
        trained += policy.adapters(lora.r, lora.target_modules)
        frozen_sharded += base
    if info.reference == "always" or (info.reference == "with_kl" and getattr(spec.config, "kl_coef", 0) > 0):
        frozen_sharded += 0 if lora is not None else policy.params
    reward = models.get("reward_model") if info.reward_model else None
    if info.critic:
        critic = reward.backbone if reward is not None else policy.backbone
        if lora is None:
            trained += critic
            frozen_whole += reward.backbone if reward is not None else 0
        else:  # adapters on the reward model's base, which scores with them off
            trained += (reward or policy).adapters(lora.r, lora.target_modules)
            frozen_sharded += critic
    elif reward is not None:
        frozen_whole += reward.backbone
    if info.teacher and "teacher" in models:
        frozen_sharded += models["teacher"].params
    resources = spec.resources
    n = resources.world_size if resources.sharding == "fsdp" else 1
    layout = "ddp" if n == 1 and resources.world_size > 1 else "one process" if n == 1 else f"fsdp over {n} ranks"
    b = DTYPE_BYTES[spec.config.dtype]
    gathered = 0
    if n > 1 and resources.cpu_offload:
        trained = frozen_sharded = 0  # on the host between uses, but for the unit a rank computes with
        layout += ", cpu offload"
        sharded = [policy, reward if info.critic else None, models.get("teacher") if info.teacher else None]
        largest = max(m.unit for m in sharded if m is not None)
        gathered = (2 if lora is None else 1) * b * largest  # its whole weights, and trained as many gradients
    weights = b * (ceil_div(trained + frozen_sharded, n) + frozen_whole)
    trained_bytes = b * ceil_div(trained, n)
    return Plan(weights, trained_bytes, 2 * trained_bytes, resources.world_size, layout, gathered=gathered)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def what_fits(spec: JobSpec, models: dict[str, Weights], device_bytes: int, max_processes: int
              ) -> tuple[dict[str, Any], Plan] | None:  # fmt: skip
    """The smallest change of ``spec`` whose plan fits ``device_bytes``, as (what to set, its plan), or None:
    sharding over the job's processes, then over more processes per host (up to ``max_processes``), then CPU
    offload, then LoRA adapters (rank 16)."""
    resources = spec.resources
    tries: list[dict[str, Any]] = [{"resources": {"sharding": "fsdp"}}] if resources.world_size > 1 else []
    tries += [{"resources": {"sharding": "fsdp", "num_processes": p}}
              for p in range(resources.num_processes + 1, max_processes + 1)]  # fmt: skip
    most = max(resources.num_processes, min(max_processes, 8))
    if most * resources.num_nodes > 1:
        tries.append({"resources": {"sharding": "fsdp", "num_processes": most, "cpu_offload": True}})
    tries.append({"lora": {"r": 16}})
    for change in tries:
        changed = _changed(spec, change)
        if changed is not None and (found := plan(changed, models)).fits(device_bytes):
            return change, found
    return None


def _changed(spec: JobSpec, change: dict[str, Any]) -> JobSpec | None:
    data = spec.model_dump()
    data["resources"] = {**data["resources"], **change.get("resources", {})}
    if "lora" in change:
        data["lora"] = change["lora"]
    try:
        return JobSpec.model_validate(data)
    except ValueError:  # e.g. batch sizes that the new process count does not divide
        return None


def refusal(spec: JobSpec, models: dict[str, Weights], device_bytes: int, max_processes: int) -> str | None:
    """Why ``spec`` cannot fit a device of ``device_bytes`` (the plan's figures, and the setting that would fit),
    or None when it fits."""
    found = plan(spec, models)
    if found.fits(device_bytes):
        return None
    message = (f"the job's models do not fit a {gib(device_bytes)} device as they are held ({found.layout}): each rank "
               f"would hold {found.describe()}, and a plan may take {1 - HEADROOM:.0%} of the device")  # fmt: skip
    if (fix := what_fits(spec, models, device_bytes, max_processes)) is not None:
        change, fixed = fix
        return f"{message}; it fits with {json.dumps(change)} ({fixed.describe()} per rank)"
    return f"{message}; nothing this server can set fits it: a larger device, or more hosts (resources.num_nodes)"
