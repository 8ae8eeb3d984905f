"""The synthetic "digits" task: a verifiable one, for RL from rule-based rewards.

A prompt lists three digits and asks for one of them by position (``4 7 2 : last =``); the answer is that digit
(``2``), checkable by a rule. The SFT data imitates a careless demonstrator that gives the asked digit only
:data:`SFT_CORRECT` of the time and otherwise another digit of the list (or any digit): a model trained on it
learns the format and where the digits are, but answers right about as often as the demonstrator did, so RL
against the rule has room to raise its accuracy.

Datasets (each with a held-out twin ending in ``-eval``, built from digit triples the training split never
shows):
- ``digits-sft``: ``{prompt, completion}``, the demonstrator's answers.
- ``digits-prompts``: ``{prompt, answer}``: the prompts, with the right answer as a column for graders.

``exact_match`` is the rule as a reward function (TRL's signature); the same rule as a grader is
:data:`GRADER`.
"""

import itertools
import random
from typing import Any

POSITIONS = {"first": 0, "middle": 1, "last": 2}
SFT_CORRECT = 0.4
"""How often the SFT demonstrator gives the asked digit."""
SFT_LISTED = 0.5
"""How often it gives another digit of the list (else any digit at random)."""
EVAL_TRIPLES = 200
"""Digit triples held out for the ``-eval`` datasets (of the 1000)."""
SFT_ROWS = {"train": 4000, "eval": 400}

GRADER: dict[str, Any] = {
    "type": "string_check",
    "name": "correct",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
"""The task's rule as a grader: the completion is exactly the asked digit."""


def _triples(split: str) -> list[tuple[int, int, int]]:
    """The digit triples of a split: a fixed shuffle of all 1000, the last :data:`EVAL_TRIPLES` held out."""
    triples = [(a, b, c) for a, b, c in itertools.product(range(10), repeat=3)]
    random.Random("digits/triples").shuffle(triples)
    return triples[-EVAL_TRIPLES:] if split == "eval" else triples[:-EVAL_TRIPLES]


def prompt(triple: tuple[int, int, int], position: str) -> str:
    return f"{' '.join(map(str, triple))} : {position} ="


def answer(triple: tuple[int, int, int], position: str) -> str:
    return str(triple[POSITIONS[position]])


def _demonstration(rng: random.Random, triple: tuple[int, int, int], position: str) -> str:
    roll = rng.random()
    if roll < SFT_CORRECT:
        return answer(triple, position)
    if roll < SFT_CORRECT + SFT_LISTED:
        others = [d for i, d in enumerate(triple) if i != POSITIONS[position]]
        return str(rng.choice(others))
    return str(rng.randrange(10))


def sft_rows(split: str) -> list[dict[str, str]]:
    rng = random.Random(f"digits/sft/{split}")
    triples = _triples(split)
    rows = []
    for _ in range(SFT_ROWS[split]):
        triple, position = rng.choice(triples), rng.choice(list(POSITIONS))
        rows.append({"prompt": prompt(triple, position), "completion": _demonstration(rng, triple, position)})
    return rows


def prompt_rows(split: str) -> list[dict[str, str]]:
    """Every (triple, position) of the split once, in a fixed shuffled order, with its answer."""
    rows = [{"prompt": prompt(t, p), "answer": answer(t, p)} for t in _triples(split) for p in POSITIONS]
    random.Random(f"digits/prompts/{split}").shuffle(rows)
    return rows


def exact_match(prompts: list[str], completions: list[str], answer: list[str], **columns: Any) -> list[float]:
    """1.0 where the completion is exactly the row's ``answer``, else 0.0 (TRL's reward-function signature)."""
    return [float(completion == expected) for completion, expected in zip(completions, answer, strict=True)]
