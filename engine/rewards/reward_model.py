"""Scoring with a reward model: on the policy's own tokens when the two share a vocabulary, otherwise on the
text, encoded with the reward model's own tokenizer (as OpenRLHF's remote reward models receive decoded text).
"""

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.core.data import encode_completion, pad_right, render, truncate
from engine.core.models import ScalarHead, context_length
from engine.core.ops import reward_index
from engine.spec.rows import Text


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """Whether token ids mean the same text under both tokenizers, so one model's ids can be fed to the other."""
    return a is b or a.get_vocab() == b.get_vocab()


def sequence_scores(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Reward model score of each sequence (B,), read where the model reads (:func:`engine.core.ops.reward_index`)."""
    scores, _ = ScalarHead(model)(input_ids, attention_mask)  # (B, L)
    index = reward_index(input_ids, attention_mask, model.config.pad_token_id)  # (B,)
    return scores.gather(1, index.unsqueeze(1)).squeeze(1)


@torch.inference_mode()
def score_texts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Text],
    responses: list[str],
    stopped: list[bool],
    prompt_tokenizer: PreTrainedTokenizerBase | None = None,
) -> torch.Tensor:
    """Scores (B,) of each prompt + response, encoded with the reward model's ``tokenizer`` the way its training
    encoded preference pairs: plain prompts as prefix + prompt + response, with EOS when the response
    ``stopped``; chat prompts rendered by its chat template with the response as the assistant's message. A
    chat prompt and a reward model without a template: the prompt as ``prompt_tokenizer`` (the policy's)
    rendered it, read as text. Over-long sequences lose the start of the prompt, then the end of the response.
    """
    limit = context_length(model) or 1_000_000
    sequences = []
    for prompt, response, done in zip(prompts, responses, stopped, strict=True):
        if isinstance(prompt, list) and getattr(tokenizer, "chat_template", None):
            ids, trained = encode_completion(tokenizer, prompt, [{"role": "assistant", "content": response}])
        else:
            if isinstance(prompt, list):
                prompt = render(prompt_tokenizer or tokenizer, prompt, add_generation_prompt=True)
            ids, trained = encode_completion(tokenizer, prompt, response)
            if not done:  # no EOS where the policy wrote none
                ids, trained = ids[:-1], trained[:-1]
        sequences.append(truncate(ids, trained, limit)[0])
    input_ids, attention_mask = pad_right(sequences, tokenizer.pad_token_id)  # (B, L)
    device = next(model.parameters()).device
    return sequence_scores(model, input_ids.to(device), attention_mask.to(device))
