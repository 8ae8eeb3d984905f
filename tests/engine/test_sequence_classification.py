"""Models that cannot be what a job needs fail at once with a short message naming why: an architecture without
a sequence-classification class as a reward model (engine/spec/sequence_classification.py, the torch-free list the API
checks at submit, kept equal to the installed transformers'), a model folder without a tokenizer, and a folder that
does not exist."""

from pathlib import Path

import pytest
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

from engine.core.models import ModelNotFoundError, RewardModelError, load_scalar_model, load_tokenizer
from engine.spec.sequence_classification import SEQUENCE_CLASSIFICATION_TYPES
from tests.models import build_model


def test_the_shipped_list_is_the_installed_transformers_mapping() -> None:
    # Stale after a transformers upgrade: run scripts/sequence_classification_types.py.
    assert set(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES) == SEQUENCE_CLASSIFICATION_TYPES
    assert "granite" not in SEQUENCE_CLASSIFICATION_TYPES and "llama" in SEQUENCE_CLASSIFICATION_TYPES


def test_a_reward_model_without_a_classification_class_fails_short_naming_its_type(tmp_path: Path) -> None:
    folder = build_model("granite", tmp_path / "granite")
    tokenizer = load_tokenizer(str(folder))
    with pytest.raises(RewardModelError, match="is a granite model, and transformers has no sequence-class") as caught:
        load_scalar_model(str(folder), tokenizer, seed=0)
    assert len(str(caught.value)) < 200 + len(str(folder)), "no list of every architecture"


def test_a_model_folder_without_a_tokenizer_says_so(tmp_path: Path) -> None:
    folder = build_model("llama", tmp_path / "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(ModelNotFoundError, match=r"has no tokenizer: a model folder needs tokenizer\.json"):
        load_tokenizer(str(folder))


def test_a_folder_that_does_not_exist_says_so(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no such folder"):
        load_tokenizer(str(tmp_path / "absent"))
