"""The models users bring: tiny random-weight Llama, Qwen2, Mistral and GPT-NeoX with a BPE tokenizer and a chat
template, trained SFT → RM → PPO on chat data, in full and with LoRA. Every final checkpoint loads in plain
transformers, and a reward model scores there what it scored in the engine.
"""

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from engine.core.data import encode_sft_example, labelled_batch
from engine.core.models import load_scalar_model, load_tokenizer
from engine.methods.rm import encode_pairs
from engine.rewards.reward_model import sequence_scores
from engine.spec.rows import ChatTemplateMissingError
from tests.engine.helpers import assert_all_finite, final_model_dir, make_spec, train
from tests.models import ARCHITECTURES, build_model, chat_rows, write_jsonl
from tests.recorder import Recorder

LORA = {"r": 4, "alpha": 8}
STEPS = {
    "sft": {"max_steps": 2, "batch_size": 4, "learning_rate": 1e-3},
    "rm": {"max_steps": 2, "batch_size": 4, "learning_rate": 1e-3},
    "ppo": {
        "total_steps": 2,
        "batch_size": 4,
        "mini_batch_size": 2,
        "ppo_epochs": 1,
        "response_length": 6,
        "temperature": 1.0,
    },
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("byo-data")
    return {
        "sft": write_jsonl(chat_rows("sft_messages", 16), root / "sft.jsonl"),
        "rm": write_jsonl(chat_rows("preference", 8) + chat_rows("preference_implicit", 8), root / "prefs.jsonl"),
        "ppo": write_jsonl(chat_rows("prompts", 16), root / "prompts.jsonl"),
    }


_chains: dict[tuple[str, bool], dict[str, Path]] = {}
EVERY_CHAIN = pytest.mark.parametrize(
    ("arch", "lora"),
    [(arch, lora) for arch in ARCHITECTURES for lora in (False, True)],
    ids=[f"{arch}-{'lora' if lora else 'full'}" for arch in ARCHITECTURES for lora in (False, True)],
)


def chain(arch: str, lora: bool, data: dict[str, Path], root: Path) -> dict[str, Path]:
    """SFT → RM → PPO on ``arch`` (each with LoRA or in full), trained once per module; the job folders."""
    if (arch, lora) in _chains:
        return _chains[(arch, lora)]
    base = build_model(arch, root / arch / "base")
    out = root / arch / ("lora" if lora else "full")
    extra: dict[str, Any] = {"lora": LORA} if lora else {}
    jobs = {"base": base}
    for job_type, model, reward_model in (("sft", base, None), ("rm", "sft", None), ("ppo", "sft", "rm")):
        spec = make_spec(
            job_type,
            model=jobs.get(str(model), model),
            reward_model=jobs[reward_model] if reward_model else None,
            dataset=str(data[job_type]),
            hyperparameters=STEPS[job_type],
            **extra,
        )
        result, recorder = train(spec, out / job_type)
        assert result.status == "succeeded", (arch, lora, job_type)
        assert_all_finite(recorder.metrics)
        jobs[job_type] = out / job_type
    _chains[(arch, lora)] = jobs
    return jobs


@EVERY_CHAIN
def test_sft_rm_ppo_chain_trains_and_every_checkpoint_loads_in_transformers(
    arch: str, lora: bool, data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    jobs = chain(arch, lora, data, tmp_path_factory.getbasetemp() / "byo")
    for job_type in ("sft", "ppo"):
        policy = final_model_dir(jobs[job_type])
        model = AutoModelForCausalLM.from_pretrained(policy)
        tokenizer = AutoTokenizer.from_pretrained(policy)
        assert type(model).__name__.lower().startswith(arch.replace("_", ""))
        assert tokenizer.chat_template, "the chat template travels with the checkpoint"
        messages = [{"role": "user", "content": "Finish this review: the film"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert out.shape[1] == ids["input_ids"].shape[1] + 3
    assert (final_model_dir(jobs["ppo"], "value") / "config.json").is_file()


@EVERY_CHAIN
def test_reward_model_scores_the_same_in_plain_transformers(
    arch: str, lora: bool, data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    jobs = chain(arch, lora, data, tmp_path_factory.getbasetemp() / "byo")
    rm_dir = final_model_dir(jobs["rm"])
    rows = chat_rows("preference", 4, seed=1)
    tokenizer = load_tokenizer(str(rm_dir))
    batch = encode_pairs(tokenizer, rows, 128)  # (8, L), right-padded, as the engine trains on them
    engine_scores = sequence_scores(load_scalar_model(str(rm_dir), tokenizer, 0, trained_head=True),
                                    batch["input_ids"], batch["attention_mask"])  # fmt: skip
    plain = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    with torch.no_grad():
        plain_scores = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    torch.testing.assert_close(engine_scores, plain_scores, rtol=1e-4, atol=1e-5)


def test_chat_rows_train_on_the_assistant_turns_only(tmp_path: Path) -> None:
    folder = build_model("llama", tmp_path / "llama")
    tokenizer = load_tokenizer(str(folder))
    [row] = [r for r in chat_rows("sft_messages", 40) if len(r["messages"]) >= 4][:1]
    ids, trained = encode_sft_example(tokenizer, row)
    batch = labelled_batch([(ids, trained)], tokenizer.pad_token_id, 512)
    spans, current = [], []
    for token, label in zip(ids, batch["labels"][0].tolist(), strict=True):
        if label != -100:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    assistant = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
    assert [tokenizer.decode(span) for span in spans] == [f"{text}<|im_end|>\n" for text in assistant]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(row["messages"], tokenize=False)


def test_a_chat_row_and_a_model_without_a_template_is_refused(tmp_path: Path) -> None:
    spec = make_spec("sft", dataset=str(write_jsonl(chat_rows("sft_messages", 8), tmp_path / "chat.jsonl")))
    recorder = Recorder()
    with pytest.raises(ChatTemplateMissingError, match="dataset"):
        train(spec, tmp_path / "job", recorder)
    assert not recorder.metrics
