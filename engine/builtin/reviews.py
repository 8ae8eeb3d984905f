"""The synthetic "reviews" task: short movie reviews with positive or negative wording.

A prompt opens a review ("last night i saw the new thriller and it was"); a completion
continues it with a few sentiment-bearing phrases. Everything is generated from a fixed
seed, so every machine builds byte-identical datasets without a network.

Datasets (rows in the upload formats of the README; each name has a held-out twin ending in ``-eval``):
- ``reviews-sft``: ``{prompt, completion}``, half positive, half negative completions.
- ``reviews-prefs``: ``{prompt, chosen, rejected}``, chosen has the higher sentiment
  balance. Besides clean positive-vs-negative pairs it holds mixed completions, so a reward
  model has to weigh the words rather than spot a single positive one.
- ``reviews-prompts``: ``{prompt}``.

``is_positive`` is the ground-truth judge. It is used to evaluate samples, never as the
training reward (PPO is rewarded by the learned reward model only).
"""

import random
import re

POSITIVE = (
    "great",
    "wonderful",
    "brilliant",
    "superb",
    "delightful",
    "moving",
    "charming",
    "excellent",
    "beautiful",
    "fantastic",
    "clever",
    "gripping",
    "funny",
    "touching",
)
NEGATIVE = (
    "awful",
    "boring",
    "dull",
    "terrible",
    "clumsy",
    "painful",
    "tedious",
    "bland",
    "horrible",
    "weak",
    "messy",
    "silly",
    "lifeless",
    "forgettable",
)
ASPECTS = (
    "the acting",
    "the story",
    "the music",
    "the ending",
    "the dialogue",
    "the cast",
    "the script",
    "the pacing",
    "the camera work",
    "the lead",
    "the soundtrack",
    "the plot",
)
OPENERS = (
    "last night i saw",
    "we watched",
    "i finally watched",
    "my friends and i saw",
    "yesterday i rented",
    "i went to see",
    "my sister showed me",
    "i streamed",
)
SUBJECTS = (
    "this movie",
    "the film",
    "the new thriller",
    "this comedy",
    "the sequel",
    "this drama",
    "the remake",
    "this documentary",
    "the animated film",
    "this western",
)
LINKS = ("and it was", "and honestly it was", "and i thought it was", "and overall it was")
POSITIVE_ENDINGS = ("i loved it .", "i would watch it again .", "highly recommended .", "a real treat .")
NEGATIVE_ENDINGS = ("i hated it .", "i want my money back .", "not recommended .", "a waste of time .")

SPLIT_SIZES = {"train": 4000, "eval": 400}
_WORD = re.compile(r"[a-z]+")
_POSITIVE_SET = frozenset(POSITIVE)
_NEGATIVE_SET = frozenset(NEGATIVE)


def sentiment_balance(text: str) -> int:
    """Positive words minus negative words in ``text``."""
    words = _WORD.findall(text.lower())
    return sum(w in _POSITIVE_SET for w in words) - sum(w in _NEGATIVE_SET for w in words)


def is_positive(text: str) -> bool:
    """Ground truth: a completion is positive when it has more positive than negative words."""
    return sentiment_balance(text) > 0


def _prompt(rng: random.Random) -> str:
    return f"{rng.choice(OPENERS)} {rng.choice(SUBJECTS)} {rng.choice(LINKS)}"


def _completion(rng: random.Random, n_pos: int, n_neg: int) -> str:
    """A completion carrying ``n_pos`` positive and ``n_neg`` negative adjectives."""
    adjectives = rng.sample(POSITIVE, n_pos) + rng.sample(NEGATIVE, n_neg)
    if not adjectives:
        return " okay . nothing special ."
    rng.shuffle(adjectives)
    first, rest = adjectives[0], adjectives[1:]
    clauses = [f" {first} ."]
    for adjective in rest:
        clauses.append(f" {rng.choice(ASPECTS)} was {adjective} .")
    if n_pos > n_neg:
        clauses.append(" " + rng.choice(POSITIVE_ENDINGS))
    elif n_neg > n_pos:
        clauses.append(" " + rng.choice(NEGATIVE_ENDINGS))
    return "".join(clauses)


def _pure(rng: random.Random, positive: bool) -> str:
    n = rng.randint(1, 3)
    return _completion(rng, n, 0) if positive else _completion(rng, 0, n)


def _mixed(rng: random.Random) -> str:
    return _completion(rng, rng.randint(0, 3), rng.randint(0, 3)) if rng.random() < 0.9 else _pure(rng, True)


def _rng(name: str, split: str) -> random.Random:
    # Separate streams per dataset and split; the eval split never shares a seed with train.
    return random.Random(f"reviews/{name}/{split}")


def sft_rows(split: str) -> list[dict[str, str]]:
    rng = _rng("sft", split)
    return [{"prompt": _prompt(rng), "completion": _pure(rng, positive=i % 2 == 0)} for i in range(SPLIT_SIZES[split])]


def pref_rows(split: str) -> list[dict[str, str]]:
    rng = _rng("prefs", split)
    rows: list[dict[str, str]] = []
    while len(rows) < SPLIT_SIZES[split]:
        prompt = _prompt(rng)
        if len(rows) % 2 == 0:  # clean pair: a positive against a negative completion
            a, b = _pure(rng, True), _pure(rng, False)
        else:  # mixed pair: both may carry positive and negative words
            a, b = _mixed(rng), _mixed(rng)
        if sentiment_balance(a) == sentiment_balance(b):
            continue
        chosen, rejected = (a, b) if sentiment_balance(a) > sentiment_balance(b) else (b, a)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def prompt_rows(split: str) -> list[dict[str, str]]:
    rng = _rng("prompts", split)
    return [{"prompt": _prompt(rng)} for _ in range(SPLIT_SIZES[split])]


def corpus() -> list[str]:
    """Every text of the task, for training the built-in tokenizer."""
    texts: list[str] = []
    for split in SPLIT_SIZES:
        texts += [r["prompt"] + r["completion"] for r in sft_rows(split)]
        texts += [r["prompt"] + r["chosen"] + r["rejected"] for r in pref_rows(split)]
    return texts
