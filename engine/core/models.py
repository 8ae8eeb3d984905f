"""Loading models and tokenizers, and the per-token forwards every job shares.

A model reference is ``builtin:tiny``, a hub id, a local Hugging Face directory, a job's
output folder (its final checkpoint), or a checkpoint folder ``.../checkpoints/step-N``.
"""

import copy
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.activations import GELUTanh, NewGELUActivation

from engine import builtin
from engine.core.ops import (
    chunked_logprobs,
    entropy_from_logits,
    logprobs_from_logits,
    position_ids_from_mask,
    stop_ids,
)
from engine.spec.config import LoraSpec
from engine.spec.hub import explain_missing, hub_kwargs, is_hub_id
from engine.spec.model_refs import TOKENIZER_FILES, model_type_saved, tokenizer_saved
from engine.spec.model_refs import ModelNotFoundError as ModelNotFoundError  # re-exported: callers catch it from here
from engine.spec.model_refs import resolve_model_ref as resolve_model_ref
from engine.spec.sequence_classification import SEQUENCE_CLASSIFICATION_TYPES


def load_tokenizer(ref: str) -> PreTrainedTokenizerBase:
    """The tokenizer for a model reference, left-padding, with a pad token."""
    tokenizer: PreTrainedTokenizerBase
    if ref == builtin.TINY_MODEL:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(builtin.TOKENIZER_FILE), eos_token=builtin.EOS_TOKEN, pad_token=builtin.PAD_TOKEN
        )
    else:
        path = resolve_model_ref(ref)
        if not is_hub_id(path) and not Path(path).exists():  # else transformers answers "Repo id must be in the form"
            raise ModelNotFoundError(f"{ref!r}: no such folder (nor a hub id: name or org/name)")
        if Path(path).is_dir() and not tokenizer_saved(Path(path)):
            raise ModelNotFoundError(
                f"{ref!r} has no tokenizer: a model folder needs tokenizer.json, or tokenizer_config.json with its "
                f"vocabulary ({', '.join(TOKENIZER_FILES[1:])})"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False, **hub_kwargs(path))
        except OSError as e:
            raise ModelNotFoundError(f"no tokenizer: {explain_missing(ref, e)}") from e
    if tokenizer.eos_token_id is None:
        raise ModelNotFoundError(f"the tokenizer of {ref!r} has no EOS token")
    if tokenizer.pad_token_id is None:
        # Masks are always built from lengths, never from pad ids, so reusing EOS is safe here.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _tiny_config(tokenizer: PreTrainedTokenizerBase) -> GPT2Config:
    config = GPT2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.update(builtin.TINY_CONFIG)
    return config


def load_causal_lm(ref: str, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """A causal LM (fp32, CPU; the caller moves it). ``builtin:tiny`` is initialised from ``seed``."""
    torch.manual_seed(seed)
    model: PreTrainedModel
    if ref == builtin.TINY_MODEL:
        model = GPT2LMHeadModel(_tiny_config(tokenizer))
    else:
        model = _from_pretrained(AutoModelForCausalLM, ref)
    # every stop id in the generation config: saved with each checkpoint, so plain transformers stops there too
    ids = stop_token_ids(model, tokenizer)
    model.generation_config.eos_token_id = ids[0] if len(ids) == 1 else list(ids)
    return model


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The tokens a response ends at, as transformers' ``generate`` ends it: the ``eos_token_id`` of the model's
    generation config (its ``generation_config.json``; an id or a list, e.g. Llama 3's ``<|eot_id|>`` and
    ``<|end_of_text|>``, Phi-3's ``<|end|>`` and ``<|endoftext|>``), then the tokenizer's EOS and the model
    config's EOS ids, each once."""
    generation = getattr(model, "generation_config", None)
    found = (
        getattr(generation, "eos_token_id", None),
        tokenizer.eos_token_id,
        getattr(model.config, "eos_token_id", None),
    )
    return stop_ids([i for ids in found for i in stop_ids(ids)])


class StopTokenError(ValueError):
    """``stop_token`` names no single token of the model's vocabulary."""


def resolve_stop_token(
    stop_token: str | None, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> tuple[int, ...]:
    """The ids a ``stop_token`` hyperparameter ends responses at: ``"eos"``, every stop id of the model
    (:func:`stop_token_ids`); a token of the vocabulary (``"<|im_end|>"``, or text the tokenizer encodes as one
    token), that token alone; None, none."""
    if stop_token is None:
        return ()
    if stop_token == "eos":
        return stop_token_ids(model, tokenizer)
    vocabulary = tokenizer.get_vocab()
    if stop_token in vocabulary:
        return (vocabulary[stop_token],)
    ids = tokenizer.encode(stop_token, add_special_tokens=False)
    if len(ids) == 1:
        return (ids[0],)
    ends = [tokenizer.convert_ids_to_tokens(i) for i in stop_token_ids(model, tokenizer)]
    raise StopTokenError(
        f"hyperparameters.stop_token {stop_token!r} is not a token of the model's vocabulary (its tokenizer encodes "
        f"it as {len(ids)} tokens); name one token, or 'eos' for the model's end tokens {ends}"
    )


def load_scalar_model(
    ref: str, tokenizer: PreTrainedTokenizerBase, seed: int, trained_head: bool = False
) -> PreTrainedModel:
    """A sequence-classification model with one output: reward model or critic.

    From a causal LM the scalar head starts random (seeded); from a reward model it is kept. ``trained_head``:
    the model must bring its head (a reward model to score with), so a causal LM is refused instead of scoring
    with a random head.
    """
    torch.manual_seed(seed)
    if ref == builtin.TINY_MODEL:
        if trained_head:
            raise RewardModelError(f"{ref} is a causal LM, not a reward model: it has no trained score head")
        config = _tiny_config(tokenizer)
        config.num_labels = 1
        return GPT2ForSequenceClassification(config)
    folder = Path(resolve_model_ref(ref))
    model_type = model_type_saved(folder) if folder.is_dir() else None
    if model_type is not None and model_type not in SEQUENCE_CLASSIFICATION_TYPES:
        raise RewardModelError(
            f"{ref!r} is a {model_type} model, and transformers has no sequence-classification class for "
            f"{model_type}: it cannot be a reward model or critic"
        )
    model, info = _from_pretrained(AutoModelForSequenceClassification, ref, num_labels=1, output_loading_info=True)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if not hasattr(model, "score"):
        raise ModelNotFoundError(f"{ref!r}: a scalar head named 'score' is required (decoder-only models have one)")
    if trained_head and any(key.split(".")[0] == "score" for key in info["missing_keys"]):
        raise RewardModelError(
            f"{ref!r} has no trained score head (a causal LM, not a reward model), so its scores would be random; "
            "train a reward model from it first (an rm job) and name that"
        )
    return model


class RewardModelError(ValueError):
    """A model named as a reward model cannot score (no trained head)."""


def lm_head_weight(model: PreTrainedModel, ref: str) -> Callable[[], torch.Tensor]:
    """The LM head (V, H) for an LM loss on a classifier's hidden states (which has no LM head of its own), read
    when called.

    With tied embeddings (GPT-2) it is the input embedding matrix, trained with the backbone: read from the model
    at each call, since a sharded model (FSDP) registers its gathered weights only while it computes. Untied
    (Llama, Qwen2, Mistral, GPT-NeoX by default) it is the causal LM ``ref``'s own ``lm_head``, kept frozen: the
    classifier trains and saves no LM head.
    """
    classifier = model.get_base_model() if is_lora(model) else model  # type: ignore[operator]
    if getattr(classifier.config, "tie_word_embeddings", True):

        def embeddings() -> torch.Tensor:
            weight = classifier.get_input_embeddings().weight
            assert isinstance(weight, torch.Tensor)
            return weight

        return embeddings
    causal, info = _from_pretrained(AutoModelForCausalLM, ref, output_loading_info=True)
    head = causal.get_output_embeddings()
    head_names = {name for name, param in causal.named_parameters() if head is not None and param is head.weight}
    if head is None or head_names & set(info["missing_keys"]):
        raise RewardModelError(
            f"lm_loss_coef needs the LM head of the starting model, and {ref!r} has none (not a causal LM)"
        )
    embedding = classifier.get_input_embeddings().weight
    frozen_head = head.weight.detach().to(device=embedding.device, dtype=embedding.dtype)
    return lambda: frozen_head


def _from_pretrained(auto: type, ref: str, **kwargs: object) -> Any:
    path = resolve_model_ref(ref)
    kwargs.update(hub_kwargs(path, model=True))  # a hub id never waits on a hub it cannot reach
    try:
        # use_kernels=False: transformers >= 5.25 would otherwise, on CUDA, swap layers for kernels it fetches from
        # the hub at the model's first .eval() (remote code, a network, other numerics than the training pass's)
        return auto.from_pretrained(  # type: ignore[attr-defined]
            path, trust_remote_code=False, use_safetensors=None, use_kernels=False, **kwargs
        )
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(explain_missing(ref, e)) from e


def prepare(model: PreTrainedModel, device: torch.device, dtype: str, gradient_checkpointing: bool) -> PreTrainedModel:
    """Move to device and dtype, turn dropout off (PPO's ratios need a deterministic forward), and compute
    the tanh-approximated GELU of GPT-2-style models with one fused kernel (:func:`fuse_activations`)."""
    model.to(device=device, dtype=getattr(torch, dtype))  # type: ignore[call-arg]
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    fuse_activations(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def frozen(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` in eval mode without gradients: a reference or reward model that is never trained."""
    model.eval()
    model.requires_grad_(False)
    return model


def fuse_activations(model: torch.nn.Module) -> None:
    """Swap ``gelu_new`` (GPT-2's GELU, written as eight element-wise torch ops) for ``F.gelu(approximate="tanh")``.

    The same function, computed by one kernel, within float rounding; a fifth of a small GPT-2's step on a CPU
    goes to the eight-op version. The model's config is untouched, so checkpoints are saved as they came.
    """
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is NewGELUActivation:
                setattr(module, name, GELUTanh())


def lm_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, last: int = 0
) -> torch.Tensor:
    """Next-token logits: (B, L) -> (B, L, V), or (B, last, V) for the last ``last`` positions only (the
    LM head, often the largest matmul of a small model, then runs on those alone). Positions follow the mask.
    ``model`` is a causal LM, or one wrapped in DistributedDataParallel.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=last,
    )
    return out.logits


SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier")
"""Config fields of architectures whose logits are more than the output layer of the last hidden state (Gemma 2's
soft cap, Cohere's, Granite's and HyperCLOVA X's scales, Falcon-H1's multiplier): :func:`output_layer` gives None
for them unless the field is unset or 1."""


def output_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    """The layer that makes a causal LM's logits from its last hidden state, found through the torch.compile,
    DistributedDataParallel and PEFT wrappers; None when the architecture does more to its logits
    (:data:`SCALED_LOGITS`)."""
    inner = getattr(model, "_orig_mod", model)  # inside torch.compile's wrapper
    inner = inner.module if isinstance(inner, torch.nn.parallel.DistributedDataParallel) else inner
    config = inner.config
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in SCALED_LOGITS):
        return None
    head = inner.get_output_embeddings()  # type: ignore[operator]
    return head if isinstance(head, torch.nn.Module) else None


LOGITS_CHUNK_BYTES = 2**28
"""The most float32 logits a log-probability pass holds at once: 256 MiB, 1335 positions of GPT-2's vocabulary
(50,257), 523 of Llama 3's (128,256). A small vocabulary's batch is taken in one piece."""


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    start: int,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token t | tokens before t) at ``temperature`` for the tokens from position ``start`` on, and the
    entropy of each of those distributions when ``entropy`` (with a gradient when ``entropy_grad``):
    (B, L) -> (B, L - start), (B, L - start) or None. Positions follow the mask.

    The model runs to its last hidden state; the logits are made from it :data:`LOGITS_CHUNK_BYTES` at a time
    (:func:`engine.core.ops.chunked_logprobs`), so the (B, L, V) logits never exist at once; they are divided by the
    temperature in float32, as the sampler divides them. An architecture that
    scales or caps its logits (:func:`output_layer` is None) is read through its own forward.
    ``model`` is a causal LM, or one wrapped in DistributedDataParallel or torch.compile.
    """
    tokens = input_ids[:, start:]
    head = output_layer(model)
    if head is None:
        last = input_ids.shape[1] - start + 1
        logits = lm_logits(model, input_ids, attention_mask, last=last)[:, :-1].float() / temperature  # (B, L-start, V)
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            ent = entropy_from_logits(logits) if entropy else None
        return logprobs_from_logits(logits, tokens), ent
    hidden = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=1,  # the logits are made below, in chunks
        output_hidden_states=True,
    ).hidden_states[-1][:, start - 1 : -1]  # (B, L - start, H): the states before each scored token
    vocab = head.weight
    assert isinstance(vocab, torch.Tensor)  # (V, H)
    chunk = max(1, LOGITS_CHUNK_BYTES // (4 * vocab.shape[0]))
    return chunked_logprobs(lambda h: head(h).float() / temperature, hidden, tokens, chunk, entropy, entropy_grad)


class ScalarHead(torch.nn.Module):
    """A sequence-classification model read at every position: ``forward(input_ids, attention_mask)`` returns
    the scalar head's output (B, L) and the backbone's hidden states (B, L, H). A reward is read at the last
    valid token; a critic's values at every response position.

    A module of its own (the model's forward pools at the last token), so that DistributedDataParallel can
    wrap it: DDP averages the gradients of what runs through the forward it wraps.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # With LoRA, the wrapped classifier (its layers carry the adapters); its backbone is found by the
        # architecture's prefix ("model" for Llama, "transformer" for GPT-2), never on the PEFT wrapper itself.
        classifier = self.model.get_base_model() if is_lora(self.model) else self.model  # type: ignore[operator]
        backbone = getattr(classifier, classifier.base_model_prefix)
        hidden = backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        ).last_hidden_state  # (B, L, H)
        head = classifier.score
        assert isinstance(head, torch.nn.Module)
        return head(hidden).squeeze(-1).float(), hidden  # (B, L), (B, L, H)


def apply_lora(
    model: PreTrainedModel, lora: LoraSpec, task: Literal["CAUSAL_LM", "SEQ_CLS"], adapter_dir: Path | None
) -> PreTrainedModel:
    """Freeze ``model`` and add low-rank adapters (Hu et al., arXiv:2106.09685), fresh or loaded from ``adapter_dir``.

    For a scalar model the ``score`` head is trained in full besides the adapters. With the adapters
    disabled the model is its frozen base again: that is how PPO gets its reference policy and its
    reward model without a second copy of either backbone.
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)  # type: ignore[return-value]
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules="all-linear" if lora.target_modules == "auto" else lora.target_modules,
        task_type=task,
        modules_to_save=["score"] if task == "SEQ_CLS" else None,
    )
    return get_peft_model(model, config)  # type: ignore[return-value]


def is_lora(model: PreTrainedModel) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


FOLDED_DTYPES = (torch.float32, torch.float64)
"""The weight dtypes :func:`folded_adapters` folds adapters into: W + ΔW held to within float32's rounding. A
bfloat16 or float16 weight cannot hold it: where |ΔW| < ulp(W)/2 the sum rounds back to W (the smaller the
update, the more of it is lost), and every adapted weight rounded to its nearest half-precision value moves the
sampler's log-probs several times as far from the training pass as sampling's own kernels do."""


def rounds_when_folded(model: torch.nn.Module) -> bool:
    """Whether folding ``model``'s LoRA adapters into its weights would round them: an adapted weight in half
    precision (not of :data:`FOLDED_DTYPES`)."""
    if not is_lora(model):  # type: ignore[arg-type]
        return False
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    return any(adapted_parameter(m).dtype not in FOLDED_DTYPES for m in layers)


@contextmanager
def folded_adapters(model: torch.nn.Module, rounded: bool = False) -> Iterator[None]:
    """Within this block a LoRA model samples and runs its no-grad forwards with log-probs that agree with its
    unfused training pass as closely as a model without adapters agrees with itself (PPO's old log-probs, ratio and
    KL are taken across the two), as fast as that allows. Not for training passes (the adapters get no gradient
    while folded), nor around ``disable_adapter`` (which would unfold them).

    A layer whose base weight is float32 (:data:`FOLDED_DTYPES`) computes with its adapters added into that weight,
    one matmul instead of three: the full model's speed, its outputs the adapters' to within float32 rounding. A
    half-precision layer (bfloat16, float16) keeps its adapters unfused and runs the training pass's own
    arithmetic, at the cost of the adapters' own small kernels (two matmuls and their casts): folded into a
    half-precision weight they would be rounded (:data:`FOLDED_DTYPES`). ``rounded``: fold those too, rounded, for
    sampling at the full model's speed whose log-probs are then taken again unfused
    (:meth:`engine.core.learner.Learner.sample`).

    The base weights are copied before folding and copied back after, never subtracted again, so folding any
    number of times leaves them bit-identical. A model without adapters is left as it is. An adapted parameter
    that is no layer's ``weight`` (the fused experts of an MoE, :func:`adapted_parameter`) is folded the same way.
    """
    if not is_lora(model):  # type: ignore[arg-type]
        yield
        return
    from peft.tuners.lora import LoraLayer

    layers = [
        m
        for m in model.modules()
        if isinstance(m, LoraLayer) and not m.merged and (rounded or adapted_parameter(m).dtype in FOLDED_DTYPES)
    ]
    weights = [adapted_parameter(layer) for layer in layers]
    with torch.no_grad():
        saved = [weight.detach().clone() for weight in weights]
        for layer in layers:
            layer.merge()
    try:
        yield
    finally:
        with torch.no_grad():
            for layer, weight, original in zip(layers, weights, saved, strict=True):
                weight.copy_(original)
                layer.merged_adapters.clear()


def adapted_parameter(layer: torch.nn.Module) -> torch.Tensor:
    """The base parameter a peft LoRA layer adapts: its base layer's ``weight``, or for a ``ParamWrapper`` (peft's
    LoRA on a bare parameter, such as the 3-D ``gate_up_proj`` of transformers 5's fused MoE experts, which have
    no ``weight``) the parameter it names."""
    from peft.tuners.lora import ParamWrapper

    param = layer.get_param() if isinstance(layer, ParamWrapper) else layer.get_base_layer().weight  # type: ignore[operator]
    assert isinstance(param, torch.Tensor)
    return param


def base_name(name: str) -> str:
    """A module or parameter name of a peft model's base model without peft's ``base_layer`` levels, as the model
    has it without adapters: ``mlp.experts.base_layer.base_layer.down_proj`` (two nested ``ParamWrapper``) →
    ``mlp.experts.down_proj``."""
    return re.sub(r"\.base_layer(?=\.|$)", "", name)


def merged_state_dict(
    model: PreTrainedModel, state: dict[str, torch.Tensor] | None = None, adapters: bool = True
) -> dict[str, torch.Tensor]:
    """The base model's weights with the adapters folded in, under the base model's own names.

    Computed on the side (W + ΔW per adapted parameter) so the training weights are never touched. ``state``:
    the LoRA model's whole state dict, when ``model.state_dict()`` would give shards (FSDP; the adapters are then
    read from the gathered modules). Not ``adapters``: the base weights alone (what a vLLM server loads adapters
    onto).
    """
    from peft.tuners.lora import LoraLayer, ParamWrapper

    base = model.get_base_model()  # type: ignore[operator]
    deltas: dict[str, torch.Tensor] = {}  # the adapted parameter's own name → ΔW, of its shape
    for name, module in base.named_modules():
        if adapters and isinstance(module, LoraLayer) and module.active_adapters[0] in module.lora_A:
            param = module.parameter_name if isinstance(module, ParamWrapper) else "weight"
            deltas[base_name(f"{name}.{param}")] = module.get_delta_weight(module.active_adapters[0])  # type: ignore[attr-defined]
    merged = {}
    prefix = "base_model.model."  # a PeftModel's state dict names the base model's weights under it
    base_state = base.state_dict() if state is None else {k.removeprefix(prefix): v for k, v in state.items()}
    for key, value in base_state.items():
        if ".lora_" in key or ".original_module." in key:
            continue
        key = base_name(key).replace(".modules_to_save.default.", ".")
        if key in deltas:
            value = value + deltas[key].to(value.dtype)
        merged[key] = value.detach().cpu().clone()
    return merged


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path, state: dict[str, torch.Tensor] | None = None
) -> None:
    """Hugging Face layout (safetensors + tokenizer), loadable by plain transformers.

    A LoRA model is saved merged at ``path``, and its adapters beside it in ``adapters/<name>``
    for resuming. ``state``: the model's whole state dict, for a sharded model (FSDP) whose own gives shards.
    """
    if is_lora(model):
        merged = merged_state_dict(model, state)
        model.get_base_model().save_pretrained(path, state_dict=merged)  # type: ignore[operator]
        model.save_pretrained(path.parent / "adapters" / path.name, state_dict=state)
    elif state is not None:
        model.save_pretrained(path, state_dict=untied(model, state))
    else:
        model.save_pretrained(path)
    check_saved(model, path)
    tokenizer.save_pretrained(path)


def untied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a gathered copy of ``model``'s) with each tied weight once, under its first name, as a plain
    ``save_pretrained`` writes it (GPT-2's output layer is its input embedding): the copies share no storage, so
    save_pretrained would write both."""
    first: dict[int, str] = {}
    tied = [name for name, t in model.state_dict(keep_vars=True).items() if first.setdefault(id(t), name) != name]
    return {name: value for name, value in state.items() if name not in tied}


class IncompleteSaveError(RuntimeError):
    """A saved model whose weight files do not hold the model's weights under its own names: loaded back, the
    missing ones would start random and the extra ones be ignored."""


def saved_tensor_names(path: Path) -> set[str]:
    """The tensor names of the safetensors weights in ``path``, from the index or the files' headers (no tensor
    is read)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def check_saved(model: PreTrainedModel, path: Path) -> None:
    """Raise :class:`IncompleteSaveError` unless the weights saved in ``path`` are, under the names loading gives
    them, exactly the weights of ``model``'s architecture (with LoRA: its base model's, adapters merged): each
    tied group once at least, nothing else.

    The names to expect come from the architecture built empty (on the meta device, from ``model``'s config),
    not from the model saved, and the saved names are renamed the way ``from_pretrained`` renames them
    (transformers 5 saves some architectures in their original layout, e.g. Qwen3-MoE's experts one by one,
    and fuses them again on load): only the headers are read, no second model is loaded.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    base = model.get_base_model() if is_lora(model) else model  # type: ignore[operator]
    with torch.device("meta"):
        empty = type(base)(copy.deepcopy(base.config))
    expected = empty.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}  # one tensor (tied weights share one) → its names
    for name, tensor in expected.items():
        groups.setdefault(id(tensor), []).append(name)
    transforms = get_model_conversion_mapping(empty)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    loaded = set()
    for name in saved_tensor_names(path):
        renamed, _ = rename_source_key(name, renamings, converters, empty.base_model_prefix, expected)
        loaded.add(renamed if renamed in expected or name not in expected else name)
    missing = [names[0] for names in groups.values() if not loaded.intersection(names)]
    extra = sorted(loaded - set(expected))
    if missing or extra:
        raise IncompleteSaveError(
            f"the {base.config.model_type} model saved in {path.name} would not load back whole: "
            + "; ".join(
                f"{what} {len(names)} weights ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                for what, names in (("missing", sorted(missing)), ("unexpected", extra))
                if names
            )
        )


def context_length(model: PreTrainedModel) -> int | None:
    """How many positions the model can attend to, when its config says."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, name, None), int):
            return int(getattr(config, name))
    return None


def check_fits(model: PreTrainedModel, tokens: int, what: str) -> None:
    """A clear error before training or sampling, instead of an index error deep inside the model."""
    limit = context_length(model)
    if limit is not None and tokens > limit:
        raise ValueError(f"{what} ({tokens} tokens) exceeds the model's context of {limit} positions")


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
