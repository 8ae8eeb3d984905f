"""Checkpoints of FSDP jobs (``resources.sharding: "fsdp"``): the optimizer state stays sharded, the weights are
consolidated.

- ``optimizer/``: every rank writes its shards of the optimizer state with ``torch.distributed.checkpoint``
  (DCP: one file per rank and a metadata file), under the parameters' names; a resume loads them into the
  freshly sharded optimizer, so the job goes on exactly where it stopped.
- ``policy/`` (and the other models): one ordinary Hugging Face folder, gathered once per checkpoint on rank 0
  (``full_state_dict``, offloaded to the CPU as it is gathered), so generation, the OpenAI endpoints and
  ``job:`` references read a sharded job's checkpoints as any other's, and a resume loads its weights from them.
"""

from pathlib import Path
from typing import cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

OPTIMIZER_DIR = "optimizer"
"""The sharded optimizer state in a checkpoint folder (DCP's layout)."""


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s whole state dict on rank 0 (CPU tensors), empty on the others; every rank calls it."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state)


def save_optimizer(module: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank writes its shards of ``optimizer`` (over ``module``'s parameters) into ``folder``."""
    dcp.save({"optimizer": get_optimizer_state_dict(module, optimizer)}, checkpoint_id=str(folder))


def load_optimizer(module: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank reads its shards of the optimizer state :func:`save_optimizer` wrote into ``optimizer``."""
    state = {"optimizer": get_optimizer_state_dict(module, optimizer)}  # the shapes to read into
    dcp.load(state, checkpoint_id=str(folder))
    set_optimizer_state_dict(module, optimizer, state["optimizer"])
