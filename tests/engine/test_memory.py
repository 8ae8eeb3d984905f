"""Memory planning (engine/spec/memory.py) against what the models and the engine really hold: parameter counts from
the weight files' headers equal the instantiated models' for every architecture users bring, LoRA's adapters equal
PEFT's, and a plan's bytes equal the engine's ``memory/state_bytes``; the layouts divide as FSDP does."""

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from engine.builtin import TINY_CONFIG
from engine.core.models import load_tokenizer
from engine.run import run_job
from engine.spec.config import JobSpec
from engine.spec.memory import (
    GIB,
    Weights,
    WeightsUnreadable,
    builtin_weights,
    gpt2_weights,
    plan,
    read_weights,
    refusal,
    what_fits,
)
from tests.models import ARCHITECTURES, MORE_ARCHITECTURES, build_model
from tests.recorder import Recorder

MIXTURES = ("qwen3_moe", "gpt_oss")


@pytest.mark.parametrize("arch", ARCHITECTURES + MORE_ARCHITECTURES)
def test_weights_read_from_the_headers_are_the_models(arch: str, tmp_path: Path) -> None:
    folder = build_model(arch, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(folder)
    weights = read_weights(folder)
    assert weights is not None
    assert weights.params == sum(p.numel() for p in model.parameters())  # a tied head once
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    assert weights.lm_head == (0 if tied else head.weight.numel())
    # FSDP's units as the engine makes them (engine/core/distributed.py): each block, and the root the rest
    names = set().union(*(getattr(m, "_no_split_modules", None) or () for m in model.modules()))
    blocks = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in names]
    assert weights.largest_unit == max(weights.params - sum(blocks), *blocks)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    if arch in MIXTURES:  # stored per expert, adapted as the fused experts they load into: near enough
        assert weights.adapters(4, "auto") == pytest.approx(adapters, rel=0.25)
    else:
        assert weights.adapters(4, "auto") == adapters


def test_the_builtin_models_weights_and_a_plan_are_what_the_engine_holds(tmp_path: Path) -> None:
    """One process, float32: the policy's weights, gradients and AdamW's two moments (``memory/state_bytes``)."""
    job = JobSpec.model_validate({"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft",
                                  "hyperparameters": {"max_steps": 1, "batch_size": 4}})  # fmt: skip
    weights = gpt2_weights(TINY_CONFIG, len(load_tokenizer("builtin:tiny")))
    assert builtin_weights() == weights  # the API's, from the tokenizer file alone
    assert weights.largest_unit == gpt2_weights(TINY_CONFIG, len(load_tokenizer("builtin:tiny"))).largest_unit
    recorder = Recorder()
    run_job(job, tmp_path, recorder, torch.device("cpu"))
    planned = plan(job, {"model": weights})
    assert planned.total == recorder.metrics[1]["memory/state_bytes"]
    assert (planned.weights, planned.gradients, planned.optimizer) == (4 * weights.params, 4 * weights.params,
                                                                        8 * weights.params)  # fmt: skip


BILLION = Weights(
    params=1_000_000_000, lm_head=100_000_000, linears=(("layers.0.q_proj", 4096, 4096),), largest_unit=200_000_000
)


def spec(job_type: str, **fields: Any) -> JobSpec:
    data: dict[str, Any] = {"type": job_type, "model": "builtin:tiny", "dataset": {
        "sft": "builtin:reviews-sft", "rm": "builtin:reviews-prefs", "dpo": "builtin:reviews-prefs",
        "ppo": "builtin:reviews-prompts", "grpo": "builtin:digits-prompts", "distill": "builtin:digits-prompts",
    }[job_type], "hyperparameters": {"batch_size": 16, "mini_batch_size": 16}, **fields}  # fmt: skip
    if job_type == "ppo":
        data["reward_model"] = "job:rm-1"
    if job_type == "distill":
        data["teacher"] = "builtin:tiny"
    if job_type in ("sft", "rm", "dpo"):
        del data["hyperparameters"]["mini_batch_size"]
    return JobSpec.model_validate(data)


def test_each_type_holds_its_models() -> None:
    p, head = BILLION.params, BILLION.lm_head
    assert plan(spec("sft"), {"model": BILLION}).total == 16 * p
    assert plan(spec("rm"), {"model": BILLION}).total == 16 * (p - head)
    assert plan(spec("dpo"), {"model": BILLION}).total == 16 * p + 4 * p  # and the frozen reference
    reward = Weights(500_000_000, 50_000_000)
    ppo = plan(spec("ppo"), {"model": BILLION, "reward_model": reward})
    assert ppo.total == 16 * p + 4 * p + 16 * reward.backbone + 4 * reward.backbone  # policy, ref, critic, reward
    assert plan(spec("distill"), {"model": BILLION, "teacher": reward}).total == 16 * p + 4 * reward.params
    lora = plan(spec("dpo", lora={"r": 8}), {"model": BILLION})  # the reference is the base: no copy
    assert (lora.weights, lora.gradients) == (4 * p + 4 * 8 * 8192, 4 * 8 * 8192)


def test_sharding_divides_what_it_shards_and_offload_leaves_the_device() -> None:
    reward = Weights(500_000_000, 50_000_000)
    models = {"model": BILLION, "reward_model": reward}
    four = {"num_processes": 4, "sharding": "fsdp"}
    ddp = plan(spec("ppo", resources={"num_processes": 4}), models)
    fsdp = plan(spec("ppo", resources=four), models)
    assert ddp.layout == "ddp" and fsdp.layout == "fsdp over 4 ranks"
    whole_reward = 4 * reward.backbone  # a reward model stays whole on every rank
    assert fsdp.total - whole_reward == pytest.approx((ddp.total - whole_reward) / 4, abs=64)
    hosts = plan(spec("ppo", resources={**four, "num_processes": 2, "num_nodes": 2}), models)
    assert hosts.total == fsdp.total  # 2 hosts × 2 processes shard as 4 processes do
    offload = plan(spec("ppo", resources={**four, "cpu_offload": True}), models)
    assert (offload.total, offload.layout) == (whole_reward, "fsdp over 4 ranks, cpu offload")
    assert offload.gathered == 2 * 4 * reward.params  # the largest unit, whole, and its gradients: here the critic,
    # a reward model whose units are not known (counted whole)


def test_offload_still_gathers_a_unit_on_the_device() -> None:
    """Issue 39, item 4.13: with every shard on the host, a 0-byte device "fitted" the job."""
    sharded = spec("sft", resources={"num_processes": 4, "sharding": "fsdp", "cpu_offload": True})
    offload = plan(sharded, {"model": BILLION})
    assert (offload.total, offload.gathered) == (0, 2 * 4 * BILLION.unit)
    assert not offload.fits(0) and not offload.fits(GIB) and offload.fits(2 * GIB)
    message = refusal(sharded, {"model": BILLION}, GIB, max_processes=4)
    assert message is not None and "1.49 GiB gathered from the host at a time" in message, message
    lora = plan(spec("sft", lora={"r": 8}, resources=sharded.resources.model_dump()), {"model": BILLION})
    assert lora.gathered == 4 * BILLION.unit  # a frozen unit: no gradients
    unknown = plan(sharded, {"model": Weights(10**9)})
    assert unknown.gathered == 2 * 4 * 10**9  # the unit not known: the whole model


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ((2**63).to_bytes(8, "little") + b"{}", "declares a header of 9,223,372,036,854,775,808 bytes"),
        ((100_000_001).to_bytes(8, "little") + b"{" + b" " * 64, "declares a header of 100,000,001 bytes"),
        ((64).to_bytes(8, "little") + b"{}", "in a file of 10 bytes"),
        (b"\x02\x00", "declares no header length"),
        ((3).to_bytes(8, "little") + b"[1]", "its header is not a JSON object"),
        ((2).to_bytes(8, "little") + b"\xff\xfe", "its header is not a JSON object"),
        ((14).to_bytes(8, "little") + b'{"w": {"a": 1}}'[:14], "its header is not a JSON object"),
        ((15).to_bytes(8, "little") + b'{"w": {"a": 1}}', "tensor 'w' has no shape of sizes"),
        ((23).to_bytes(8, "little") + b'{"w": {"shape": [-1]}} ', "tensor 'w' has no shape of sizes"),
    ],
)
def test_a_hostile_header_is_refused_naming_the_file(tmp_path: Path, content: bytes, needle: str) -> None:
    """Issue 39, item 4.12: a header's declared length was read whole (2^63 bytes), and any malformed header was an
    exception of the parser's; each is now :class:`WeightsUnreadable` naming the file, read no further than
    safetensors' own limit."""
    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(content)
    with pytest.raises(WeightsUnreadable) as info:
        read_weights(folder)
    assert str(info.value).startswith("evil/model.safetensors") and needle in str(info.value), info.value


def test_a_refusal_gives_the_figures_and_the_smallest_setting_that_fits() -> None:
    job = spec("sft", resources={"num_processes": 2})  # 16 GB per rank under DDP
    device = 12 * GIB
    message = refusal(job, {"model": BILLION}, device, max_processes=8)
    assert message is not None
    assert "do not fit a 12.00 GiB device as they are held (ddp)" in message
    assert "3.73 GiB of weights, 3.73 GiB of gradients and 7.45 GiB of optimizer state" in message
    assert 'it fits with {"resources": {"sharding": "fsdp"}}' in message  # 8 GB per rank over 2
    assert (
        refusal(spec("sft", resources={"num_processes": 2, "sharding": "fsdp"}), {"model": BILLION}, device, 8) is None
    )
    # one process: more of them, sharded; the first count that fits
    change, fixed = what_fits(spec("sft"), {"model": BILLION}, 6 * GIB, max_processes=8)  # type: ignore[misc]
    assert change == {"resources": {"sharding": "fsdp", "num_processes": 4}} and fixed.fits(6 * GIB)
    nothing = refusal(spec("sft"), {"model": Weights(10**12)}, GIB, max_processes=1)
    assert nothing is not None and "a larger device, or more hosts" in nothing
