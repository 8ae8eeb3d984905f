"""Tiny models that end their turn with a token other than their tokenizer's EOS, as Llama 3 (``<|eot_id|>``, EOS
``<|end_of_text|>``) and Phi-3 (``<|end|>``, EOS ``<|endoftext|>``) do, their ``generation_config.json`` naming the
end-of-turn token. Their weights are set so that, whatever the prompt, they answer :data:`ANSWER` and then the
end-of-turn token, and go on answering after it: a sampler that ignores the end of turn runs to its token limit.

    folder = build_end_of_turn_model(LLAMA3, tmp_path / "llama3")  # AutoModelForCausalLM / AutoTokenizer load it
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

from tests.models import SIZES, _trained_bpe

ANSWER = " a great film"
"""What the models answer to any prompt (three tokens of the shared tokenizer), before their end-of-turn token."""
LOGIT = 80.0
"""The logit of the next token of the answer (every other token's is 0): sampling at temperature 1 picks it."""


@dataclass(frozen=True)
class Family:
    """The special tokens and chat template of a model family whose turn ends before its EOS."""

    config: type[PretrainedConfig]
    bos: str
    eos: str
    end_of_turn: str
    others: tuple[str, ...]
    chat_template: str


LLAMA3 = Family(
    config=LlamaConfig,
    bos="<|begin_of_text|>",
    eos="<|end_of_text|>",
    end_of_turn="<|eot_id|>",
    others=("<|start_header_id|>", "<|end_header_id|>"),
    chat_template=(
        "{{ bos_token }}{% for message in messages %}"
        "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
)
PHI3 = Family(
    config=Phi3Config,
    bos="<s>",
    eos="<|endoftext|>",
    end_of_turn="<|end|>",
    others=("<|system|>", "<|user|>", "<|assistant|>"),
    chat_template=(
        "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
)


def build_end_of_turn_tokenizer(family: Family, folder: Path) -> PreTrainedTokenizerFast:
    """The tests' byte-level BPE with ``family``'s special tokens (its EOS as EOS and pad) and chat template."""
    tokenizer = Tokenizer.from_str(_trained_bpe())
    tokenizer.add_special_tokens([family.bos, family.eos, family.end_of_turn, *family.others])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=family.bos, eos_token=family.eos, pad_token=family.eos, unk_token=None
    )
    fast.chat_template = family.chat_template
    fast.save_pretrained(folder)
    return fast


def build_end_of_turn_model(family: Family, folder: Path, generation_eos: tuple[str, ...] | None = None) -> Path:
    """A 2-layer, 64-dim causal LM of ``family`` and its tokenizer in ``folder``, whose generation config lists
    ``generation_eos`` as its ``eos_token_id`` (default: the end-of-turn token and the EOS, as Llama 3 lists them).

    Its layers add nothing to the residual stream (their weights are 0), so each position's logits depend on its
    own token alone: a bigram model. Every token leads to the first token of :data:`ANSWER`, each answer token to
    the next, the last one to the end-of-turn token (which leads to the answer again).
    """
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_end_of_turn_tokenizer(family, folder)
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    end_of_turn = tokenizer.convert_tokens_to_ids(family.end_of_turn)
    config = family.config(
        **SIZES,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    # (A + 1, H) orthonormal rows: states[0] is the embedding of every token but the answer's, states[i + 1] the
    # embedding of the answer's i-th token
    directions = torch.randn(config.hidden_size, len(answer) + 1, generator=torch.Generator().manual_seed(0))
    states = torch.linalg.qr(directions)[0].T
    scale = LOGIT / config.hidden_size**0.5  # the final RMSNorm scales a unit vector to norm sqrt(H)
    with torch.no_grad():
        for param in model.model.layers.parameters():
            param.zero_()
        embeddings = model.get_input_embeddings().weight  # (V, H)
        head = model.get_output_embeddings().weight  # (V, H)
        embeddings.copy_(states[0].expand_as(embeddings))
        head.zero_()
        for i, token in enumerate(answer):
            embeddings[token] = states[i + 1]
            head[token] = scale * states[i]  # the token after states[i]
        head[end_of_turn] = scale * states[len(answer)]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in generation_eos or (family.end_of_turn, family.eos)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(folder)
    return folder
