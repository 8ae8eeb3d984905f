"""A model a session trains (the SDK's training client): the base model, LoRA on the parts the client names or
every weight, the engine's :class:`engine.core.learner.Learner` over it, and an AdamW whose hyperparameters each
``optim_step`` brings (Tinker sends its own learning rate, betas, eps, weight decay and clip with every step)."""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from engine.core.distributed import Ranks
from engine.core.learner import Learner
from engine.core.models import apply_lora, context_length, load_causal_lm, load_tokenizer, prepare, save_model
from engine.session.losses import forward_backward
from engine.session.wire import Datum
from engine.spec.config import LoraSpec

LORA_ALPHA = 32
"""LoRA's scaling numerator: α = 32 at every rank (scale 32/r), as Thinking Machines' "LoRA Without Regret" trains,
so that the best learning rate barely moves with the rank."""
STATE_FILE = "state.pt"
"""A saved training state: the trained weights, and the optimizer's state when saved with it."""


@dataclass(frozen=True)
class Lora:
    """Which parts get adapters (the SDK's ``LoraConfig``)."""

    rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int | None = None

    @classmethod
    def of(cls, config: dict[str, Any]) -> "Lora":
        return cls(config["rank"], config.get("train_attn", True), config.get("train_mlp", True),
                   config.get("train_unembed", True), config.get("seed"))  # fmt: skip


def lora_targets(model: PreTrainedModel, lora: Lora) -> list[str]:
    """The full names of the linear layers to adapt: those inside an attention block (``train_attn``), inside an
    MLP or its experts (``train_mlp``), and the output layer (``train_unembed``)."""
    head = model.get_output_embeddings()
    names = []
    for name, module in model.named_modules():
        if not _is_linear(module):
            continue
        parts = name.lower().split(".")
        attention = any("attn" in part or "attention" in part for part in parts)
        mlp = any(part in ("mlp", "feed_forward", "experts", "block_sparse_moe") for part in parts)
        if module is head:
            wanted = lora.train_unembed
        else:
            wanted = (attention and lora.train_attn) or (mlp and not attention and lora.train_mlp)
        if wanted:
            names.append(name)
    if not names:
        raise ValueError("lora_config: no layer of this model matches train_attn / train_mlp / train_unembed")
    return names


def _is_linear(module: torch.nn.Module) -> bool:
    """A layer LoRA can adapt: ``nn.Linear``, or GPT-2's ``Conv1D`` (a linear layer with its weight transposed)."""
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


class TrainingModel:
    """One trained model and its optimizer, between the client's requests."""

    def __init__(self, ref: str, lora: Lora | None, device: torch.device, seed: int = 0) -> None:
        self.tokenizer = load_tokenizer(ref)
        model = prepare(load_causal_lm(ref, self.tokenizer, seed), device, "float32", gradient_checkpointing=False)
        self.lora = lora
        if lora is not None:
            torch.manual_seed(seed if lora.seed is None else lora.seed)
            spec = LoraSpec.model_construct(r=lora.rank, alpha=LORA_ALPHA, dropout=0.0,
                                            target_modules=lora_targets(model, lora))  # fmt: skip
            model = apply_lora(model, spec, "CAUSAL_LM", None)
        self.learner = Learner(model, Ranks())
        optimizer = torch.optim.AdamW(self.learner.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.learner.use_optimizer(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = context_length(model)

    @property
    def model(self) -> PreTrainedModel:
        return self.learner.model

    def info(self) -> dict[str, Any]:
        """What ``get_info`` and the checks of a request need to know of it."""
        return {"arch": type(self.model.config).__name__.removesuffix("Config").lower(), "vocab_size": self.vocab_size,
                "max_length": self.max_length}  # fmt: skip

    def forward_backward(self, datums: Sequence[Datum], loss_fn: str, config: dict[str, float | str],
                         backward: bool) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:  # fmt: skip
        """Tinker's loss ``loss_fn`` summed over every token of ``datums``; with ``backward`` its gradients are added
        to those of the requests since the last :meth:`optim_step`. Returns each datum's outputs and the metrics."""
        self.model.train(backward)
        return forward_backward(self.model, datums, loss_fn, config, backward=backward)

    def optim_step(self, learning_rate: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:  # fmt: skip
        """One AdamW step at these hyperparameters over the gradients gathered since the last one (clipped to a
        global norm of ``grad_clip_norm``; 0: not clipped)."""
        optimizer = self.learner.optimizer
        assert optimizer is not None
        for group in optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        self.learner.max_grad_norm = grad_clip_norm if grad_clip_norm > 0 else None
        grad_norm = self.learner.optim_step()
        return {"grad_norm": grad_norm, "learning_rate": learning_rate}

    def save_state(self, folder: Path) -> int:
        """The trained weights and the optimizer's state in ``folder``; returns the bytes written."""
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(self.learner.save_state(), folder / STATE_FILE)
        return (folder / STATE_FILE).stat().st_size

    def save_external(self, folder: Path, base_model: str) -> int:
        """The weights in Hugging Face's format in ``folder`` (made): with LoRA the PEFT adapter
        (``adapter_config.json`` naming ``base_model``, ``adapter_model.safetensors``: ``PeftModel.from_pretrained``
        over the base model), else the whole model (``config.json``, ``model.safetensors``), and the tokenizer's
        files either way. Returns the bytes written."""
        if self.lora is None:
            save_model(self.model, self.tokenizer, folder)
        else:
            self.model.save_pretrained(folder)
            config = folder / "adapter_config.json"
            config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": base_model}))
            (folder / "README.md").unlink(missing_ok=True)  # peft's card names the folder the base was loaded from
            self.tokenizer.save_pretrained(folder)
        return sum(file.stat().st_size for file in folder.rglob("*") if file.is_file())

    def load_state(self, folder: Path, optimizer: bool) -> None:
        """Weights saved by :meth:`save_state` (of a model built as this one), and the optimizer's state with
        ``optimizer`` (else the optimizer starts afresh, as a new training client's does)."""
        state = torch.load(folder / STATE_FILE, map_location=self.model.device, weights_only=True)
        if not optimizer:
            state = {"weights": state["weights"]}
        self.learner.load_state(state)
