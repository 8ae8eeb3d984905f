"""Data parallelism: one job in several processes (``torchrun``), with DistributedDataParallel.

Whoever starts the processes initialises the process group (``jobs/distributed.py`` for the service); the
loops read it through :meth:`Ranks.current`. Without a process group every method here is a no-op, so the
loops are written once for both cases.

How a loop uses it: every rank loads the same models and reads the same (seeded) batch order, takes its
:meth:`Ranks.share` of each global batch, and trains the model wrapped by :meth:`Ranks.wrap`. DDP averages
gradients over the ranks, so each rank scales the loss it backpropagates by the world size
(:attr:`Ranks.loss_scale`), and the averaged gradient is the gradient of the global batch's loss: the same
as one process training on the whole batch. Rank 0 reports metrics, answers stop requests (broadcast to
the others, so all stop together) and writes checkpoints.

With ``resources.sharding: "fsdp"`` the trained and the frozen models are sharded instead (FSDP2,
``torch.distributed.fsdp.fully_shard``, one unit per transformer block and one for the rest): each rank holds
``1/world_size`` of every parameter, gradient and optimizer state, and a forward gathers each block's weights as
it reaches it, so every rank must run the same forwards. Gradients are reduce-scattered in fp32 and averaged, as
DDP's are (so :attr:`Ranks.loss_scale` holds for both). What one rank does alone — evaluating, sampling, saving
the consolidated Hugging Face folder — runs inside :meth:`Ranks.gathered`, which every rank enters together.
"""

import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

T = TypeVar("T")
Sharding = Literal["ddp", "fsdp"]


@dataclass(frozen=True)
class Ranks:
    """This process's place among the job's processes."""

    rank: int = 0
    world_size: int = 1
    sharding: Sharding = "ddp"
    """How several processes hold the models: whole copies (DDP) or shards (FSDP2)."""
    cpu_offload: bool = False
    """With FSDP: parameters, gradients and optimizer state between steps in CPU memory."""

    @classmethod
    def current(cls, sharding: Sharding = "ddp", cpu_offload: bool = False) -> "Ranks":
        """From the initialised process group, or a single process when there is none."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), sharding, cpu_offload)
        return cls()

    @property
    def sharded(self) -> bool:
        """Whether the models are FSDP shards (several processes with ``sharding="fsdp"``)."""
        return self.sharding == "fsdp" and self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: reports, checkpoints and decides when to stop."""
        return self.rank == 0

    @property
    def loss_scale(self) -> int:
        """Multiply a rank's share of the loss by this before backward (DDP divides the summed gradient by it)."""
        return self.world_size

    def share(self, n: int) -> slice:
        """This rank's rows of a batch of ``n`` (which the job spec's checks make divide evenly)."""
        per = n // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)

    def wrap(self, module: torch.nn.Module, compile: bool = False) -> torch.nn.Module:
        """``module`` in DistributedDataParallel (the module itself for one process), and compiled by
        ``torch.compile`` for dynamic shapes when ``compile``. Train through the wrapper; sample, evaluate and save
        the module itself. Buffers are not broadcast: every rank holds the same ones, and a broadcast per forward
        would tie evaluation on rank 0 alone to the other ranks."""
        wrapped = module
        if self.sharded:
            wrapped = self.shard(module)
        elif self.world_size > 1:
            device = next(module.parameters()).device
            device_ids = [device.index] if device.type == "cuda" else None
            wrapped = DistributedDataParallel(module, device_ids=device_ids, **_NO_BUFFER_SYNC)
        return cast(torch.nn.Module, torch.compile(wrapped, dynamic=True)) if compile else wrapped

    def shard(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` made FSDP2 shards in place (a no-op for one process or DDP): each transformer block (the
        classes Hugging Face names in ``_no_split_modules``) a unit, the root the rest; gradients reduced in
        fp32. A frozen model (a reference) is sharded the same way and gathers its blocks as it computes."""
        if not self.sharded or isinstance(module, FSDPModule):
            return module
        policy: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32)}
        if self.cpu_offload and next(module.parameters()).device.type != "cpu":  # on the CPU they are there
            policy["offload_policy"] = CPUOffloadPolicy()
        blocks = set().union(*(getattr(m, "_no_split_modules", None) or () for m in module.modules()))
        for sub in module.modules():
            if type(sub).__name__ in blocks:
                fully_shard(sub, **policy)
        fully_shard(module, **policy)
        # FSDP2 takes the first unit to run forward for the root: settled now, so that a forward through a part
        # (a critic's backbone, read by a head of its own) does not make one of its blocks a root of its own
        cast(Any, module)._get_fsdp_state()._lazy_init()
        return module

    @contextmanager
    def gathered(self, *modules: torch.nn.Module) -> Iterator[None]:
        """Within this block every FSDP unit of ``modules`` holds its whole weights, on every rank, so a rank may
        evaluate, sample or read them alone (no collective in a forward); every rank enters it together. A no-op
        unless sharded."""
        if not self.sharded:
            yield
            return
        found = [unit for m in modules for unit in m.modules() if isinstance(unit, FSDPModule)]
        # a unit's mode is its model's: frozen only when nothing of the model trains
        frozen = {id(unit) for m in modules if not any(p.requires_grad for p in m.parameters())
                  for unit in m.modules()}  # fmt: skip
        units = [unit for unit in dict.fromkeys(found) if id(unit) not in _GATHERED]  # an outer block has the rest
        # FSDP2 keeps a root's weights gathered after its forward (backward needs them at once): it stays so after.
        # A root is within no other unit (a unit the block was not given whole is taken for one: it then stays
        # gathered from its forward to its backward, which costs memory, not correctness)
        inner = {id(sub) for unit in found for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)}
        reshards = [id(unit) in inner for unit in units]
        # FSDP keeps the gathered tensors and writes into them at each gathering, which inference mode allows only
        # on tensors made in it: a trained model's are made for training (outside it), a frozen model's by its
        # forwards, which all run in it
        for unit in units:
            _GATHERED.add(id(unit))
            unit.set_reshard_after_forward(False, recurse=False)
            with torch.inference_mode(id(unit) in frozen):
                unit.unshard()
        try:
            yield
        finally:
            for unit, reshard in zip(units, reshards, strict=True):
                with torch.inference_mode(id(unit) in frozen):
                    unit.reshard()
                unit.set_reshard_after_forward(reshard, recurse=False)
                _GATHERED.discard(id(unit))

    @contextmanager
    def no_sync(self, wrapped: torch.nn.Module, last: bool) -> Iterator[None]:
        """Around a micro-batch's forward and backward: gradients are averaged only on the step's ``last``
        micro-batch (the ones before it accumulate locally)."""
        inner = getattr(wrapped, "_orig_mod", wrapped)  # inside torch.compile's wrapper
        if isinstance(inner, FSDPModule):
            inner.set_requires_gradient_sync(last)
            try:
                yield
            finally:
                inner.set_requires_gradient_sync(True)
        elif isinstance(inner, DistributedDataParallel) and not last:
            with inner.no_sync():
                yield
        else:
            yield

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the ranks (in place), e.g. of per-rank partial losses."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def max(self, value: int) -> int:
        """The largest ``value`` of any rank."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], device=_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape on all ranks) concatenated along the first dimension, in rank order."""
        if self.world_size == 1:
            return tensor
        if tensor.dtype == torch.bool:  # not every backend gathers booleans
            return self.gather(tensor.to(torch.uint8)).bool()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def gather_objects(self, obj: T) -> list[T]:
        """Every rank's picklable ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, obj: T) -> T:
        """Rank 0's picklable ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def weight_spread(self, params: Iterable[torch.nn.Parameter]) -> float:
        """How far the ranks' copies of ``params`` are apart: the range over ranks of a float64 fingerprint
        (sum of the values and of their squares). DDP keeps the copies bit-identical, so anything but 0 means
        they diverged."""
        fingerprint = torch.zeros(2, dtype=torch.float64, device=_device())
        for p in params:
            values = p.detach().double()
            fingerprint += torch.stack([values.sum(), values.square().sum()]).to(fingerprint.device)
        everyone = self.gather(fingerprint.unsqueeze(0))  # (world, 2)
        return (everyone.max(0).values - everyone.min(0).values).max().item()


_GATHERED: set[int] = set()
"""The FSDP units a :meth:`Ranks.gathered` block holds gathered now (an inner block leaves them to it)."""

# Named forward_sync_buffers since torch 2.13 (broadcast_buffers before).
_NO_BUFFER_SYNC: dict[str, Any] = {
    "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else "broadcast_buffers": False
}  # fmt: skip


def _device() -> torch.device:
    """Where collectives run: the current GPU under NCCL, else the CPU (gloo)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
