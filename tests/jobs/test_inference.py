"""inference.generate from real checkpoints: an SFT model, a reward model and a short PPO job trained
through the runner once per session."""

import math
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy.orm import Session

from engine.core.models import resolve_model_ref
from engine.rewards.reward_model import score_texts
from jobs import inference, runner
from jobs.inference import GenerateError, LRUCache
from jobs.store import crud, db
from jobs.store.settings import Settings
from tests.factories import create_job, make_settings, new_project
from tests.jobs.helpers import LEASE_SECONDS, sft_spec

PROMPTS = ["The food was", "Service here is", ""]


@dataclass
class Trained:
    settings: Settings
    sft: str
    rm: str
    ppo: str


@pytest.fixture(scope="session")
def trained(sqlite_url: str, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """SFT (30 steps), a reward model on it (20 steps), and PPO from both (2 steps, a checkpoint each)."""
    settings = make_settings(tmp_path_factory.mktemp("inference"), sqlite_url, lease_seconds=LEASE_SECONDS)
    project_id = new_project(settings).id
    sft = create_job(
        settings,
        project_id,
        sft_spec(hyperparameters={"max_steps": 30, "batch_size": 32, "learning_rate": 3e-3}, checkpoint_every=100),
    )
    rm = create_job(
        settings,
        project_id,
        {
            "type": "rm",
            "model": f"job:{sft}",
            "dataset": "builtin:reviews-prefs",
            "hyperparameters": {"max_steps": 20, "batch_size": 16, "learning_rate": 1e-3},
            "checkpoint_every": 100,
        },
    )
    ppo = create_job(
        settings,
        project_id,
        {
            "type": "ppo",
            "model": f"job:{sft}",
            "reward_model": f"job:{rm}",
            "dataset": "builtin:reviews-prompts",
            "hyperparameters": {
                "total_steps": 2,
                "batch_size": 8,
                "mini_batch_size": 4,
                "response_length": 8,
                "temperature": 1.0,
            },
            "checkpoint_every": 1,
        },
    )
    for job_id in (sft, rm, ppo):
        assert runner.run_job(job_id, settings=settings, worker="w:1") == "succeeded"
    return Trained(settings, sft, rm, ppo)


@pytest.fixture(autouse=True)
def empty_caches() -> None:
    inference.clear_caches()


def test_generate_is_seeded_and_the_second_call_hits_the_cache(trained: Trained) -> None:
    first = inference.generate(trained.ppo, None, PROMPTS, max_new_tokens=12, seed=1, settings=trained.settings)
    assert inference.cache_stats()["policies"] == {"hits": 0, "misses": 1, "size": 1, "capacity": 2}
    second = inference.generate(trained.ppo, 2, PROMPTS, max_new_tokens=12, seed=1, settings=trained.settings)

    assert inference.cache_stats()["policies"]["hits"] == 1
    assert inference.cache_stats()["policies"]["misses"] == 1
    assert first == second
    assert first["checkpoint"] == 2
    assert [c["prompt"] for c in first["completions"]] == PROMPTS
    for c in first["completions"]:
        assert set(c) == {"prompt", "text", "finish_reason"}
        assert isinstance(c["text"], str) and c["finish_reason"] in ("stop", "length")
    other = inference.generate(trained.ppo, None, PROMPTS, max_new_tokens=12, seed=2, settings=trained.settings)
    assert other != first


def test_an_older_checkpoint_is_a_different_cache_entry(trained: Trained) -> None:
    out = inference.generate(trained.ppo, 1, PROMPTS[:1], max_new_tokens=4, settings=trained.settings)
    inference.generate(trained.ppo, 2, PROMPTS[:1], max_new_tokens=4, settings=trained.settings)
    assert out["checkpoint"] == 1
    assert inference.cache_stats()["policies"]["misses"] == 2


def test_scores_come_from_the_ppo_jobs_reward_model(trained: Trained) -> None:
    out = inference.generate(trained.ppo, None, PROMPTS, max_new_tokens=12, score=True, settings=trained.settings)
    scores = [c["score"] for c in out["completions"]]
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores)

    again = inference.generate(trained.ppo, None, PROMPTS, max_new_tokens=12, score=True, settings=trained.settings)
    assert [c["score"] for c in again["completions"]] == scores
    assert inference.cache_stats()["reward_models"]["misses"] == 1
    assert inference.cache_stats()["reward_models"]["hits"] == 1


def test_scores_do_not_depend_on_the_batch(trained: Trained) -> None:
    """Padding invariance: a text scores the same alone as next to longer and shorter ones."""
    inference.generate(trained.ppo, None, PROMPTS[:1], max_new_tokens=2, score=True, settings=trained.settings)
    rm_dir = resolve_model_ref(str(trained.settings.resolved_artifacts_dir / "jobs" / trained.rm))
    reward_model = inference.reward_models.get((rm_dir, 0), lambda: pytest.fail("the reward model is not cached"))
    texts = ["great", "slow and rude, never again, the worst evening of the year", ""]

    stopped = [True, False, True]

    batch = score_texts(reward_model.model, reward_model.tokenizer, PROMPTS, texts, stopped).tolist()

    for prompt, text, done, expected in zip(PROMPTS, texts, stopped, batch, strict=True):
        [single] = score_texts(reward_model.model, reward_model.tokenizer, [prompt], [text], [done]).tolist()
        assert single == pytest.approx(expected, abs=1e-5)
    assert len(set(batch)) == 3


def test_an_sft_job_generates_but_cannot_score(trained: Trained) -> None:
    out = inference.generate(trained.sft, 30, ["The food was"], max_new_tokens=6, settings=trained.settings)
    assert len(out["completions"]) == 1
    with pytest.raises(GenerateError, match="reward model"):
        inference.generate(trained.sft, None, ["The food was"], score=True, settings=trained.settings)


def test_requests_that_cannot_be_served(trained: Trained) -> None:
    with pytest.raises(GenerateError, match="scores text but does not generate"):
        inference.generate(trained.rm, None, ["x"], settings=trained.settings)
    with pytest.raises(GenerateError, match="no checkpoint at step 7"):
        inference.generate(trained.ppo, 7, ["x"], settings=trained.settings)
    with pytest.raises(GenerateError, match="no job"):
        inference.generate("job_nope", None, ["x"], settings=trained.settings)
    with pytest.raises(GenerateError, match="prompts"):
        inference.generate(trained.ppo, None, [], settings=trained.settings)
    with pytest.raises(GenerateError, match="exceeds the model's context"):
        inference.generate(trained.ppo, None, ["x"], max_new_tokens=500, settings=trained.settings)
    with pytest.raises(GenerateError, match="'latest'"):
        inference.generate(trained.ppo, "newest", ["x"], settings=trained.settings)
    latest = inference.generate(trained.ppo, "latest", ["x"], max_new_tokens=2, settings=trained.settings)
    assert latest["checkpoint"] == 2


def test_lru_cache_evicts_the_least_recently_used() -> None:
    cache: LRUCache[str, int] = LRUCache(2)
    loads: list[str] = []

    def load(key: str) -> int:
        loads.append(key)
        return len(loads)

    for key in ["a", "b", "a", "c", "a", "b"]:
        cache.get(key, lambda key=key: load(key))  # type: ignore[misc]
    assert loads == ["a", "b", "c", "b"]  # b was evicted by c, a stayed since it was used
    assert cache.stats() == {"hits": 2, "misses": 4, "size": 2, "capacity": 2}


def test_latest_survives_checkpoint_retention_removing_it_during_the_request(
    trained: Trained, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = trained.settings
    job_id = create_job(settings, new_project(settings).id, sft_spec())  # checkpoints at steps 2 and 4
    assert runner.run_job(job_id, settings=settings, worker="w:1") == "succeeded"
    lookup = inference._lookup
    lookups: list[int] = []

    def racing_retention(session: Session, job_id: str, *args: Any) -> Any:
        """The lookup finds step 4; then the job saves step 6 and its retention removes step 4."""
        request = lookup(session, job_id, *args)
        lookups.append(request.step)
        if request.step == 4:
            checkpoints = settings.resolved_artifacts_dir / "jobs" / job_id / "checkpoints"
            (checkpoints / "step-4").rename(checkpoints / "step-6")
            path = (checkpoints / "step-6").relative_to(settings.resolved_artifacts_dir).as_posix()
            with db.session_scope(settings.resolved_database_url) as other:
                crud.record_checkpoint(other, job_id=job_id, step=6, path=path, metrics={}, kept_steps=[2, 6])
        return request

    monkeypatch.setattr(inference, "_lookup", racing_retention)
    answer = inference.generate(job_id, "latest", ["x"], max_new_tokens=2, settings=settings)
    assert lookups == [4, 6] and answer["checkpoint"] == 6
    with pytest.raises(GenerateError, match="step 4"):  # a step asked for by number is not replaced
        inference.generate(job_id, 4, ["x"], max_new_tokens=2, settings=settings)
