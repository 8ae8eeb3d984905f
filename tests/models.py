"""The kinds of models users bring, built inside the tests: tiny random-weight Llama, Qwen2, Mistral and
GPT-NeoX (the training matrix, ``ARCHITECTURES``) and the further architectures of ``MORE_ARCHITECTURES``
(Qwen3, Qwen3-MoE, Gemma 2 and 3, Phi-3, OLMo 2, Granite, SmolLM3, gpt-oss) with a small byte-level BPE
tokenizer that has a ChatML chat template, and small conversational datasets in TRL's formats. Nothing is
downloaded; every model comes from its transformers config class.

    folder = build_model("qwen2", tmp_path / "qwen2")  # AutoModelForCausalLM / AutoTokenizer load it
    write_jsonl(chat_rows("preference", 16), tmp_path / "prefs.jsonl")
"""

import functools
import json
import random
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

from engine.builtin import reviews

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<s>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # EOS: ChatML ends every turn with it, as Qwen2-instruct does
# The trainer's cap: the corpus has few distinct words, so merges run out at 638 tokens (specials included).
VOCAB_SIZE = 1000
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ARCHITECTURES = ("llama", "qwen2", "mistral", "gpt_neox")
"""The training matrix (tests/engine/test_byo_matrix.py trains each, in full and with LoRA)."""
MORE_ARCHITECTURES = (
    "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "smollm3", "gpt_oss",
)  # fmt: skip
"""Architectures users brought besides: buildable like the matrix's, checked where they differ (saving and
loading back whole, their heads), not trained by the matrix."""
CONFIGS: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "mistral": MistralConfig,
    "gpt_neox": GPTNeoXConfig,
    "qwen3": Qwen3Config,
    "qwen3_moe": Qwen3MoeConfig,
    "gemma2": Gemma2Config,
    "gemma3_text": Gemma3TextConfig,
    "phi3": Phi3Config,
    "olmo2": Olmo2Config,
    "granite": GraniteConfig,
    "smollm3": SmolLM3Config,
    "gpt_oss": GptOssConfig,
}
# Shared by every architecture; GPT-NeoX has no grouped-query attention, the others get 2 KV heads.
SIZES = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}
KV_HEADS = {"llama": 2, "qwen2": 2, "mistral": 2, **dict.fromkeys(MORE_ARCHITECTURES, 2)}
# What the further architectures need besides: a head size of hidden / heads where the config's default is
# larger (Qwen3, Gemma and gpt-oss default to 128 or 256), and few, small experts for the MoE ones.
HEAD_DIM = {"head_dim": 16}
EXTRA: dict[str, dict[str, Any]] = {
    "qwen3": HEAD_DIM,
    "qwen3_moe": {**HEAD_DIM, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "gemma2": HEAD_DIM,
    "gemma3_text": HEAD_DIM,
    "gpt_oss": {**HEAD_DIM, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
}

# The conversational datasets' wording; the tokenizer is trained on it too.
SYSTEM_PROMPT = "You finish short movie reviews."
SFT_REQUEST = "Finish this {mood} review: {prompt}"
FOLLOW_UP = "Now a {mood} one: {prompt}"
REQUEST = "Finish this review: {prompt}"
CHAT_KINDS = ("sft_messages", "sft_prompt_completion", "preference", "preference_implicit", "prompts")


@functools.cache
def _trained_bpe() -> str:
    """The byte-level BPE trained on the reviews corpus plus chat lines, as JSON (trained once per process)."""
    texts = reviews.corpus()
    for row in reviews.sft_rows("eval"):
        mood = "positive" if reviews.is_positive(row["completion"]) else "negative"
        texts += [
            f"system\n{SYSTEM_PROMPT}",
            f"user\n{SFT_REQUEST.format(mood=mood, prompt=row['prompt'])}",
            f"user\n{FOLLOW_UP.format(mood=mood, prompt=row['prompt'])}",
            f"user\n{REQUEST.format(prompt=row['prompt'])}",
            f"assistant\n{row['completion'].strip()}",
        ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer.to_str()


def build_tokenizer(folder: Path, *, pad: bool = True, add_bos: bool = False, chat_template: bool = True) -> Path:
    """A byte-level BPE tokenizer (``<s>`` BOS, ``<|im_end|>`` EOS, ``<|pad|>`` when ``pad``) saved in ``folder``.

    ``add_bos`` prepends ``<s>`` when ``add_special_tokens=True``, as Llama's tokenizer does; ``chat_template``
    sets the ChatML template.
    """
    tokenizer = Tokenizer.from_str(_trained_bpe())
    if pad:
        tokenizer.add_special_tokens([PAD_TOKEN])  # the last id, after the trained vocabulary
    if add_bos:
        bos_id = tokenizer.token_to_id(BOS_TOKEN)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1", special_tokens=[(BOS_TOKEN, bos_id)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=IM_END,
        pad_token=PAD_TOKEN if pad else None,
        # Saved as null: otherwise transformers' Qwen2Tokenizer, which AutoTokenizer picks for a qwen2 folder,
        # adds its default "<|endoftext|>" as the unknown token, one more token than the model's vocabulary.
        unk_token=None,
        additional_special_tokens=[IM_START],
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder


def build_model(
    arch: str,
    folder: Path,
    *,
    tokenizer: Path | None = None,
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    config: dict[str, Any] | None = None,
    **tokenizer_options: bool,
) -> Path:
    """A 2-layer, 64-dim random-weight causal LM of ``arch`` (of ``ARCHITECTURES`` or ``MORE_ARCHITECTURES``) and
    its tokenizer, saved in ``folder``.

    The tokenizer is copied from ``tokenizer`` (a folder) or built with ``build_tokenizer(**tokenizer_options)``;
    embeddings stay tied or untied as the architecture's config has them unless ``tie_word_embeddings`` is given;
    ``config``: more of the config's fields (e.g. 2 heads of 32, which vLLM's CPU attention takes, where it refuses
    the 4 heads of 16 of the default size).
    """
    if arch not in CONFIGS:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {ARCHITECTURES + MORE_ARCHITECTURES}")
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = build_tokenizer(folder, **tokenizer_options)
    elif tokenizer_options:
        raise ValueError("tokenizer options apply only when build_model builds the tokenizer")
    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer)
    options: dict[str, Any] = {
        **SIZES,
        "vocab_size": len(tok),
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    if arch in KV_HEADS:
        options["num_key_value_heads"] = KV_HEADS[arch]
    options.update(EXTRA.get(arch, {}))
    if tie_word_embeddings is not None:
        options["tie_word_embeddings"] = tie_word_embeddings
    options.update(config or {})
    model_config = CONFIGS[arch](**options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config)
    model.save_pretrained(folder)
    if tokenizer != folder:
        tok.save_pretrained(folder)
    return folder


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def _assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content.strip()}


def _mood(completion: str) -> str:
    return "positive" if reviews.is_positive(completion) else "negative"


@functools.cache
def _review_rows() -> tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]]]:
    """The built-in train splits: SFT rows, clean positive-vs-negative preference rows, prompt rows."""
    prefs = [
        row
        for row in reviews.pref_rows("train")
        if reviews.sentiment_balance(row["chosen"]) > 0 > reviews.sentiment_balance(row["rejected"])
    ]
    return reviews.sft_rows("train"), prefs, reviews.prompt_rows("train")


def chat_rows(kind: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows of a TRL conversational dataset built from the built-in reviews task (one of ``CHAT_KINDS``).

    - ``sft_messages``: ``{messages}``, the user asking for a positive or negative review; some rows open with a
      system message, some have a second user/assistant turn.
    - ``sft_prompt_completion``: ``{prompt: [user], completion: [assistant]}``.
    - ``preference``: ``{prompt: [user], chosen: [assistant], rejected: [assistant]}``; chosen is a positive review
      and rejected a negative one (the pairs of ``builtin:reviews-prefs`` where that holds).
    - ``preference_implicit``: ``{chosen: [user, assistant], rejected: [user, assistant]}``, the same user turn.
    - ``prompts``: ``{prompt: [user]}``.
    """
    if kind not in CHAT_KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {CHAT_KINDS}")
    rng = random.Random(f"tests/models/{kind}/{seed}")
    sft, prefs, prompts = _review_rows()
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        if kind == "sft_messages":
            first, second = rng.sample(sft, 2)
            messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.5 else []
            messages += [
                _user(SFT_REQUEST.format(mood=_mood(first["completion"]), prompt=first["prompt"])),
                _assistant(first["completion"]),
            ]
            if rng.random() < 0.3:
                messages += [
                    _user(FOLLOW_UP.format(mood=_mood(second["completion"]), prompt=second["prompt"])),
                    _assistant(second["completion"]),
                ]
            rows.append({"messages": messages})
        elif kind == "sft_prompt_completion":
            row = rng.choice(sft)
            prompt = [_user(SFT_REQUEST.format(mood=_mood(row["completion"]), prompt=row["prompt"]))]
            rows.append({"prompt": prompt, "completion": [_assistant(row["completion"])]})
        elif kind == "preference":
            row = rng.choice(prefs)
            prompt = [_user(REQUEST.format(prompt=row["prompt"]))]
            rows.append(
                {"prompt": prompt, "chosen": [_assistant(row["chosen"])], "rejected": [_assistant(row["rejected"])]}
            )
        elif kind == "preference_implicit":
            row = rng.choice(prefs)
            user = _user(REQUEST.format(prompt=row["prompt"]))
            rows.append(
                {"chosen": [user, _assistant(row["chosen"])], "rejected": [dict(user), _assistant(row["rejected"])]}
            )
        else:
            rows.append({"prompt": [_user(REQUEST.format(prompt=rng.choice(prompts)["prompt"]))]})
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> Path:
    """``rows`` as JSON lines at ``path``; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def openai_rows(method: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows of OpenAI's fine-tuning formats from the same reviews conversations: ``supervised``
    ``{messages}``; ``dpo`` ``{input: {messages}, preferred_output, non_preferred_output}``; ``reinforcement``
    ``{messages, mood}`` (the user's request, and a reference field for graders: the mood asked for)."""
    if method == "supervised":
        return chat_rows("sft_messages", n, seed)
    if method == "dpo":
        return [
            {"input": {"messages": row["prompt"]}, "preferred_output": row["chosen"],
             "non_preferred_output": row["rejected"]}
            for row in chat_rows("preference", n, seed)
        ]  # fmt: skip
    if method == "reinforcement":
        return [{"messages": row["prompt"], "mood": "positive"} for row in chat_rows("prompts", n, seed)]
    raise ValueError(f"unknown method {method!r}")
