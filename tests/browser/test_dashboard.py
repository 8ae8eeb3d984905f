"""The web dashboard in a real headless browser (Debian's chromium, driven by Playwright) against a real
``rlhf serve``: sign in, create a PPO job through the form (after a 422 that names its field), watch its charts
grow from the live stream, read its rollout samples, pause it, and sample it with the "try it" box; create a GRPO
job rewarded by a grader (``reward``) instead of a reward model; follow a job that the official ``openai`` client
created (on a tiny Llama from the server's model root) to "succeeded". Everything that differs by job type (the
form's types, datasets, model pickers, reward rows and example reward, a job's charts) comes from
``GET /v1/job_types``: a type the server adds is offered with no change to the dashboard.

Outside CI the test skips when chromium or Playwright is missing; under ``CI=true`` it fails instead (.ci/run
installs chromium). ``RLHF_SCREENSHOT=docs/dashboard.png`` also writes the job page's screenshot there.
"""

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine.spec.config import JOB_TYPES
from jobs.client import KEY_FILE, Client
from jobs.demo import embedded_server
from jobs.store import crud
from jobs.store.db import session_scope
from tests.models import build_model, openai_rows, write_jsonl
from tests.services import unavailable
from tests.test_e2e import finished, free_port, wait_for

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000
PPO_HYPERPARAMETERS = {"total_steps": 400, "batch_size": 8, "mini_batch_size": 8, "response_length": 12,
                       "log_samples_every": 3, "log_samples": 6}  # fmt: skip


def chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        unavailable("chromium (apt-get install chromium)", FileNotFoundError("chromium"))
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        unavailable("playwright (the dev extra)", e)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's model root (``RLHF_MODEL_ROOT``): a tiny random-weight Llama at ``llama/``."""
    root = tmp_path_factory.mktemp("models")
    build_model("llama", root / "llama")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[tuple[Client, str, Path]]:
    data_dir = tmp_path_factory.mktemp("server")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RLHF_MODEL_ROOT", str(model_root))
        with embedded_server(data_dir, free_port()) as client:
            yield client, (data_dir / KEY_FILE).read_text().strip(), data_dir


POINTS_AT_LEAST = """([metric, n]) =>
    Number(document.querySelector(`figure[data-metric="${metric}"]`).dataset.points) >= n"""
SAMPLES_SNAPSHOT = """() => ({
    step: document.querySelector('#sample-step').value,
    histogram_step: document.querySelector('#reward-histogram').dataset.step,
    caption: document.querySelector('#reward-histogram figcaption').textContent,
    headers: [...document.querySelectorAll('#samples thead th')].map((e) => e.textContent),
    first_row: [...document.querySelectorAll('#samples tbody tr:first-child td')].map((e) => e.textContent),
})"""


def _unexpected(message: str) -> bool:
    return not re.fullmatch(r"Failed to load resource: the server responded with a status of (401|422) .*", message)


def points(page: Any, metric: str) -> int:
    return int(page.get_attribute(f'figure[data-metric="{metric}"]', "data-points"))


def values(page: Any, selector: str) -> list[str]:
    """The values of the elements ``selector`` matches (a select's options)."""
    found: list[str] = page.eval_on_selector_all(selector, "els => els.map((e) => e.value)")
    return found


def charted(page: Any) -> list[str]:
    """The metrics of a job page's headline charts, in order."""
    found: list[str] = page.eval_on_selector_all("#charts figure", "els => els.map((e) => e.dataset.metric)")
    return found


def hyperparameters(page: Any) -> Any:
    return json.loads(page.input_value("#hyperparameters"))


def sign_in(page: Any, url: str, key: str) -> None:
    page.goto(url + "/")
    page.fill("#api-key", key)
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#jobs-table")


def test_dashboard_drives_a_ppo_job(browser: Any, server: tuple[Client, str, Path], tmp_path: Path) -> None:
    c, key, data_dir = server
    started = time.monotonic()
    # The SFT and reward-model jobs PPO starts from, as small as they come.
    sft = c.create_job(
        {"type": "sft", "name": "dash-sft", "model": "builtin:tiny", "dataset": "builtin:reviews-sft",
         "hyperparameters": {"max_steps": 8, "batch_size": 16, "learning_rate": 3e-3}, "checkpoint_every": 8}
    )  # fmt: skip

    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    # Console errors but the refused requests this test makes on purpose (the wrong key, the bad spec).
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" and _unexpected(m.text) else None)
    page.on("pageerror", lambda e: problems.append(str(e)))

    # The page and its assets answer without a key; a wrong key is refused at sign-in.
    response = page.goto(c.url + "/")
    assert response is not None and response.status == 200
    assert "default-src 'self'" in response.headers["content-security-policy"]
    page.fill("#api-key", "rlhf-not-a-key")
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#sign-in-error:not([hidden])")
    assert "refused" in page.inner_text("#sign-in-error")
    page.fill("#api-key", key)
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector(f'#jobs-table tr[data-job-id="{sft["id"]}"]')
    assert page.evaluate("sessionStorage.getItem('rlhf-api-key')") == key

    assert wait_for(c, sft["id"], lambda j: j["status"] in ("succeeded", "failed"))["status"] == "succeeded"
    rm = c.create_job(
        {"type": "rm", "name": "dash-rm", "model": f"job:{sft['id']}", "dataset": "builtin:reviews-prefs",
         "hyperparameters": {"max_steps": 4, "batch_size": 16}}
    )  # fmt: skip
    assert wait_for(c, rm["id"], lambda j: j["status"] in ("succeeded", "failed"))["status"] == "succeeded"
    # The jobs list refreshes by itself.
    page.wait_for_selector(f'#jobs-table tr[data-job-id="{rm["id"]}"][data-status="succeeded"]')
    print(f"sft and rm done after {time.monotonic() - started:.1f}s")

    # The job types, as the dashboard reads them.
    types = {t["name"]: t for t in c.request("GET", "/v1/job_types")["data"]}
    assert list(types) == list(JOB_TYPES)

    # A reward model's page: its type's charts, and no "try it" (it scores text, it does not generate).
    page.click(f'#jobs-table a[href="#/jobs/{rm["id"]}"]')
    page.wait_for_selector('#job-status[data-status="succeeded"]')
    assert charted(page) == types["rm"]["metrics"]
    page.wait_for_selector('#charts figure[data-metric="loss/rm"]:not([data-points="0"])')
    assert page.locator("#try-it").count() == 0
    assert "does not generate" in page.inner_text("#view")

    # The new-job form, built from the job types: its types in the registry's order; per type its example
    # hyperparameters, built-in datasets, model pickers (jobs/store/refs.py's rule) and reward-model row.
    page.click('a[href="#/new"] >> nth=0')
    page.wait_for_selector("#job-type")
    assert values(page, "#job-type option") == list(JOB_TYPES)
    first = types[page.input_value("#job-type")]
    assert first["name"] == next(iter(JOB_TYPES))
    assert hyperparameters(page) == first["example"]["hyperparameters"]
    assert page.inner_text("#job-type-summary") == first["summary"]
    page.select_option("#job-type", "rm")
    assert page.is_hidden("#reward-model")
    assert hyperparameters(page) == types["rm"]["example"]["hyperparameters"]
    assert values(page, "#dataset optgroup[label=Built-in] option") == types["rm"]["builtin_datasets"]
    assert page.input_value("#dataset") == types["rm"]["example"]["dataset"]
    # A reward model starts from a policy or from a reward model.
    page.wait_for_selector(f'#model-pick option[value="job:{rm["id"]}"]', state="attached")
    assert {f"job:{sft['id']}", f"job:{rm['id']}"} <= set(values(page, "#model-pick option"))
    page.select_option("#job-type", "ppo")
    assert page.is_visible("#reward-model")
    assert hyperparameters(page) == types["ppo"]["example"]["hyperparameters"]
    assert values(page, "#dataset optgroup[label=Built-in] option") == types["ppo"]["builtin_datasets"]
    assert values(page, "#eval-dataset optgroup[label=Built-in] option") == types["ppo"]["builtin_datasets"]
    # A policy starts from a policy; a reward model is only a reward model.
    assert f"job:{sft['id']}" in values(page, "#model-pick option")
    assert f"job:{rm['id']}" not in values(page, "#model-pick option")
    assert f"job:{rm['id']}" in values(page, "#reward-pick option")
    assert f"job:{sft['id']}" not in values(page, "#reward-pick option")

    # The rest of the form: pickers, a spec preview that is exactly the body, a 422 shown with its param.
    page.select_option("#model-pick", f"job:{sft['id']}")
    page.select_option("#reward-pick", f"job:{rm['id']}")
    page.select_option("#dataset", "builtin:reviews-prompts")
    assert page.input_value("#eval-dataset") == types["ppo"]["example"].get("eval_dataset", "")  # the example's
    page.select_option("#eval-dataset", "")  # no eval: the job stays small
    page.fill("#job-name", "dash-ppo")
    page.fill("#hyperparameters", json.dumps({**PPO_HYPERPARAMETERS, "kl_coef": -1}))
    page.fill("#checkpoint-every", "2")
    page.click("#create")
    page.wait_for_selector("#form-error:not([hidden])")
    assert page.inner_text("#error-param") == "hyperparameters.kl_coef"
    page.fill("#hyperparameters", json.dumps(PPO_HYPERPARAMETERS))
    expected = {
        "type": "ppo", "name": "dash-ppo", "model": f"job:{sft['id']}", "dataset": "builtin:reviews-prompts",
        "reward_model": f"job:{rm['id']}", "hyperparameters": PPO_HYPERPARAMETERS, "seed": 0, "checkpoint_every": 2,
    }  # fmt: skip
    assert json.loads(page.inner_text("#spec-preview")) == expected
    page.click("#create")
    page.wait_for_url("**/#/jobs/job_*")
    ppo_id = page.url.rsplit("/", 1)[-1]
    assert c.get_job(ppo_id)["spec"]["reward_model"] == f"job:{rm['id']}"

    # The job page: the charts gain points as steps arrive on the stream. (The server's view first, so that a
    # failure tells a job that never ran from a page that did not follow it.)
    job = wait_for(c, ppo_id, lambda j: j["status"] != "queued" and j["step"] >= 1, timeout=120)
    assert job["status"] == "running", (job, c.request("GET", f"/v1/jobs/{ppo_id}/events").get("data"))
    try:
        page.wait_for_selector('#job-status[data-status="running"]')
    except Exception as e:
        shown = page.get_attribute("#job-status", "data-status"), page.inner_text("#live")
        raise AssertionError(f"the page shows {shown} for a running job; page errors: {problems}") from e
    page.wait_for_function(POINTS_AT_LEAST, arg=["objective/kl", 2])
    before = points(page, "objective/scores")
    page.wait_for_function(POINTS_AT_LEAST, arg=["objective/scores", before + 1])
    assert points(page, "objective/scores") > before >= 1
    assert page.inner_text("#live") == "live"
    assert charted(page) == types["ppo"]["metrics"]  # the type's headline metrics, in its order
    page.wait_for_selector("#checkpoints tr[data-step]")
    # The rollout samples beside the curves: a logged step's prompts, responses, scores, KL and lengths, a histogram
    # of its scores, and the step picker following the newest logged step as the stream brings it (1, 3, 6, ...).
    page.wait_for_selector("#samples tbody tr[data-position]")
    page.wait_for_function("() => document.querySelectorAll('#sample-step option').length >= 2", timeout=120_000)
    page.wait_for_function(
        "() => document.querySelector('#sample-step').value === document.querySelector('#sample-step option').value"
    )
    page.wait_for_function("n => document.querySelectorAll('#samples tbody tr').length === n", arg=6)
    # One snapshot of the panel (it moves on to a newer step as the stream brings one), then the server's copy of it.
    shown = page.evaluate(SAMPLES_SNAPSHOT)
    shown_step = int(shown["step"])
    served = c.request("GET", f"/v1/jobs/{ppo_id}/samples", params={"step": shown_step})
    assert served["reward_names"] == ["score"] and served["steps"][0] == 1
    assert shown_step in served["steps"] and shown_step % 3 == 0  # a logged step after the first
    assert shown["headers"] == ["#", "Prompt", "Response", "score", "KL", "Length"]
    assert shown["histogram_step"] == str(shown_step)
    cells = shown["first_row"]
    first = served["data"][0]
    assert cells[1:3] == [first["prompt"], first["response"]] and first["prompt"].strip()
    assert cells[5] == str(first["length"])
    assert int(page.get_attribute("#reward-histogram", "data-bins")) >= 1
    assert page.locator("#reward-histogram rect.bar").count() >= 1
    assert shown["caption"].startswith(f"score at step {shown_step}")
    page.select_option("#sample-step", "1")  # an older step, picked: shown until another is picked
    page.wait_for_selector('#reward-histogram[data-step="1"]')
    step_1 = c.request("GET", f"/v1/jobs/{ppo_id}/samples", params={"step": 1})["data"]
    assert page.inner_text("#samples tbody tr:first-child td.response") == step_1[0]["response"]
    # A training-health alert (a warning event whose data names the signal) shows as a banner, live.
    with session_scope(f"sqlite:///{data_dir / 'rlhf.db'}") as session:
        crud.add_event(
            session, job_id=ppo_id, kind="warning", message="objective/kl jumped to 4.2 (baseline 0.3)",
            data={"alert": "kl_jump", "step": 3, "value": 4.2, "baseline": 0.3},
        )  # fmt: skip
    page.wait_for_selector('#alerts .alert[data-alert="kl_jump"]')
    assert "value 4.2, baseline 0.3" in page.inner_text("#alerts")
    page.wait_for_selector("#events tr.event-alert")
    shot = tmp_path / "dashboard-job.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot of the running job: {shot}")

    target = os.environ.get("RLHF_SCREENSHOT")
    if target:  # a few more steps for the documentation's picture
        page.wait_for_function(POINTS_AT_LEAST, arg=["objective/scores", 12], timeout=120_000)

    # Pause: the status changes live, and the job stops between steps.
    page.click("#pause")
    page.wait_for_selector('#job-status[data-status="pausing"], #job-status[data-status="paused"]')
    page.wait_for_selector('#job-status[data-status="paused"]')
    assert c.get_job(ppo_id)["status"] == "paused"
    assert page.is_enabled("#resume") and not page.is_enabled("#pause")

    # Try it: two prompts against the latest checkpoint, scored by the reward model.
    page.fill("#try-prompts", "i went to see the remake and honestly it was\ni streamed this comedy and overall it was")
    page.fill("#try-max-tokens", "12")
    assert page.is_checked("#try-score")
    page.click("#try-run")
    page.wait_for_selector("#try-results td.completion >> nth=1")
    assert page.locator("#try-results td.completion").count() == 2
    assert page.locator("#try-results .score").count() == 2
    if target:
        page.screenshot(path=target, full_page=True)
        print(f"screenshot written to {target}")

    c.request("POST", f"/v1/jobs/{ppo_id}/cancel")
    page.wait_for_selector('#job-status[data-status="cancelled"]')

    # Sign out forgets the key.
    page.click("#sign-out")
    page.wait_for_selector("#sign-in:not([hidden])")
    assert page.evaluate("sessionStorage.getItem('rlhf-api-key')") is None
    assert not problems, problems  # no script errors, no Content-Security-Policy violations
    print(f"dashboard test took {time.monotonic() - started:.1f}s")


def test_the_form_offers_a_type_the_server_adds(browser: Any, server: tuple[Client, str, Path], tmp_path: Path) -> None:
    """A job type the dashboard has never heard of (added here to the answer of ``GET /v1/job_types`` on its way
    to the page, as a server with a new type would send it) is offered with its own summary, datasets, uploaded
    files, model pickers and hyperparameters; files match a type by dataset kind, old purpose names included."""
    c, key, _ = server
    types = {t["name"]: t for t in c.request("GET", "/v1/job_types")["data"]}
    fake = {
        "name": "fake-dpo",
        "summary": "a policy straight from preference pairs (a type this server does not have)",
        "dataset_kind": "preference",
        "output": "policy",
        "generates": True,
        "reward_model": False,
        "metrics": ["loss/fake", "fake/accuracy"],
        "hyperparameters": {**types["sft"]["hyperparameters"], "beta": 0.1},
        "builtin_datasets": types["rm"]["builtin_datasets"],
        "example": {"dataset": "builtin:reviews-prefs", "hyperparameters": {"beta": 0.2, "batch_size": 16}},
    }
    pair = {"prompt": "the film was", "chosen": " great", "rejected": " bad"}
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text(json.dumps(pair) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the film was"}) + "\n")
    legacy = c.upload_file(prefs, "rm")["id"]  # the earlier name of "preference"
    prompt_file = c.upload_file(prompts, "prompts")["id"]
    jobs = c.request("GET", "/v1/jobs", params={"limit": 100})["data"]
    policies = {f"job:{j['id']}" for j in jobs if j["status"] == "succeeded" and types[j["type"]]["output"] == "policy"}
    reward_models = {f"job:{j['id']}" for j in jobs if j["status"] == "succeeded"} - policies

    def add_fake(route: Any) -> None:
        response = route.fetch()
        body = response.json()
        body["data"].append(fake)
        route.fulfill(response=response, json=body)

    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.route("**/v1/job_types", add_fake)
    sign_in(page, c.url, key)
    page.click('a[href="#/new"] >> nth=0')
    page.wait_for_selector("#job-type")
    assert values(page, "#job-type option") == [*JOB_TYPES, "fake-dpo"]

    page.select_option("#job-type", "ppo")
    page.fill("#reward-model", "builtin:tiny")
    page.wait_for_selector(f'#dataset option[value="{prompt_file}"]', state="attached")
    assert legacy not in values(page, "#dataset option")

    page.select_option("#job-type", "fake-dpo")
    assert page.inner_text("#job-type-summary") == fake["summary"]
    assert page.is_hidden("#reward-model")
    assert values(page, "#dataset optgroup[label=Built-in] option") == fake["builtin_datasets"]
    assert legacy in values(page, "#dataset optgroup[label=Uploaded] option")
    assert prompt_file not in values(page, "#dataset option")
    assert set(values(page, "#model-pick option")) == {"", "builtin:tiny", *policies}
    assert set(values(page, "#reward-pick option")) == {"", *reward_models}
    # An upload for the type is of its dataset kind.
    page.set_input_files("#upload-file", str(prefs))
    page.click("#upload")
    page.wait_for_selector("#upload-status:has-text('1 rows')")
    uploaded = page.input_value("#dataset")
    assert c.request("GET", f"/v1/files/{uploaded}")["purpose"] == "preference"
    # The spec: the type's example hyperparameters, no reward model (it takes none, though one was typed for PPO).
    example = fake["example"]["hyperparameters"]
    assert json.loads(page.inner_text("#spec-preview")) == {
        "type": "fake-dpo", "model": "builtin:tiny", "dataset": uploaded, "hyperparameters": example, "seed": 0,
    }  # fmt: skip
    page.close()
    assert not problems, problems


def test_the_form_takes_a_reward_grader(browser: Any, server: tuple[Client, str, Path]) -> None:
    """A grpo job from the form: the reward box starts from the type's example (a string_check grader) and no
    reward model is picked; JSON that does not parse is told next to the box and sends nothing; a reward service
    outside the operator's list is the server's 422, told next to the box; the job page shows the reward, and its
    "try it" offers no scores (a job rewarded by graders has no reward model to score with)."""
    c, key, _ = server
    example = {t["name"]: t for t in c.request("GET", "/v1/job_types")["data"]}["grpo"]["example"]

    def job_ids() -> set[str]:
        return {j["id"] for j in c.request("GET", "/v1/jobs", params={"limit": 100})["data"]}

    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" and _unexpected(m.text) else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    sign_in(page, c.url, key)
    page.click('a[href="#/new"] >> nth=0')
    page.wait_for_selector("#job-type")
    page.select_option("#job-type", "ppo")
    assert page.input_value("#reward") == ""  # ppo's example has no reward (the demo gives it a reward model)
    page.select_option("#job-type", "grpo")
    assert json.loads(page.input_value("#reward")) == example["reward"]
    assert [page.input_value(f) for f in ("#reward-pick", "#reward-model", "#eval-reward")] == ["", "", ""]
    page.select_option("#eval-dataset", "")  # no eval: the job stays small
    before = job_ids()

    page.fill("#reward", '{"type": "string_check",')
    page.wait_for_selector("#reward-error:not([hidden])")
    assert page.inner_text("#reward-error").startswith("reward: not valid JSON")
    page.click("#create", force=True)  # refused: the button is disabled while the spec does not parse
    assert not page.is_enabled("#create")

    page.fill("#reward", json.dumps({"type": "http", "url": "https://rewards.example.com/score"}))
    page.click("#create")
    page.wait_for_selector("#reward-error:not([hidden])")
    assert page.inner_text("#error-param") == "reward"
    assert "(reward_not_allowed)" in page.inner_text("#reward-error")
    assert "invalid" in (page.get_attribute("#reward", "class") or "")
    assert job_ids() == before

    page.fill("#reward", json.dumps(example["reward"], indent=2))
    shown = json.loads(page.inner_text("#spec-preview"))
    assert shown["reward"] == example["reward"] and "reward_model" not in shown
    page.click("#create")
    page.wait_for_url("**/#/jobs/job_*")
    grpo_id = page.url.rsplit("/", 1)[-1]
    try:
        spec = c.get_job(grpo_id)["spec"]
        assert spec["reward"]["type"] == "string_check" and spec.get("reward_model") is None, spec
        page.wait_for_selector("#try-it")
        assert page.inner_text("#job-reward") == f"reward string_check {example['reward']['name']}"
        assert page.locator("#try-score").count() == 0
    finally:  # the worker is free for what comes next
        if not finished(c.get_job(grpo_id)):
            c.request("POST", f"/v1/jobs/{grpo_id}/cancel")
        wait_for(c, grpo_id, finished)
    page.close()
    assert not problems, problems


def test_a_job_the_openai_sdk_created_is_on_the_dashboard(
    browser: Any, server: tuple[Client, str, Path], tmp_path: Path
) -> None:
    """A supervised job created with the official ``openai`` client (upload, then create) is a job like any other
    on the dashboard: listed as an sft job named by its suffix, and followed on its page to "succeeded"."""
    c, key, _ = server
    oa = openai.OpenAI(api_key=key, base_url=f"{c.url}/v1", max_retries=0)
    with write_jsonl(openai_rows("supervised", 16), tmp_path / "supervised.jsonl").open("rb") as f:
        file = oa.files.create(file=f, purpose="fine-tune")
    job = oa.fine_tuning.jobs.create(
        model="llama", training_file=file.id, suffix="sdk-dash",
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 8}}},
    )  # fmt: skip

    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    sign_in(page, c.url, key)
    row = f'#jobs-table tr[data-job-id="{job.id}"]'
    page.wait_for_selector(row)
    assert page.inner_text(f"{row} td:nth-child(2)") == "sft"
    assert page.inner_text(f"{row} td:first-child a") == "sdk-dash"

    page.click(f'{row} a[href="#/jobs/{job.id}"]')
    page.wait_for_selector(
        ", ".join(f'#job-status[data-status="{s}"]' for s in ("succeeded", "failed", "cancelled")), timeout=120_000
    )
    assert page.get_attribute("#job-status", "data-status") == "succeeded", oa.fine_tuning.jobs.retrieve(job.id).error
    page.close()
    assert not problems, problems
