"""Built-in model, tokenizer and demo datasets: everything the offline demo and tests need.

- ``builtin:tiny``: a 2-layer, 128-dim GPT-2 (about 0.4M parameters) with a byte-level BPE
  tokenizer trained offline on the reviews corpus (``tokenizer.json``, rebuilt by
  ``scripts/build_tokenizer.py``). Weights are random, initialised from the job's seed.
- ``builtin:reviews-*``: the synthetic reviews task of :mod:`engine.builtin.reviews`.
- ``builtin:digits-*``: the verifiable digits task of :mod:`engine.builtin.digits` (rewards by a rule).
"""

from collections.abc import Callable
from pathlib import Path

from engine.builtin import digits, reviews

TOKENIZER_FILE = Path(__file__).with_name("tokenizer.json")
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
TINY_MODEL = "builtin:tiny"

# GPT-2 hyperparameters of builtin:tiny; vocab size and special ids come from the tokenizer.
TINY_CONFIG: dict[str, int | float] = {
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 128,
    "n_positions": 128,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}

# name -> (dataset kind, rows factory); the kinds are engine.spec.rows'.
DATASETS: dict[str, tuple[str, Callable[[], list[dict[str, str]]]]] = {
    "reviews-sft": ("sft", lambda: reviews.sft_rows("train")),
    "reviews-sft-eval": ("sft", lambda: reviews.sft_rows("eval")),
    "reviews-prefs": ("preference", lambda: reviews.pref_rows("train")),
    "reviews-prefs-eval": ("preference", lambda: reviews.pref_rows("eval")),
    "reviews-prompts": ("prompts", lambda: reviews.prompt_rows("train")),
    "reviews-prompts-eval": ("prompts", lambda: reviews.prompt_rows("eval")),
    "digits-sft": ("sft", lambda: digits.sft_rows("train")),
    "digits-sft-eval": ("sft", lambda: digits.sft_rows("eval")),
    "digits-prompts": ("prompts", lambda: digits.prompt_rows("train")),
    "digits-prompts-eval": ("prompts", lambda: digits.prompt_rows("eval")),
}
