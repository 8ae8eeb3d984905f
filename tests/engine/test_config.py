"""Validation of job specs and hyperparameters in engine.spec.config."""

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from engine.builtin import digits
from engine.spec.config import (
    HYPERPARAMETERS,
    DistillConfig,
    GRPOConfig,
    JobSpec,
    LoraSpec,
    PPOConfig,
    RMConfig,
    SFTConfig,
    TrackingSpec,
    TrainConfig,
    format_errors,
    upgraded_spec,
)
from engine.spec.policy_losses import POLICY_LOSSES, LossSettings

DATASETS = {"sft": "builtin:reviews-sft", "rm": "builtin:reviews-prefs", "ppo": "builtin:reviews-prompts"}


def _spec(job_type: str = "sft", **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": job_type, "model": "builtin:tiny", "dataset": DATASETS[job_type]}
    if job_type == "ppo":
        spec["reward_model"] = "job:rm-1"
    spec.update(overrides)
    return spec


def _error(cls: type[BaseModel], data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(data)
    return format_errors(info.value)


# --- defaults and documentation ----------------------------------------------------------------


@pytest.mark.parametrize("cls", [SFTConfig, RMConfig, PPOConfig])
def test_defaults_are_valid(cls):
    config = cls()
    assert config.model_dump() == cls.model_validate(config.model_dump(mode="json")).model_dump()


@pytest.mark.parametrize("job_type", ["sft", "rm", "ppo"])
def test_minimal_spec_is_valid(job_type):
    spec = JobSpec.model_validate(_spec(job_type))
    assert spec.type == job_type
    assert isinstance(spec.config, HYPERPARAMETERS[job_type])


@pytest.mark.parametrize(
    "cls", [TrainConfig, SFTConfig, RMConfig, PPOConfig, GRPOConfig, LoraSpec, TrackingSpec, JobSpec]
)
def test_every_field_is_documented(cls):
    assert cls.model_fields
    for name, field in cls.model_fields.items():
        assert isinstance(field.description, str) and field.description.strip(), f"{cls.__name__}.{name}"


def test_overridden_defaults_per_job_type():
    assert SFTConfig().learning_rate == 1e-3
    assert RMConfig().learning_rate == 5e-4 and RMConfig().epochs == 1.0
    assert PPOConfig().learning_rate == 3e-5


# --- out-of-range values ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (SFTConfig, "learning_rate", -1),
        (SFTConfig, "learning_rate", 0),
        (RMConfig, "margin", -0.5),
        (SFTConfig, "gradient_accumulation_steps", 0),
        (SFTConfig, "max_length", 4),
        (PPOConfig, "cliprange", 0),
        (PPOConfig, "gamma", 1.5),
        (PPOConfig, "lam", -0.1),
        (PPOConfig, "temperature", 0),
        (PPOConfig, "kl_estimator", "k2"),
        (PPOConfig, "lr_scheduler", "step"),
    ],
)
def test_out_of_range_hyperparameter(cls, field, value):
    message = _error(cls, {field: value})
    assert message.startswith(f"{field}:"), message


@pytest.mark.parametrize(
    ("job_type", "field", "value"),
    [("sft", "learning_rate", -1), ("ppo", "cliprange", 0), ("ppo", "gamma", 1.5), ("rm", "epochs", 0)],
)
def test_out_of_range_in_job_spec_names_field(job_type, field, value):
    message = _error(JobSpec, _spec(job_type, hyperparameters={field: value}))
    assert message.startswith("hyperparameters:"), message
    assert f"{field}:" in message


def test_adam_betas_element_out_of_range():
    message = _error(SFTConfig, {"adam_betas": [0.9, 1.0]})
    assert message.startswith("adam_betas.1:"), message


# --- unknown fields ----------------------------------------------------------------------------


def test_unknown_top_level_field():
    message = _error(JobSpec, _spec(epochs=3))
    assert message.startswith("epochs:"), message
    assert "extra" in message.lower()


def test_tracking_switches_trackers_on_and_names_an_unknown_one():
    spec = JobSpec.model_validate(_spec(tracking={"mlflow": True}))
    assert spec.model_dump(mode="json")["tracking"] == {"tensorboard": False, "mlflow": True, "wandb": False}
    assert JobSpec.model_validate(_spec()).tracking is None
    message = _error(JobSpec, _spec(tracking={"tensorboard": True, "comet": True}))
    assert message.startswith("tracking.comet:"), message


def test_unknown_hyperparameter():
    message = _error(JobSpec, _spec("sft", hyperparameters={"learning_rat": 1e-3}))
    assert "learning_rat" in message
    assert "extra" in message.lower()


def test_hyperparameter_of_another_job_type_is_unknown():
    message = _error(JobSpec, _spec("sft", hyperparameters={"cliprange": 0.2}))
    assert "cliprange" in message


# --- datasets and reward model ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job_type", "dataset"),
    [("sft", "builtin:reviews-prefs"), ("rm", "builtin:reviews-sft"), ("ppo", "builtin:reviews-sft")],
)
def test_wrong_dataset_kind(job_type, dataset):
    message = _error(JobSpec, _spec(job_type, dataset=dataset))
    assert message.startswith("dataset:"), message
    assert dataset in message


def test_wrong_eval_dataset_kind():
    message = _error(JobSpec, _spec("sft", eval_dataset="builtin:reviews-prompts-eval"))
    assert message.startswith("eval_dataset:"), message


def test_unknown_builtin_dataset():
    message = _error(JobSpec, _spec("sft", dataset="builtin:no-such-data"))
    assert message.startswith("dataset:"), message
    assert "no-such-data" in message and "reviews-sft" in message  # lists the known ones


@pytest.mark.parametrize("dataset", ["file-abc123", "data/train.jsonl"])
def test_uploaded_and_local_datasets_accepted(dataset):
    assert JobSpec.model_validate(_spec("sft", dataset=dataset)).dataset == dataset


def test_not_a_dataset_reference():
    assert _error(JobSpec, _spec("sft", dataset="train.csv")).startswith("dataset:")


def test_cpu_offload_needs_sharding():
    offload = _error(JobSpec, _spec("sft", resources={"num_processes": 2, "cpu_offload": True}))
    assert "resources" in offload and 'cpu_offload needs sharding "fsdp"' in offload
    sharded = {"num_processes": 2, "sharding": "fsdp", "cpu_offload": True}
    assert JobSpec.model_validate(_spec("sft", resources=sharded)).resources.cpu_offload


def test_batches_split_over_every_process_of_every_host():
    hosts = {"num_nodes": 3, "num_processes": 2}
    message = _error(JobSpec, _spec("sft", resources=hosts, hyperparameters={"batch_size": 8}))
    assert "hyperparameters.batch_size (8) must be a multiple of resources.num_nodes × num_processes (6)" in message
    job = JobSpec.model_validate(_spec("sft", resources=hosts, hyperparameters={"batch_size": 12}))
    assert job.resources.world_size == 6


def test_ppo_without_reward_model():
    spec = _spec("ppo")
    del spec["reward_model"]
    message = _error(JobSpec, spec)
    assert "reward_model" in message


@pytest.mark.parametrize("job_type", ["sft", "rm"])
def test_reward_model_on_non_ppo_job(job_type):
    message = _error(JobSpec, _spec(job_type, reward_model="job:rm-1"))
    assert "reward_model" in message and job_type in message


# --- cross-field checks -----------------------------------------------------------------------


def test_sft_batch_not_multiple_of_accumulation():
    message = _error(JobSpec, _spec("sft", hyperparameters={"batch_size": 10, "gradient_accumulation_steps": 4}))
    assert "batch_size" in message and "gradient_accumulation_steps" in message
    message = _error(SFTConfig, {"batch_size": 10, "gradient_accumulation_steps": 4})
    assert "batch_size (10)" in message and "gradient_accumulation_steps (4)" in message


def test_rm_inherits_batch_check():
    message = _error(RMConfig, {"batch_size": 9, "gradient_accumulation_steps": 2})
    assert "batch_size" in message and "gradient_accumulation_steps" in message


def test_ppo_batch_not_multiple_of_mini_batch():
    message = _error(JobSpec, _spec("ppo", hyperparameters={"batch_size": 48, "mini_batch_size": 32}))
    assert "batch_size" in message and "mini_batch_size" in message
    message = _error(PPOConfig, {"batch_size": 48, "mini_batch_size": 32})
    assert "batch_size (48)" in message and "mini_batch_size (32)" in message


def test_ppo_mini_batch_not_multiple_of_accumulation():
    message = _error(PPOConfig, {"batch_size": 64, "mini_batch_size": 32, "gradient_accumulation_steps": 3})
    assert "mini_batch_size" in message and "gradient_accumulation_steps" in message


def test_ptx_coef_without_ptx_dataset():
    message = _error(JobSpec, _spec("ppo", hyperparameters={"ptx_coef": 0.5}))
    assert "ptx_dataset" in message
    config = PPOConfig(ptx_coef=0.5, ptx_dataset="builtin:reviews-sft")
    assert config.ptx_dataset == "builtin:reviews-sft"


def test_ptx_dataset_must_be_sft_kind():
    message = _error(PPOConfig, {"ptx_coef": 0.5, "ptx_dataset": "builtin:reviews-prefs"})
    assert "reviews-prefs" in message


# --- the KL estimator: k1 wherever the KL is part of the reward --------------------------------


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_ppo_refuses_k2_and_k3_in_its_reward_saying_why(estimator: str) -> None:
    message = _error(PPOConfig, {"kl_estimator": estimator})
    assert message.startswith(f"kl_estimator: {estimator}: PPO's KL is part of its reward"), message
    assert "cancels to first order" in message and "k1 is the unbiased choice" in message
    assert PPOConfig(kl_estimator="k1").kl_estimator == PPOConfig().kl_estimator == "k1"


@pytest.mark.parametrize(
    ("options", "in_reward", "used"),
    [
        ({}, False, "k3"),  # GRPO's: k3 as a loss term
        ({"kl_estimator": "k2"}, False, "k2"),
        ({"advantage_estimator": "rloo", "kl_estimator": "k1"}, False, "k1"),  # accepted; the job warns
        ({"advantage_estimator": "reinforce_pp"}, True, "k1"),  # REINFORCE++: k1 in the reward
        ({"advantage_estimator": "reinforce_pp_baseline", "kl_estimator": "k1"}, True, "k1"),
        ({"advantage_estimator": "reinforce_pp", "kl_in_reward": False}, False, "k3"),
        ({"advantage_estimator": "reinforce_pp", "kl_in_reward": False, "kl_estimator": "k2"}, False, "k2"),
        ({"kl_in_reward": True}, True, "k1"),
    ],
)
def test_grpo_kl_term_estimator(options: dict[str, Any], in_reward: bool, used: str) -> None:
    config = GRPOConfig(**options)
    assert (config.kl_as_reward, config.kl_term_estimator) == (in_reward, used)
    assert config.k1_loss_term == (used == "k1" and not in_reward)
    assert not GRPOConfig(**options, kl_coef=0.0).k1_loss_term  # no KL at all: nothing to warn about


@pytest.mark.parametrize(
    "options",
    [
        {"advantage_estimator": "reinforce_pp", "kl_estimator": "k3"},
        {"advantage_estimator": "reinforce_pp_baseline", "kl_estimator": "k2"},
        {"advantage_estimator": "grpo", "kl_in_reward": True, "kl_estimator": "k3"},
    ],
)
def test_grpo_refuses_k2_and_k3_given_for_a_kl_in_the_reward(options: dict[str, Any]) -> None:
    message = _error(GRPOConfig, options)
    assert message.startswith(f"spec: kl_estimator {options['kl_estimator']} with the KL in the reward"), message
    assert "cancels to first order" in message and "kl_in_reward false" in message


def test_a_stored_grpo_spec_validates_again() -> None:
    """The server stores a spec with every default filled in: the KL estimator left out stays left out."""
    data = {"type": "grpo", "model": "builtin:tiny", "dataset": "builtin:digits-prompts", "reward": digits.GRADER,
            "hyperparameters": {"advantage_estimator": "reinforce_pp"}}  # fmt: skip
    stored = JobSpec.model_validate(data).model_dump(mode="json")
    assert stored["hyperparameters"]["kl_estimator"] is None
    again = JobSpec.model_validate(stored).config
    assert isinstance(again, GRPOConfig) and again.kl_term_estimator == "k1"


@pytest.mark.parametrize(
    ("options", "stored"),
    [
        ({"kl_estimator": "k3"}, None),  # GRPO's default as a loss term
        ({"advantage_estimator": "reinforce_pp", "kl_estimator": "k1"}, None),  # the default in the reward
        ({"kl_estimator": "k2"}, "k2"),
        ({"kl_in_reward": False, "advantage_estimator": "reinforce_pp", "kl_estimator": "k3"}, None),
        ({"kl_estimator": "k1"}, "k1"),  # k1 as a loss term is not the default: kept (and warned about)
    ],
)
def test_grpo_stores_the_default_kl_estimator_one_way(options: dict[str, Any], stored: str | None) -> None:
    """An estimator given that equals the default for where the KL enters is stored as None, so that a spec stored
    by an earlier version (k3 filled in) and the same spec now compare equal (a local run resumes)."""
    assert GRPOConfig(**options).kl_estimator == stored


def _grpo_stored(**hyperparameters: Any) -> dict[str, Any]:
    data = {"type": "grpo", "model": "builtin:tiny", "dataset": "builtin:digits-prompts", "reward": digits.GRADER,
            "hyperparameters": hyperparameters}  # fmt: skip
    return data


@pytest.mark.parametrize(
    ("spec", "upgraded"),
    [
        (_grpo_stored(advantage_estimator="reinforce_pp", kl_estimator="k3"), None),  # k3 was GRPO's default
        (_grpo_stored(advantage_estimator="reinforce_pp_baseline", kl_estimator="k2"), None),
        (_grpo_stored(kl_in_reward=True, kl_estimator="k3"), None),
        (_spec("ppo", hyperparameters={"kl_estimator": "k3"}), "k1"),  # the earlier PPO took k1 or k3
    ],
)
def test_a_spec_stored_with_k3_in_the_reward_is_upgraded_to_k1(spec: dict[str, Any], upgraded: str | None) -> None:
    with pytest.raises(ValidationError, match=r"with the KL in the reward|PPO's KL is part of its reward"):
        JobSpec.model_validate(spec)  # what made a stored job fail when it resumed
    new, changes = upgraded_spec(spec)
    assert new["hyperparameters"]["kl_estimator"] == upgraded
    assert len(changes) == 1 and changes[0].startswith(
        f"hyperparameters.kl_estimator {spec['hyperparameters']['kl_estimator']} → k1"
    )
    config = JobSpec.model_validate(new).config
    assert getattr(config, "kl_term_estimator", "k1") == "k1"
    assert spec["hyperparameters"]["kl_estimator"] in ("k2", "k3"), "the stored spec itself is left as it was"


@pytest.mark.parametrize(
    "spec",
    [
        _grpo_stored(kl_estimator="k3"),  # a loss term: k3 is accepted
        _grpo_stored(advantage_estimator="reinforce_pp", kl_in_reward=False, kl_estimator="k2"),
        _grpo_stored(advantage_estimator="reinforce_pp", kl_estimator=None),
        _spec("ppo", hyperparameters={"kl_estimator": "k1"}),
        _spec("sft"),
    ],
)
def test_a_spec_this_version_accepts_is_not_upgraded(spec: dict[str, Any]) -> None:
    assert upgraded_spec(spec) == (spec, [])
    JobSpec.model_validate(spec)


@pytest.mark.parametrize("job_type", ["grpo", "ppo", "distill"])
@pytest.mark.parametrize("policy_loss", list(POLICY_LOSSES))
def test_a_spec_this_version_stores_keeps_its_loss_s_own_defaults(job_type: str, policy_loss: str) -> None:
    """What this version stores (null ranges, the aggregation filled in) is not taken for an earlier version's."""
    spec = _loss_spec(job_type, policy_loss=policy_loss)
    stored = JobSpec.model_validate(spec).model_dump(mode="json")
    assert upgraded_spec(stored) == (stored, [])


@pytest.mark.parametrize("job_type", ["grpo", "ppo", "distill"])
@pytest.mark.parametrize("policy_loss", ["cispo", "gspo"])
def test_an_earlier_cispo_or_gspo_spec_keeps_training_as_it_trained(job_type: str, policy_loss: str) -> None:
    """Stored before each loss had its own defaults, leaving the range (and GRPO's aggregation) to them: the values
    it trained with are written in (clip ranges 0.2, the token mean), each named."""
    spec = _loss_spec(job_type, policy_loss=policy_loss, **({"loss_aggregation": None} if job_type == "grpo" else {}))
    new, changes = upgraded_spec(spec)
    config = JobSpec.model_validate(new).config
    assert config.loss_settings == LossSettings(clip_low=0.2, clip_high=0.2)  # type: ignore[attr-defined]
    assert config.aggregation == "token_mean"  # type: ignore[attr-defined]
    ranges = 1 if job_type == "ppo" else 2
    assert len(changes) == ranges + (policy_loss == "gspo"), changes
    assert all(c.startswith("hyperparameters.") and "as the job trained until now" in c for c in changes)
    dr_grpo = _loss_spec("grpo", policy_loss="gspo", advantage_estimator="dr_grpo", cliprange_low=0.1)
    new, changes = upgraded_spec(dr_grpo)
    assert new["hyperparameters"]["cliprange_low"] == 0.1  # set: kept
    assert JobSpec.model_validate(new).config.aggregation == "constant"  # type: ignore[attr-defined]


def _loss_spec(job_type: str, **hyperparameters: Any) -> dict[str, Any]:
    references = {
        "grpo": {"dataset": "builtin:digits-prompts", "reward": digits.GRADER},
        "ppo": {"dataset": "builtin:reviews-prompts", "reward_model": "builtin:tiny"},
        "distill": {"dataset": "builtin:digits-prompts", "teacher": "builtin:tiny"},
    }
    return {"type": job_type, "model": "builtin:tiny", **references[job_type], "hyperparameters": hyperparameters}


# --- filled-in defaults and the typed config --------------------------------------------------


def test_sft_hyperparameters_filled_in_and_typed():
    spec = JobSpec.model_validate(_spec("sft", hyperparameters={"batch_size": 16, "gradient_accumulation_steps": 4}))
    expected = SFTConfig(batch_size=16, gradient_accumulation_steps=4).model_dump(mode="json")
    assert spec.hyperparameters == expected
    assert set(spec.hyperparameters) == set(SFTConfig.model_fields)
    config = spec.config
    assert type(config) is SFTConfig
    assert config.batch_size == 16 and config.micro_batch_size == 4
    assert config.learning_rate == 1e-3  # a default


def test_ppo_hyperparameters_filled_in_and_typed():
    hp = {"batch_size": 96, "mini_batch_size": 24, "gradient_accumulation_steps": 3, "gamma": 0.99}
    spec = JobSpec.model_validate(_spec("ppo", hyperparameters=hp))
    assert set(spec.hyperparameters) == set(PPOConfig.model_fields)
    assert spec.hyperparameters["cliprange"] is None and spec.hyperparameters["gamma"] == 0.99
    assert spec.hyperparameters["loss_aggregation"] == "token_mean"  # filled in: the stored spec shows it
    config = spec.config
    assert type(config) is PPOConfig
    assert config.loss_settings == LossSettings(clip_low=0.2, clip_high=0.2)  # ppo_clip's own range
    assert config.num_mini_batches == 4
    assert config.micro_batch_size == 8
    assert config == PPOConfig(**hp)


def test_rm_config_type():
    spec = JobSpec.model_validate(_spec("rm", hyperparameters={"margin": 0.5}))
    assert type(spec.config) is RMConfig
    assert spec.config.margin == 0.5 and spec.hyperparameters["lm_loss_coef"] == 0.0


def test_spec_json_round_trip():
    spec = JobSpec.model_validate(_spec("ppo", hyperparameters={"adam_betas": [0.8, 0.9]}, lora={"r": 4}))
    again = JobSpec.model_validate_json(spec.model_dump_json())
    assert again == spec
    assert again.config.adam_betas == (0.8, 0.9)
    assert again.lora is not None and again.lora.r == 4 and again.lora.alpha == 16


def test_hyperparameter_defaults_are_filled_in_when_omitted() -> None:
    spec = JobSpec.model_validate({"type": "sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft"})
    assert spec.hyperparameters == SFTConfig().model_dump(mode="json")


# --- policy losses (ppo, grpo) -----------------------------------------------------------------


@pytest.mark.parametrize("cls", [PPOConfig, GRPOConfig])
def test_policy_loss_is_one_of_the_registry(cls):
    assert cls().policy_loss == "ppo_clip" and cls().dual_clip is None
    for name in POLICY_LOSSES:
        assert cls.model_validate({"policy_loss": name}).policy_loss == name
    message = _error(cls, {"policy_loss": "grpo_clip"})
    assert message == "policy_loss: unknown policy loss 'grpo_clip'; known: ppo_clip, importance_sampling, cispo, gspo"
    assert cls.model_json_schema()["properties"]["policy_loss"]["enum"] == list(POLICY_LOSSES)


@pytest.mark.parametrize("cls", [PPOConfig, GRPOConfig])
def test_dual_clip_is_above_one_and_only_for_the_clipped_surrogates(cls):
    assert cls.model_validate({"dual_clip": 3.0}).dual_clip == 3.0
    assert cls.model_validate({"policy_loss": "gspo", "dual_clip": 1.5}).dual_clip == 1.5
    for value in (1.0, 0.5):
        message = _error(cls, {"dual_clip": value})
        assert message == "dual_clip: Input should be greater than 1", message
    for name in ("importance_sampling", "cispo"):
        message = _error(cls, {"policy_loss": name, "dual_clip": 3.0})
        assert message == f"spec: dual_clip applies to policy_loss ppo_clip and gspo only, not {name}", message


@pytest.mark.parametrize("cls", [PPOConfig, GRPOConfig, DistillConfig])
def test_rollout_correction_is_a_cap_above_one(cls):
    assert cls().rollout_correction is None and cls().loss_settings.rollout_correction is None
    assert cls.model_validate({"rollout_correction": 2.0}).loss_settings.rollout_correction == 2.0
    for value in (1.0, 0.5):
        message = _error(cls, {"rollout_correction": value})
        assert message == "rollout_correction: Input should be greater than 1", message
    message = _error(cls, {"rollout_correction": 1000.0})
    assert message == "rollout_correction: Input should be less than or equal to 100", message


def test_policy_loss_refusals_in_a_job_spec_name_the_field():
    message = _error(JobSpec, _spec("ppo", hyperparameters={"policy_loss": "ppo"}))
    assert message.startswith("hyperparameters: policy_loss: unknown policy loss 'ppo'; known: ppo_clip,"), message
    grpo = {"type": "grpo", "model": "builtin:tiny", "dataset": "builtin:digits-prompts", "reward_model": "job:rm-1"}
    message = _error(JobSpec, {**grpo, "hyperparameters": {"policy_loss": "cispo", "dual_clip": 2.0}})
    assert message == "hyperparameters: dual_clip applies to policy_loss ppo_clip and gspo only, not cispo", message


def test_loss_settings_from_each_config():
    ppo = PPOConfig.model_validate({"cliprange": 0.1, "dual_clip": 3.0})
    assert ppo.loss_settings == LossSettings(clip_low=0.1, clip_high=0.1, dual_clip=3.0)
    grpo = GRPOConfig.model_validate({"cliprange_low": 3e-4, "cliprange_high": 4e-4, "policy_loss": "gspo"})
    assert grpo.loss_settings == LossSettings(clip_low=3e-4, clip_high=4e-4)


@pytest.mark.parametrize(
    ("policy_loss", "low", "high", "aggregation"),
    [
        ("ppo_clip", 0.2, 0.2, "token_mean"),
        ("importance_sampling", 0.2, 0.2, "token_mean"),
        ("cispo", 1.0, 3.0, "token_mean"),  # Tinker's clip(π/π_old, 0, 4): no lower bound, capped at 4
        ("gspo", 3e-4, 4e-4, "sequence_mean"),  # the GSPO paper's (arXiv:2507.18071 §5.1)
    ],
)
def test_a_spec_leaving_the_range_out_gets_its_loss_s_own(
    policy_loss: str, low: float, high: float, aggregation: str
) -> None:
    for cls in (PPOConfig, GRPOConfig, DistillConfig):
        config = cls.model_validate({"policy_loss": policy_loss})
        assert config.loss_settings == LossSettings(clip_low=low, clip_high=high), cls
        assert config.loss_aggregation == config.aggregation == aggregation, cls  # filled in, so stored
    dr_grpo = GRPOConfig.model_validate({"policy_loss": policy_loss, "advantage_estimator": "dr_grpo"})
    assert dr_grpo.aggregation == ("sequence_mean" if policy_loss == "gspo" else "constant")


def test_a_spec_that_sets_a_range_or_an_aggregation_keeps_it() -> None:
    cispo = GRPOConfig.model_validate({"policy_loss": "cispo", "cliprange_high": 0.28})
    assert cispo.loss_settings == LossSettings(clip_low=1.0, clip_high=0.28)  # the other side: the loss's own
    gspo = GRPOConfig.model_validate(
        {"policy_loss": "gspo", "cliprange_low": 0.2, "cliprange_high": 0.2, "loss_aggregation": "token_mean"}
    )
    assert (gspo.loss_settings, gspo.aggregation) == (LossSettings(clip_low=0.2, clip_high=0.2), "token_mean")
    ppo = PPOConfig.model_validate({"policy_loss": "cispo", "cliprange": 0.2, "loss_aggregation": "sequence_mean"})
    assert (ppo.loss_settings, ppo.aggregation) == (LossSettings(clip_low=0.2, clip_high=0.2), "sequence_mean")
    distill = DistillConfig.model_validate({"policy_loss": "gspo", "loss_aggregation": "constant"})
    assert distill.aggregation == "constant"
    assert GRPOConfig.model_validate({"cliprange_low": 1}).loss_settings.clip_low == 1.0  # no lower bound
    assert _error(GRPOConfig, {"cliprange_low": 1.5}) == "cliprange_low: Input should be less than or equal to 1"
