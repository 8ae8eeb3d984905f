"""The real-job workload of the PPO benchmark: a random policy made to stop at EOS at a chosen rate."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from benchmarks.ppo_vs_trl import TEMPERATURE, raise_eos_logit

EOS = 1


def test_raise_eos_logit_gives_the_policy_the_eos_probability_asked_for() -> None:
    config = GPT2Config(vocab_size=574, n_positions=64, n_layer=2, n_head=2, n_embd=32, eos_token_id=EOS)
    torch.manual_seed(0)
    policy = GPT2LMHeadModel(config).eval()
    probe = torch.randint(2, config.vocab_size, (8, 32))  # (B, L): no pad (0) and no EOS
    before = policy(input_ids=probe).logits.div(TEMPERATURE).softmax(-1)[..., EOS].mean().item()

    said = raise_eos_logit(policy, EOS, 0.05, probe)

    # the model itself, through its tied LM head, now gives EOS that probability on the probe
    after = policy(input_ids=probe).logits.div(TEMPERATURE).softmax(-1)[..., EOS].mean().item()
    assert before < 0.01
    assert abs(said - 0.05) < 1e-4
    assert abs(after - said) < 1e-4
    assert policy.lm_head.weight.data_ptr() == policy.transformer.wte.weight.data_ptr()
