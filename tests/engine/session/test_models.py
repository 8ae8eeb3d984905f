"""A session's trained model written out in Hugging Face's format (``save_weights_external``, read by ``tinker
checkpoint download``): loaded back by plain transformers or peft, it computes what the session's model does."""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine import builtin
from engine.core.models import load_causal_lm, load_tokenizer
from engine.session.models import Lora, TrainingModel


@pytest.mark.parametrize("lora", [None, Lora(rank=2)], ids=["full", "lora"])
def test_external_weights_load_back_as_the_trained_model(lora: Lora | None, tmp_path: Path) -> None:
    model = TrainingModel(builtin.TINY_MODEL, lora, torch.device("cpu"))
    with torch.no_grad():  # trained weights: every trainable one moved off its start
        for param in model.learner.params:
            param.add_(0.01)
    size = model.save_external(tmp_path / "out", base_model="the-base")
    files = {path.name for path in (tmp_path / "out").iterdir()}
    assert size == sum(path.stat().st_size for path in (tmp_path / "out").iterdir())
    assert "tokenizer_config.json" in files and "README.md" not in files
    if lora is None:
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    else:
        assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["base_model_name_or_path"] == (
            "the-base"
        )
        assert "config.json" not in files
        base = load_causal_lm(builtin.TINY_MODEL, load_tokenizer(builtin.TINY_MODEL), seed=0)
        loaded = PeftModel.from_pretrained(base, tmp_path / "out")
    tokens = torch.tensor([[1, 5, 9, 4]])  # (1, 4)
    model.model.eval()
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(input_ids=tokens).logits, model.model(input_ids=tokens).logits, atol=1e-5)
