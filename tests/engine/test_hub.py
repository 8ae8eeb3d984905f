"""Hub ids without a network: ``from_pretrained(ref, **hub_kwargs(ref))`` fails in seconds, naming
HF_HUB_OFFLINE, when the hub cannot be reached, and loads a cached model without any network call."""

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from engine import builtin
from engine.core.models import ModelNotFoundError, load_causal_lm, load_tokenizer
from engine.spec import hub
from tests.hf_cache import put_in_cache, use_cache

REPO_ID = "someorg/tiny-model"


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No remembered probe, HF_HUB_OFFLINE off and an empty cache, whatever the environment says."""
    monkeypatch.setattr(hub, "_answers", {})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    use_cache(monkeypatch, tmp_path / "hf-cache")


@pytest.fixture
def silent_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The hub endpoint becomes a port that accepts connections and never answers, as behind a firewall that
    drops packets; the probe waits 1 s for it."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(hub, "PROBE_TIMEOUT", 1.0)
        yield endpoint


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every connection attempt of this process, refused and recorded."""
    attempts: list[Any] = []

    def connect(self: socket.socket, address: Any) -> None:
        attempts.append(address)
        raise OSError("the test forbids network calls")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect)
    return attempts


def probe_answers(monkeypatch: pytest.MonkeyPatch, reachable: bool) -> list[str]:
    asked: list[str] = []

    def probe(endpoint: str) -> bool:
        asked.append(endpoint)
        return reachable

    monkeypatch.setattr(hub, "probe", probe)
    return asked


def tiny_model(folder: Path) -> Path:
    """A 2-layer GPT-2 with the built-in tokenizer, saved as a Hugging Face folder."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(builtin.TOKENIZER_FILE), eos_token=builtin.EOS_TOKEN, pad_token=builtin.PAD_TOKEN
    )
    config = GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_head=2, n_embd=32, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_is_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for ref in ("gpt2", "openai-community/gpt2", "Qwen/Qwen2.5-0.5B", "org/name_v1.1"):
        assert hub.is_hub_id(ref), ref
    for ref in ("builtin:tiny", "./model", "/models/x", "a/b/c", "org/../x", "org--x/y", "~/m", "org/", ""):
        assert not hub.is_hub_id(ref), ref
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not hub.is_hub_id("org/name")  # from_pretrained would load this folder first


def test_local_refs_need_nothing_and_ask_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    asked = probe_answers(monkeypatch, reachable=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").mkdir()
    for ref in ("builtin:tiny", str(tmp_path), "./llama", "llama"):
        assert hub.hub_kwargs(ref) == {}
    assert asked == []


def test_hub_offline_reads_the_cache_only_without_asking(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = probe_answers(monkeypatch, reachable=True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub.hub_kwargs(REPO_ID) == {"local_files_only": True}
    assert hub.hub_kwargs(REPO_ID, model=True) == {
        "local_files_only": True,
        "adapter_kwargs": {"local_files_only": True},
    }
    assert asked == []


def test_the_hub_is_asked_once_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = probe_answers(monkeypatch, reachable=True)
    assert hub.hub_kwargs(REPO_ID) == {}
    assert hub.hub_kwargs("other/model") == {}
    assert asked == [constants.ENDPOINT]
    now = time.monotonic()
    monkeypatch.setattr(hub.time, "monotonic", lambda: now + hub.PROBE_TTL + 1)
    probe_answers(monkeypatch, reachable=False)
    assert hub.hub_kwargs(REPO_ID) == {"local_files_only": True}


def test_probe(silent_endpoint: str) -> None:
    start = time.monotonic()
    assert not hub.probe(silent_endpoint)
    assert time.monotonic() - start < 5
    assert not hub.probe("http://127.0.0.1:9")  # nothing listens: refused at once
    assert not hub.probe("http://no-such-host.invalid")

    class Answer(threading.Thread):  # one HTTP answer, whatever its status
        def run(self) -> None:
            connection, _ = server.accept()
            with connection:
                connection.recv(4096)
                connection.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        answer = Answer(daemon=True)
        answer.start()
        assert hub.probe(f"http://127.0.0.1:{server.getsockname()[1]}")
        answer.join(5)


@pytest.mark.parametrize("auto", [AutoTokenizer, AutoModelForCausalLM], ids=["tokenizer", "model"])
def test_a_hub_id_fails_in_seconds_when_the_hub_cannot_be_reached(silent_endpoint: str, auto: Any) -> None:
    start = time.monotonic()
    with pytest.raises(OSError) as error:
        auto.from_pretrained(
            REPO_ID, trust_remote_code=False, **hub.hub_kwargs(REPO_ID, model=auto is not AutoTokenizer)
        )
    message = hub.explain_missing(REPO_ID, error.value)
    assert time.monotonic() - start < 15
    assert REPO_ID in message
    assert "cannot be reached" in message
    assert "HF_HUB_OFFLINE=1" in message


def test_the_message_with_hub_offline_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError) as error:
        AutoTokenizer.from_pretrained(REPO_ID, trust_remote_code=False, **hub.hub_kwargs(REPO_ID))
    message = hub.explain_missing(REPO_ID, error.value)
    assert "HF_HUB_OFFLINE is set" in message
    assert constants.HF_HUB_CACHE in message


def test_a_missing_model_on_a_reachable_hub_keeps_the_loader_message(monkeypatch: pytest.MonkeyPatch) -> None:
    probe_answers(monkeypatch, reachable=True)
    assert hub.explain_missing(REPO_ID, OSError("404: no such repo")) == f"cannot load {REPO_ID!r}: 404: no such repo"
    assert hub.explain_missing("./folder", OSError("no config.json")) == "cannot load './folder': no config.json"


@pytest.mark.parametrize("why", ["unreachable", "HF_HUB_OFFLINE"])
def test_a_cached_model_loads_fast_without_the_network(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, why: str, no_network: list[Any]
) -> None:
    put_in_cache(Path(constants.HF_HUB_CACHE), REPO_ID, tiny_model(tmp_path / "saved"))
    if why == "unreachable":
        probe_answers(monkeypatch, reachable=False)
    else:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(REPO_ID, trust_remote_code=False, **hub.hub_kwargs(REPO_ID))
    model = AutoModelForCausalLM.from_pretrained(
        REPO_ID, trust_remote_code=False, **hub.hub_kwargs(REPO_ID, model=True)
    )
    assert time.monotonic() - start < 10
    assert no_network == []
    assert model.config.n_layer == 2
    assert tokenizer.eos_token == builtin.EOS_TOKEN


def test_the_engine_fails_a_hub_id_in_seconds_naming_hf_hub_offline(silent_endpoint: str) -> None:
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE=1") as error:
        load_tokenizer(REPO_ID)
    with pytest.raises(ModelNotFoundError, match="cannot be reached"):
        load_causal_lm(REPO_ID, load_tokenizer("builtin:tiny"), seed=0)
    assert time.monotonic() - start < 15 and REPO_ID in str(error.value)
