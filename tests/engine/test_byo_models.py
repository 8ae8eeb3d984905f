"""Regressions found bringing Llama-family models: LoRA scalar heads, reward models of another tokenizer or
without a pad token or without a trained head, the LM loss of untied models, BOS, and chat rows."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from engine.core.data import encode_completion, encode_prompts, encode_sft_batch, prompt_ids, render
from engine.core.generate import generate
from engine.core.models import (
    RewardModelError,
    ScalarHead,
    apply_lora,
    lm_head_weight,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
)
from engine.methods.rm import encode_pairs, pair_rewards
from engine.rewards.reward_model import score_texts, sequence_scores
from engine.spec.config import LoraSpec
from tests.engine.helpers import Pretrained, final_model_dir, make_spec, train
from tests.models import BOS_TOKEN, build_model, chat_rows, write_jsonl

PPO = {"total_steps": 2, "batch_size": 4, "mini_batch_size": 2, "ppo_epochs": 1, "response_length": 6}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="module")
def llama_rm(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reward model trained from the Llama on chat preference pairs."""
    out = tmp_path_factory.mktemp("llama-rm") / "job"
    data = write_jsonl(chat_rows("preference", 8), out.parent / "prefs.jsonl")
    spec = make_spec("rm", model=llama, dataset=str(data), hyperparameters={"max_steps": 2, "batch_size": 4})
    assert train(spec, out)[0].status == "succeeded"
    return out


# 1. LoRA on a model whose base_model_prefix is an attribute of the PEFT wrapper too ("model")
def test_a_lora_scalar_model_reads_its_backbone_not_the_wrapper(llama: Path) -> None:
    tokenizer = load_tokenizer(str(llama))
    model = apply_lora(load_scalar_model(str(llama), tokenizer, 0), LoraSpec(r=4, alpha=8), "SEQ_CLS", None)
    ids, mask = encode_prompts(tokenizer, ["the film was", "a long and dull story"], 16)
    scores, hidden = ScalarHead(model)(ids, mask)
    assert scores.shape == ids.shape and hidden.shape == (*ids.shape, 64)


# 2. a reward model of another tokenizer scores the decoded text with its own tokenizer
def test_a_llama_policy_trains_against_a_gpt2_reward_model(llama: Path, pretrained: Pretrained, tmp_path: Path) -> None:
    spec = make_spec("ppo", model=llama, reward_model=pretrained.rm, hyperparameters=PPO)
    result, recorder = train(spec, tmp_path / "job")
    assert result.status == "succeeded"
    assert any("tokenizer differs" in message for _, message, _ in recorder.events)
    # the critic started from the policy's backbone (Llama), not from the GPT-2 reward model
    value = AutoModelForSequenceClassification.from_pretrained(final_model_dir(tmp_path / "job", "value"))
    assert type(value).__name__ == "LlamaForSequenceClassification"


def test_a_gpt2_policy_against_a_llama_reward_model_is_scored_on_its_text(
    llama_rm: Path, pretrained: Pretrained, tmp_path: Path
) -> None:
    spec = make_spec("ppo", model=pretrained.sft, reward_model=llama_rm, hyperparameters=PPO, lora={"r": 4})
    result, recorder = train(spec, tmp_path / "job")
    assert result.status == "succeeded" and recorder.metrics[2]["objective/scores"] != 0
    # text scoring is what plain transformers computes on the reward model's own encoding of the text
    rm_dir = final_model_dir(llama_rm)
    tokenizer = load_tokenizer(str(rm_dir))
    model = load_scalar_model(str(rm_dir), tokenizer, 0, trained_head=True)
    prompts, responses = ["the film was", "i watched it and"], [" great fun .", " dull"]
    scores = score_texts(model, tokenizer, prompts, responses, [True, False])
    plain = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    for prompt, response, done, score in zip(prompts, responses, [True, False], scores.tolist(), strict=True):
        text = prompt + response + ("<|im_end|>" if done else "")
        with torch.no_grad():
            expected = plain(**hf_tokenizer(text, return_tensors="pt")).logits[0, 0].item()
        assert score == pytest.approx(expected, abs=1e-5)


# 5. a reward model whose tokenizer has no pad token (pad is EOS) scores the same in plain transformers
def test_a_reward_model_without_a_pad_token_scores_alike_in_transformers(tmp_path: Path) -> None:
    base = build_model("qwen2", tmp_path / "base", pad=False)
    data = write_jsonl(chat_rows("preference", 8), tmp_path / "prefs.jsonl")
    spec = make_spec("rm", model=base, dataset=str(data), hyperparameters={"max_steps": 3, "learning_rate": 1e-2,
                                                                            "batch_size": 4})  # fmt: skip
    assert train(spec, tmp_path / "rm")[0].status == "succeeded"
    rm_dir = final_model_dir(tmp_path / "rm")
    tokenizer = load_tokenizer(str(rm_dir))
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    batch = encode_pairs(tokenizer, chat_rows("preference", 2, seed=3), 128)  # (4, L): every row ends with EOS
    model = load_scalar_model(str(rm_dir), tokenizer, 0, trained_head=True).eval()
    with torch.no_grad():
        engine_scores, _ = pair_rewards(ScalarHead(model), batch, model.config.pad_token_id)
        plain = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
        plain_scores = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    torch.testing.assert_close(engine_scores, plain_scores, rtol=1e-4, atol=1e-5)


# 6. a causal LM named as a reward model is refused instead of scoring with a random head
def test_a_causal_lm_as_reward_model_is_refused(llama: Path, tmp_path: Path) -> None:
    spec = make_spec("ppo", model=llama, reward_model=llama, hyperparameters=PPO)
    with pytest.raises(RewardModelError, match="no trained score head"):
        train(spec, tmp_path / "job")
    with pytest.raises(RewardModelError):
        train(make_spec("ppo", model="builtin:tiny", reward_model="builtin:tiny", hyperparameters=PPO), tmp_path / "b")


# 7. the RM's LM loss reads through the LM head, which untied models keep apart from the input embeddings
def test_lm_loss_of_an_untied_model_uses_its_lm_head(llama: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(llama))
    classifier = load_scalar_model(str(llama), tokenizer, 0)
    causal = AutoModelForCausalLM.from_pretrained(llama)
    assert not causal.config.tie_word_embeddings
    head = lm_head_weight(classifier, str(llama))()
    torch.testing.assert_close(head, causal.lm_head.weight, rtol=0, atol=0)
    assert not torch.equal(head, classifier.get_input_embeddings().weight)
    data = write_jsonl(chat_rows("preference", 8), tmp_path / "prefs.jsonl")
    spec = make_spec("rm", model=llama, dataset=str(data), hyperparameters={"max_steps": 2, "batch_size": 4,
                                                                             "lm_loss_coef": 1.0})  # fmt: skip
    assert train(spec, tmp_path / "rm")[0].status == "succeeded"


def test_lm_loss_from_a_model_without_an_lm_head_is_refused(llama_rm: Path) -> None:
    rm_dir = str(final_model_dir(llama_rm))
    classifier = load_scalar_model(rm_dir, load_tokenizer(rm_dir), 0)
    with pytest.raises(RewardModelError, match="LM head"):
        lm_head_weight(classifier, rm_dir)


# 9. special tokens follow the tokenizer: BOS where it adds one, in training, rollouts and generation
def test_bos_is_added_where_the_tokenizer_adds_it(tmp_path: Path) -> None:
    with_bos = load_tokenizer(str(build_model("llama", tmp_path / "bos", add_bos=True)))
    without = load_tokenizer(str(build_model("llama", tmp_path / "plain")))
    bos = with_bos.convert_tokens_to_ids(BOS_TOKEN)
    row = {"prompt": "the film was", "completion": " great ."}
    assert encode_sft_batch(with_bos, [row], 64)["input_ids"][0, 0] == bos
    assert encode_sft_batch(without, [row], 64)["input_ids"][0, 0] != bos
    ids, _ = encode_prompts(with_bos, ["the film was"], 64)
    assert ids[0, 0] == bos and with_bos(["the film was"])["input_ids"][0] == ids[0].tolist()
    # chat prompts: the template writes what it writes, and nothing is added to it
    messages = [{"role": "user", "content": "hi"}]
    assert (
        prompt_ids(with_bos, messages)
        == with_bos(render(with_bos, messages, True), add_special_tokens=False)["input_ids"]
    )
    model = load_causal_lm(str(tmp_path / "bos"), with_bos, 0)
    [completion] = generate(model, with_bos, ["the film was"], max_new_tokens=2)
    assert completion.prompt_tokens == len(ids[0])


def test_chat_rows_in_every_form_encode_as_the_template_renders(llama: Path) -> None:
    tokenizer = load_tokenizer(str(llama))
    explicit = chat_rows("preference", 1)[0]
    prompt = explicit["prompt"]
    implicit = {"chosen": prompt + explicit["chosen"], "rejected": prompt + explicit["rejected"]}
    torch.testing.assert_close(encode_pairs(tokenizer, [explicit], 128), encode_pairs(tokenizer, [implicit], 128))
    ids, trained = encode_completion(tokenizer, explicit["prompt"], explicit["chosen"])
    whole = tokenizer.apply_chat_template(explicit["prompt"] + explicit["chosen"], tokenize=False)
    assert tokenizer.decode(ids) == whole
    # the trained tokens start right after the prompt as a rollout renders it (with the generation prompt)
    assert ids[: trained.index(True)] == prompt_ids(tokenizer, explicit["prompt"])
    prompts = chat_rows("prompts", 2)
    queries, mask = encode_prompts(tokenizer, [r["prompt"] for r in prompts], 512)
    for row, query, keep in zip(prompts, queries, mask, strict=True):
        assert query[keep.bool()].tolist() == prompt_ids(tokenizer, row["prompt"])


def test_generation_from_chat_messages_samples_after_the_training_prompt(llama: Path) -> None:
    tokenizer = load_tokenizer(str(llama))
    model = load_causal_lm(str(llama), tokenizer, 0)
    messages = chat_rows("prompts", 1)[0]["prompt"]
    [completion] = generate(model, tokenizer, [messages], max_new_tokens=2)
    assert completion.prompt_tokens == len(prompt_ids(tokenizer, messages))


def test_reward_scores_read_the_last_non_pad_token_like_transformers(llama_rm: Path) -> None:
    rm_dir = final_model_dir(llama_rm)
    tokenizer = load_tokenizer(str(rm_dir))
    model = load_scalar_model(str(rm_dir), tokenizer, 0, trained_head=True)
    queries, query_mask = encode_prompts(tokenizer, ["the film", "a long story about a dog"], 32)  # left-padded
    plain = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    with torch.no_grad():
        expected = plain(input_ids=queries, attention_mask=query_mask).logits[:, 0]
    torch.testing.assert_close(sequence_scores(model, queries, query_mask), expected, rtol=1e-4, atol=1e-5)
