"""Sampling with a KV cache, for PPO rollouts and for generating from any checkpoint."""

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StaticCache
from transformers.cache_utils import StaticLayer

from engine.callbacks import Callbacks
from engine.core.data import encode_prompts
from engine.core.models import check_fits, context_length
from engine.core.models import stop_token_ids as model_stop_ids
from engine.core.ops import is_stop, logprobs_from_logits, position_ids_from_mask, stop_ids, truncate_after_stop
from engine.spec.rows import Text


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row from (B, V) logits; temperature 0 is greedy. Returns (B,)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p
        drop_sorted[:, 0] = False  # the top token stays, however small top_p (one below float32's range is 0)
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = logits.softmax(-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


logger = logging.getLogger(__name__)


class Interrupted(Exception):
    """Sampling stopped between two decoding steps because its caller's ``stop`` asked."""


EOS_CHECK_EVERY = 8
"""Decoding steps between two looks (each a host sync) at whether every row has produced a stop token."""
BUCKET_LEVELS = 4
"""How many sizes a compiled decoder pads prompt lengths and batch rows to, each half the one above: at most
``BUCKET_LEVELS²`` compiled shapes per job, whatever the prompts."""
RECOMPILE_LIMIT = 4 * BUCKET_LEVELS**2
"""The recompile limit in force while a compiled decoding step runs (dynamo's default of 8 would fall back to
eager silently at the ninth shape): above every shape the buckets allow."""


_LIMITS: dict[str, Any] = {
    name: value
    for name, value in (("recompile_limit", RECOMPILE_LIMIT), ("fail_on_recompile_limit_hit", True))
    if hasattr(torch._dynamo.config, name)
}
"""Dynamo's settings while a compiled step runs (the names this version of torch knows)."""
KEPT_CACHES = 4
"""Static caches a :class:`Decoder` keeps (the most recently used): two shapes' with their prompts', so the
memory they hold stays within twice that of the largest, and a rollout alternating between two shapes replays
both shapes' graphs. A shape whose cache was let go gets a new one, and its graph is recorded again."""


def bucket(n: int, top: int, levels: int = BUCKET_LEVELS, smallest: int = 1) -> int:
    """The size ``n`` is padded to: the smallest of ``top``, ``top/2``, ... (``levels`` sizes, rounded up, none
    below ``smallest``) that holds it; beyond ``top``, the next power of two."""
    if n > top:
        return 1 << (n - 1).bit_length()
    sizes = [max(-(-top // 2**k), min(smallest, top)) for k in range(levels)]  # top, top/2, ... rounded up
    return min(size for size in sizes if size >= n)


def _decode_step(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: StaticCache,
    cache_position: torch.Tensor,
) -> torch.Tensor:
    """One decoding step on a static cache: the next-token logits (B, V). The function :class:`Decoder` compiles
    (its own code object, so its compiled shapes never count against those of a compiled training forward)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                use_cache=True, cache_position=cache_position)  # fmt: skip
    return out.logits[:, -1]


def compile_options(device: torch.device) -> dict[str, Any] | None:
    """``torch.compile``'s arguments for the decoding step on ``device``, None where it is not compiled: on CUDA,
    inductor with CUDA graphs (what ``mode="reduce-overhead"`` turns on), a graph that cannot be recorded an error
    rather than a silent skip. Elsewhere decoding runs eagerly (a compile costs more than it saves on a CPU)."""
    if device.type != "cuda":
        return None
    options = {"triton.cudagraphs": True}
    if hasattr(torch._inductor.config.triton, "cudagraph_or_error"):  # torch 2.9 and later
        options["triton.cudagraph_or_error"] = True
    return {"options": options}


@dataclass
class DecodeStats:
    """What a :class:`Decoder` did over a job: which path its steps took, and the compiles and CUDA-graph
    recordings per shape (``"<rows>x<cache positions>"``)."""

    path: str
    """``compiled`` (the steps compiled, CUDA graphs on CUDA), ``static`` (a static cache, eagerly)."""
    compiled_steps: int = 0
    eager_steps: int = 0
    compiles: dict[str, int] = field(default_factory=dict)
    recordings: dict[str, int] = field(default_factory=dict)
    cudagraph_skips: int = 0
    fallback: str | None = None
    """Why the compiled steps stopped and decoding went on eagerly, when they did."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Decoder:
    """A job's sampling on static KV caches, its decoding steps compiled (on CUDA: captured as CUDA graphs and
    replayed). Built once per job and closed when it ends, which logs its :class:`DecodeStats` (:func:`report`);
    :func:`release_compiled` then frees what torch keeps.

    Prompts are left-padded to one of a few lengths and the batch to one of a few row counts
    (:func:`bucket`, from ``max_prompt_length`` and ``max_rows`` down), so a job with prompts of every length
    compiles at most ``BUCKET_LEVELS²`` shapes. Each shape has one static cache, reset between rollouts, so its
    addresses stay put and its CUDA graph is recorded once and replayed (the last :data:`KEPT_CACHES` caches are
    kept). A step that cannot be compiled (or recorded) falls back to eager decoding for the rest of the job, said
    once through ``warn``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_prompt_length: int,
        max_rows: int,
        compile: dict[str, Any] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        """``compile``: ``torch.compile``'s keyword arguments for the step (:func:`compile_options`), None to
        decode eagerly on the static caches."""
        self.model = model
        self.max_prompt_length = max_prompt_length
        self.max_rows = max_rows
        self.warn = warn
        self.stats = DecodeStats("compiled" if compile is not None else "static")
        self._compiled = torch.compile(_decode_step, dynamic=False, fullgraph=True, **compile) if compile else None
        self._caches: OrderedDict[tuple[int, int], StaticCache] = OrderedDict()
        self._shape = ""
        self._window = [0, 0]  # compiled and eager steps since the last compiled_fraction()
        # CUDA-graph recordings are counted by a callback of torch's, which holds this decoder weakly, and which
        # close() removes, or else the decoder's end
        this = weakref.ref(self)

        def on_compile_event(args: Any) -> None:
            decoder = this()
            if decoder is not None:
                decoder._count_recording(args)

        torch._dynamo.callback.callback_handler.register_start_callback(on_compile_event)
        self._unregister = weakref.finalize(self, _unregister, on_compile_event)

    def close(self) -> None:
        """The job is over: log what decoding did (:func:`report`), stop counting, drop the caches."""
        if self._unregister.alive:
            self._unregister()
            report(self.stats)
        self._caches.clear()
        self._compiled = None

    def compiled_fraction(self) -> float:
        """The share of decoding steps run compiled since the last call (1.0 when none ran)."""
        compiled, eager = self._window
        self._window = [0, 0]
        return compiled / (compiled + eager) if compiled + eager else 1.0

    def cache(self, rows: int, length: int) -> StaticCache:
        """The static cache of ``rows`` x ``length`` positions, emptied: the same tensors every rollout."""
        key = (rows, length)
        if key not in self._caches:
            self._caches[key] = cache = StaticCache(config=self.model.config, max_cache_len=length)
            if (window := _unslide(cache, length)) and self._compiled is not None:
                self._fall_back(f"a sliding window of {window} positions, shorter than the cache's {length}: its "
                                "position counter would make dynamo recompile the step at every token")  # fmt: skip
            while len(self._caches) > KEPT_CACHES:
                self._caches.popitem(last=False)  # the least recently used
        self._caches.move_to_end(key)
        cache = self._caches[key]
        cache.reset()
        return cache

    def shapes(self, rows: int, prompt_length: int) -> tuple[int, int]:
        """The padded row count and prompt length of a batch of ``rows`` x ``prompt_length``."""
        return bucket(rows, self.max_rows), bucket(prompt_length, self.max_prompt_length, smallest=16)

    def step(self, **inputs: Any) -> torch.Tensor:
        """One decoding step (:func:`_decode_step`'s arguments but the model): compiled while it can be."""
        rows, positions = inputs["attention_mask"].shape
        self._shape = f"{rows}x{positions}"
        if self._compiled is not None:
            counters = torch._dynamo.utils.counters
            graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
            try:
                with torch._dynamo.config.patch(_LIMITS):
                    torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are read and done with
                    logits = self._compiled(self.model, **inputs)
            except Exception as e:  # no compiler for this device, a graph break, a graph that cannot be recorded
                self._fall_back(_reason(e))
            else:
                compiles = counters["stats"]["unique_graphs"] - graphs
                if compiles:
                    self.stats.compiles[self._shape] = self.stats.compiles.get(self._shape, 0) + compiles
                self.stats.cudagraph_skips += counters["inductor"]["cudagraph_skips"] - skips
                self.stats.compiled_steps += 1
                self._window[0] += 1
                return logits
        self.stats.eager_steps += 1
        self._window[1] += 1
        return _decode_step(self.model, **inputs)

    def _fall_back(self, reason: str) -> None:
        self._compiled = None
        self.stats.fallback = reason
        message = f"the decoding steps could not be compiled ({reason}); sampling continues eagerly, slower"
        logger.warning(message)
        if self.warn is not None:
            self.warn(message)

    def _count_recording(self, args: Any) -> None:
        trigger = getattr(torch._dynamo.callback.CallbackTrigger, "CUDAGRAPH_RECORDING", None)
        if trigger is not None and args.callback_trigger == trigger:
            self.stats.recordings[self._shape] = self.stats.recordings.get(self._shape, 0) + 1


def _reason(error: BaseException) -> str:
    """The first line of what went wrong at the root of ``error`` (dynamo wraps a backend's error in its own)."""
    while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
        error = inner
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def report(stats: DecodeStats) -> None:
    """Log what a decoder did over its job: one INFO record of this module's logger, ``decode_stats`` its dict."""
    logger.info(
        "decoding: %s, %d steps compiled, %d eager, compiles %s, CUDA graph recordings %s%s",
        stats.path, stats.compiled_steps, stats.eager_steps, stats.compiles or "none", stats.recordings or "none",
        f", fell back: {stats.fallback}" if stats.fallback else "",
        extra={"decode_stats": stats.as_dict()},
    )  # fmt: skip


def _unregister(callback: Callable[[Any], None]) -> None:
    handler = torch._dynamo.callback.callback_handler
    if callback in handler.start_callbacks:
        handler.remove_start_callback(callback)


def job_decoder(
    model: PreTrainedModel,
    cuda_graphs: bool,
    max_prompt_length: int,
    max_rows: int,
    device: torch.device,
    warn: Callable[[str], None] | None = None,
) -> Decoder | None:
    """The :class:`Decoder` of a job's rollouts when ``cuda_graphs`` is on and :func:`compile_options` compiles
    for ``device``; None (the growing cache, eagerly) otherwise."""
    options = compile_options(device)
    if not cuda_graphs or options is None:
        return None
    return Decoder(model, max_prompt_length, max_rows, compile=options, warn=warn)


def decode_warning(callbacks: Callbacks) -> Callable[[str], None]:
    """How a job's decoder says that its steps fell back to eager: a ``warning`` event of the job."""
    return lambda message: callbacks.on_event("warning", message, {"reason": "decode_fallback"})


def release_compiled() -> None:
    """Forget every compiled function and CUDA graph of this process (``torch.compiler.reset``): what dynamo
    caches holds the models it compiled, and the graphs' memory pool. Called when a job ends."""
    if torch._dynamo.utils.counters["stats"]["unique_graphs"]:
        torch.compiler.reset()
        torch._dynamo.utils.counters.clear()


def _prefill(
    model: PreTrainedModel,
    decoder: Decoder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    group_size: int,
) -> tuple[StaticCache, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The prompts (B, P) prefilled into ``decoder``'s static cache for their padded shape, each row repeated
    ``group_size`` times and the batch padded with copies of its first row. Returns the cache, the last prompt
    position's logits, the attention mask over every cache position and the position ids (all with the padded
    rows), and the padded prompt length."""
    B, P = input_ids.shape
    rows = B * group_size
    padded_rows, padded_length = decoder.shapes(rows, P)
    input_ids = F.pad(input_ids, (padded_length - P, 0), value=0)  # left: masked out
    attention_mask = F.pad(attention_mask, (padded_length - P, max_new_tokens))  # (B, L + T), 0 ahead
    positions = position_ids_from_mask(attention_mask[:, :padded_length])
    length = padded_length + max_new_tokens
    cache = decoder.cache(padded_rows, length)
    source = cache if padded_rows == B else decoder.cache(B, length)
    out = model(input_ids=input_ids, attention_mask=attention_mask[:, :padded_length], position_ids=positions,
                cache=source, use_cache=True, cache_position=torch.arange(padded_length, device=input_ids.device),
                logits_to_keep=1)  # fmt: skip
    first_logits = out.logits[:, -1]
    if source is not cache:  # row i*G + g is prompt i's g-th sample; the padding rows copy row 0
        index = torch.arange(B, device=input_ids.device).repeat_interleave(group_size)
        index = F.pad(index, (0, padded_rows - rows))
        _copy_rows(source, cache, index)
        first_logits, attention_mask, positions = (t.index_select(0, index) for t in (first_logits, attention_mask,
                                                                                      positions))  # fmt: skip
    return cache, first_logits, attention_mask, positions, padded_length


def _unslide(cache: StaticCache, length: int) -> int | None:
    """``cache``'s sliding-window layers whose window holds all its ``length`` positions made plain static layers,
    in place: the same attention (the window never slides), without the Python position counter that dynamo would
    recompile the decoding step on at every token. Returns the window of a sliding layer left, if any."""
    layers: list[Any] = cache.layers
    for i, layer in enumerate(layers):
        if getattr(layer, "is_sliding", False) and layer.max_cache_len >= length:  # min(window, length) == length
            layers[i] = StaticLayer(max_cache_len=length)
    left = [layer.max_cache_len for layer in layers if getattr(layer, "is_sliding", False)]
    return min(left) if left else None


def _copy_rows(source: StaticCache, target: StaticCache, index: torch.Tensor) -> None:
    """``target``'s rows become ``source``'s rows ``index``, in place (the target's tensors keep their addresses)."""
    layers: list[tuple[Any, Any]] = list(zip(source.layers, target.layers, strict=True))  # StaticLayer pairs
    for src, dst in layers:
        keys, values = src.keys.index_select(0, index), src.values.index_select(0, index)
        if not dst.is_initialized:
            dst.lazy_initialization(keys, values)
        dst.keys.copy_(keys)
        dst.values.copy_(values)
        if isinstance(getattr(src, "cumulative_length", None), torch.Tensor):
            dst.cumulative_length.copy_(src.cumulative_length)
        if hasattr(src, "cumulative_length_int"):  # a sliding window's
            dst.cumulative_length_int = src.cumulative_length_int


@torch.inference_mode()
def sample(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    group_size: int = 1,
    decoder: Decoder | None = None,
    stop: Callable[[], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``max_new_tokens`` after left-padded prompts (B, P), reusing the KV cache; with
    ``group_size`` G, G samples of each prompt (rows ``i*G .. i*G + G - 1`` are prompt i's), the prompt
    prefilled once and its cache repeated for its group.

    Stops early once every row has produced a stop token, any of ``eos_token_id`` (one id or several, as
    transformers' ``generate`` takes it), looked at every :data:`EOS_CHECK_EVERY` steps (each look waits for the
    device) and cut back to the step where the last row stopped. Returns the raw tokens (B·G, T),
    T ≤ max_new_tokens, and their log-probabilities (B·G, T) under the model's full distribution at
    ``temperature`` (before top-k/top-p filtering: the quantity PPO's ratio is taken of), so a PPO rollout needs no
    second policy forward. Tokens after a row's stop token are junk for the caller to truncate
    (:func:`engine.core.ops.truncate_after_stop`).

    ``decoder``: decode on its static caches, through its compiled step (:class:`Decoder`); the same tokens as
    the growing cache, log-probs equal up to rounding. None: the growing cache, eagerly.

    ``stop``: asked before each decoding step; True raises :class:`Interrupted` (a cancel reaches a long sample).
    """
    B, P = input_ids.shape
    rows = B * group_size
    if decoder is not None:
        cache, first_logits, attention_mask, position_ids, P = _prefill(
            model, decoder, input_ids, attention_mask, max_new_tokens, group_size
        )
    else:
        position_ids = position_ids_from_mask(attention_mask)  # (B, P)
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                    logits_to_keep=1)  # fmt: skip
        cache, first_logits = out.cache, out.logits[:, -1]  # (B, V)
        if group_size > 1:
            cache.batch_repeat_interleave(group_size)  # in place: (B·G, ...) from here on
            first_logits = first_logits.repeat_interleave(group_size, dim=0)
            attention_mask = attention_mask.repeat_interleave(group_size, dim=0)
            position_ids = position_ids.repeat_interleave(group_size, dim=0)
    next_positions = position_ids[:, -1:] + 1  # (rows, 1), (padded rows, 1) with a decoder
    finished = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
    stops = torch.tensor(stop_ids(eos_token_id), dtype=input_ids.dtype, device=input_ids.device)  # (S,)
    tokens, logprobs, all_done = [], [], []
    logits = first_logits
    for t in range(max_new_tokens):
        if stop is not None and stop():
            raise Interrupted(f"sampling stopped after {t} of up to {max_new_tokens} tokens")
        logits = logits[:rows]  # (B·G, V): a decoder's padding rows are never sampled
        token = sample_next(logits, temperature, top_k, top_p, generator)  # (B·G,)
        tokens.append(token)
        logprobs.append(logprobs_from_logits(logits.float() / max(temperature, 1e-7), token))
        if len(stops):
            finished |= torch.isin(token, stops)
            all_done.append(finished.all())  # on the device: no sync here
            if (t + 1) % EOS_CHECK_EVERY == 0 and bool(all_done[-1]):
                break
        if t == max_new_tokens - 1:
            break
        if decoder is not None:
            attention_mask[:, P + t] = 1
            step_token = F.pad(token, (0, attention_mask.shape[0] - rows), value=0)  # padding rows: any token
            position = torch.full((1,), P + t, dtype=torch.long, device=input_ids.device)
            logits = decoder.step(input_ids=step_token.unsqueeze(1), attention_mask=attention_mask,
                                  position_ids=next_positions, cache=cache, cache_position=position)  # fmt: skip
        else:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
            out = model(input_ids=token.unsqueeze(1), attention_mask=attention_mask, position_ids=next_positions,
                        cache=cache, use_cache=True)  # fmt: skip
            logits = out.logits[:, -1]
        next_positions = next_positions + 1
    steps = len(tokens)
    if all_done:  # cut back to the step where the last row stopped, as a look every step would have
        ended = torch.stack(all_done)  # (steps,)
        steps = int(ended.int().argmax()) + 1 if bool(ended.any()) else steps
    return torch.stack(tokens[:steps], dim=1), torch.stack(logprobs[:steps], dim=1)  # (B·G, T), (B·G, T)


@dataclass
class Completion:
    prompt: Text
    text: str
    finish_reason: str
    """``stop`` when the model produced a stop token, ``length`` when it ran out of tokens."""
    tokens: list[int] = field(default_factory=list)
    """The response's token ids, up to and including its stop token."""
    prompt_tokens: int = 0
    """Tokens of the prompt the model was given (after truncation)."""


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Text],
    max_new_tokens: int = 32,
    temperature: float = 0.7,
    top_p: float = 1.0,
    seed: int = 0,
    max_prompt_length: int = 512,
    n: int = 1,
    stop_token_ids: Sequence[int] | None = None,
) -> list[Completion]:
    """Complete each prompt ``n`` times (one batch, each prompt repeated ``n`` times in a row); seeded, so the
    same call returns the same texts. A prompt is text (after the tokenizer's BOS, where it adds one) or chat
    messages (rendered by the chat template with the generation prompt): encoded as training encodes prompts.

    A completion ends at the first of ``stop_token_ids`` (None: the model's, :func:`engine.core.models.stop_token_ids`,
    where transformers' ``generate`` ends), its text without it. Prompts longer than the model's context allows
    (after room for ``max_new_tokens``) keep their end.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    check_fits(model, max_new_tokens + 1, "max_new_tokens + a one-token prompt")
    limit = context_length(model)
    if limit is not None:
        max_prompt_length = min(max_prompt_length, limit - max_new_tokens)
    device = next(model.parameters()).device
    model.eval()
    batch = [prompt for prompt in prompts for _ in range(n)]
    input_ids, attention_mask = encode_prompts(tokenizer, batch, max_prompt_length)  # (B, P)
    generator = torch.Generator(device).manual_seed(seed)
    stops = model_stop_ids(model, tokenizer) if stop_token_ids is None else tuple(stop_token_ids)
    raw, _ = sample(
        model,
        input_ids.to(device),
        attention_mask.to(device),
        max_new_tokens,
        temperature,
        top_p=top_p,
        eos_token_id=stops,
        generator=generator,
    )
    responses, mask, stopped = truncate_after_stop(raw, stops, tokenizer.pad_token_id)
    texts = response_texts(tokenizer, responses, mask, stops)
    lengths, prompt_lengths = mask.sum(1).tolist(), attention_mask.sum(1).tolist()
    return [
        Completion(prompt, text, "stop" if done else "length", responses[i, : lengths[i]].tolist(), prompt_lengths[i])
        for i, (prompt, text, done) in enumerate(zip(batch, texts, stopped.tolist(), strict=True))
    ]


def response_texts(
    tokenizer: PreTrainedTokenizerBase, responses: torch.Tensor, mask: torch.Tensor, stop_token_ids: Sequence[int]
) -> list[str]:
    """The text of each response (B, T) up to its stop token, without it, special tokens dropped: what a grader
    or a client reads. ``mask`` (B, T): 1 on kept tokens, those of :func:`engine.core.ops.truncate_after_stop`."""
    text_mask = mask.bool() & ~is_stop(responses, stop_token_ids)  # (B, T): the stop token is the last kept one
    return tokenizer.batch_decode(responses.masked_fill(~text_mask, tokenizer.pad_token_id), skip_special_tokens=True)
