"""Rollouts on a vLLM server (``rollout_engine: "vllm"``): sampling through its OpenAI-compatible completions
endpoint, weight sync after the policy changed, and the check that the sync took.

vLLM pins its own torch and transformers, so it never runs in the trainer's environment: the job starts
``python -m vllm.entrypoints.openai.api_server`` from the environment the operator names (:class:`VllmServer`), or
talks to a server the operator runs. :class:`VllmSampler` is what :meth:`engine.core.learner.Learner.sample`
delegates to. Before it samples from a policy whose weights changed since the last sync, it pushes them:

- LoRA: the adapters saved under a new name each version and loaded (the old one unloaded), the requests then
  naming the new adapter;
- full weights: saved into one safetensors file and reloaded in place.

The job's own server does both through rlhf's vLLM plugin (engine/core/vllm_plugin/), from its ``rollout/``
folder only, with no dev mode and on a socket only this user reaches (:class:`VllmServer`); an operator's server
through vLLM's dev mode (``/collective_rpc`` ``reload_weights``) and runtime adapter loading, which its operator
switched on.

After every sync it asks vLLM for the log-probs of a fixed probe (the first batch's longest prompt, at
temperature 1) and compares them with the trainer's: their mean absolute difference is ``rollout/sync_gap``, and
above the job's ``rollout_sync_max_gap`` the job fails with :class:`RolloutOutOfSyncError`. A server that dies or
stops answering is :class:`RolloutEngineLost`: the attempt is lost, the job resumes from its last checkpoint.
"""

import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.callbacks import VllmSettings
from engine.core.models import token_logprobs

LOG_TAIL_BYTES = 256 * 1024
"""How much of the end of a server's log is searched for its error."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM's ``--max-lora-rank`` accepts."""


class RolloutEngineError(RuntimeError):
    """The vLLM server could not start, or refused a request (an adapter it cannot load, a bad request)."""


class RolloutEngineLost(RuntimeError):
    """The vLLM server died or stopped answering mid-job: the attempt is lost, as a lost worker's."""


class RolloutOutOfSyncError(RuntimeError):
    """After a sync, vLLM's log-probs of the probe are not the trainer's: it is not sampling the trained policy."""


LOG_PREFIX = re.compile(r"^\((?:\w+ )?pid=\d+\) (?:ERROR|WARNING|INFO|DEBUG) [\d-]+ [\d:]+ \[[^\]]*\] ?")
"""What vLLM puts before each line of its log: ``(Worker pid=18636) ERROR 12-08 00:55:42 [file.py:1063] ``."""
ERROR_LINE = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")


def server_error(log: str) -> str | None:
    """The vLLM server's own last error in its log (``RuntimeError: Unsupported CPU attention configuration:
    head_dim=16 ...``): the last line that names an exception, less those that only point at another
    ("EngineCore encountered an issue. See stack trace (above)"), and less its module path; None without one."""
    found = None
    for line in log.splitlines():
        match = ERROR_LINE.search(LOG_PREFIX.sub("", line).strip())
        if match and "stack trace" not in match.group(2):
            found = f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2).strip()}"
    return found


PLUGIN = Path(__file__).parent / "vllm_plugin"
"""rlhf's vLLM endpoint plugin (``rlhf_vllm_sync``): the folder a job's server gets as its ``PYTHONPATH``."""
PLUGIN_NAME = "rlhf_sync"
VLLM_SETTINGS_REMOVED = (
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "VLLM_SERVER_DEV_MODE",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "VLLM_API_KEY",
    "VLLM_PLUGINS",
    "VLLM_LORA_RESOLVER_CACHE_DIR",
)
"""Variables of the worker's environment a job's server never gets: the trainer's python paths (vLLM's are
others), and vLLM's switches that would open routes the job does not use."""


class VllmServer:
    """A vLLM OpenAI-compatible server the job runs from the operator's environment, that no one else reaches.

    It listens on a Unix socket in a folder of its own that only this user may open (no TCP port: another local
    user cannot connect, and a reward grader's URL cannot name it), and refuses (401) every request, on every path,
    without its key: a random secret made here, handed over in a file in that folder (never on a command line).
    It runs without vLLM's dev mode and without loading adapters from paths at run time: the weight sync goes
    through rlhf's vLLM plugin (engine/core/vllm_plugin/), which reloads weights only from ``weights/`` and loads
    adapters only from ``adapters/`` beside ``model_dir`` (the job's ``rollout/``: ``folder``).
    """

    def __init__(
        self, python: str, model_dir: Path, max_model_len: int, dtype: str, lora_rank: int | None, log_path: Path
    ) -> None:
        if not Path(python).is_file():
            raise RolloutEngineError(f"no python at {python} (RLHF_VLLM_PYTHON): the vLLM environment is not there")
        self.folder = model_dir.parent
        """Where the sync writes what the server loads: ``weights/``, ``adapters/<name>/``."""
        self.private = Path(tempfile.mkdtemp(prefix="rlhf-vllm-"))  # 0700; short, as a socket's path must be
        self.socket = self.private / "vllm.sock"
        self.url = f"unix:{self.socket}"
        """Where it listens, for messages (requests go through :meth:`client`)."""
        self.key = secrets.token_urlsafe(32)
        key_file = os.open(self.private / "key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(key_file, self.key.encode())
        os.close(key_file)
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--served-model-name", "base", "--uds", str(self.socket),
                   "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0",
                   "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]  # fmt: skip
        if not torch.cuda.is_available():
            command.append("--enforce-eager")
        if lora_rank is not None:
            rank = next((r for r in LORA_RANKS if r >= lora_rank), lora_rank)
            command += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
        # the worker's environment, less what VLLM_SETTINGS_REMOVED names, plus the plugin and no hub
        settings = [f"PYTHONPATH={PLUGIN}", f"VLLM_PLUGINS={PLUGIN_NAME}", "HF_HUB_OFFLINE=1",
                    "TOKENIZERS_PARALLELISM=false"]  # fmt: skip
        if not torch.cuda.is_available():
            settings.append("VLLM_CPU_KVCACHE_SPACE=1")  # GiB of KV cache on a CPU server
        removed = [option for name in VLLM_SETTINGS_REMOVED for option in ("-u", name)]
        command = ["env", *removed, *settings, *command]
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def client(self, timeout: float, key: bool = True) -> httpx.Client:
        """An HTTP client of the server, over its socket, sending its key (unless ``key`` is False: a test's)."""
        headers = {"Authorization": f"Bearer {self.key}"} if key else {}
        transport = httpx.HTTPTransport(uds=str(self.socket))
        return httpx.Client(transport=transport, base_url="http://vllm", headers=headers, timeout=timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RolloutEngineError(
                    f"the vLLM server exited with code {self.process.returncode} while starting: {self.cause()}"
                )
            try:
                with self.client(timeout=5) as client:
                    if client.get("/health").status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.close()
        raise RolloutEngineError(f"the vLLM server did not answer within {timeout:g} s: {self.cause()}")

    def exit_code(self) -> int | None:
        return self.process.poll()

    def cause(self) -> str:
        """The server's own last error (:func:`server_error`), else its log's last line, and where its log is."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                log = f.read().decode(errors="replace")
        except OSError:
            log = ""
        lines = log.strip().splitlines()
        said = server_error(log) or (LOG_PREFIX.sub("", lines[-1]).strip() if lines else "its log is empty")
        return f"{said} (the server's log: {self.log_path})"

    def close(self) -> None:
        """Stop the server's whole process group (its engine processes too, which outlive an API process that
        died), SIGTERM first, then SIGKILL what is left after 30 s."""
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break  # the group is gone
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.process.pid):
                self.process.poll()  # reaps the API process once it exits
                time.sleep(0.2)
        self.process.poll()
        shutil.rmtree(self.private, ignore_errors=True)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


class VllmSampler:
    """Samples a policy's responses on a vLLM server and keeps the server's weights the trainer's."""

    def __init__(
        self,
        model: PreTrainedModel,
        folder: Path,
        max_gap: float,
        *,
        url: str | None = None,
        server: VllmServer | None = None,
        stops_server: bool = True,
        skip_sync_at: int | None = None,
        lora: bool = False,
        request_timeout: float = 600.0,
    ) -> None:
        """On the job's own ``server`` (stopped at :meth:`close` when ``stops_server``), or on the operator's server
        at ``url``; ``folder``: the job's ``rollout/``."""
        self.model, self.folder, self.max_gap = model, folder, max_gap
        self.server, self.stops_server, self.skip_sync_at, self.lora = server, stops_server, skip_sync_at, lora
        if server is not None:
            self.url, self.client = server.url, server.client(request_timeout)
            self.files = server.folder
            """Where the weights and adapters the server loads are written: its folder, or the job's for an
            operator's server (which must see it at the same path)."""
        else:
            assert url is not None
            self.url, self.client = url, httpx.Client(base_url=url, timeout=request_timeout)
            self.files = folder
        self.served = self._served_model()
        """The name requests sample from: the base model, or the newest adapter."""
        self.synced: int | None = None
        """The optimizer steps the policy had taken when vLLM last got its weights (None: never)."""
        self.version = 0
        self.tag = secrets.token_hex(4)
        """In the adapters' names, so that jobs taking turns on an operator's server never share one."""
        self.probe: list[int] | None = None
        self.last: dict[str, float] = {}
        """The last sync's metrics, reported with the step that sampled after it."""

    def _served_model(self) -> str:
        models = self._request("GET", "/v1/models")["data"]
        return str(models[0]["id"])

    # -- HTTP ---------------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = self.client.request(method, path, json=body)
        except httpx.TimeoutException as e:
            raise RolloutEngineLost(f"the vLLM server at {self.url} did not answer {path}: {e}") from e
        except httpx.TransportError as e:
            died = ""
            if self.server is not None and (exit_code := self.server.exit_code()) is not None:
                died = f" (it exited with code {exit_code}: {self.server.cause()})"
            raise RolloutEngineLost(f"the vLLM server at {self.url} is gone{died}: {e}") from e
        if response.status_code >= 400:
            why = ""
            if response.status_code >= 500 and self.server is not None:  # its answer: "see the stack trace above"
                why = f"; the server's error: {self.server.cause()}"
            raise RolloutEngineError(
                f"the vLLM server refused {path} ({response.status_code}): {response.text[:500]}{why}"
            )
        if "json" not in response.headers.get("content-type", ""):
            return response.text  # the adapter endpoints answer in plain text
        return response.json()

    # -- sampling -----------------------------------------------------------------------------------------------

    def sample(
        self,
        updates: int,
        queries: torch.Tensor,
        query_mask: torch.Tensor,
        generator: torch.Generator,
        group_size: int,
        response_length: int,
        temperature: float,
        top_k: int,
        stop_token_ids: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``group_size`` responses to each query (B, P, left-padded) with vLLM's log-probs of them (at the
        temperature, after top-k): tokens and log-probs (B·G, T), as the built-in sampler gives them (a row that
        stopped ends with its stop token; what follows is junk for the caller to truncate). The weights are
        synced first if the policy took ``updates`` optimizer steps since the last sync. Each prompt is one request
        with its own seed, drawn from ``generator`` (so a resumed job samples alike)."""
        prompts = [q[m.bool()].tolist() for q, m in zip(queries.cpu(), query_mask.cpu(), strict=True)]
        if self.probe is None:
            self.probe = max(prompts, key=len)
        if self.synced != updates:
            self.sync(updates)
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator, device=generator.device).tolist()
        base = {"model": self.served, "n": group_size, "max_tokens": response_length, "temperature": temperature,
                "logprobs": 0, "return_token_ids": True, "stop_token_ids": list(stop_token_ids),
                "ignore_eos": True}  # fmt: skip
        if top_k > 0:
            base["top_k"] = top_k

        def complete(i: int) -> list[dict[str, Any]]:
            answer = self._request("POST", "/v1/completions", {**base, "prompt": prompts[i], "seed": seeds[i]})
            return sorted(answer["choices"], key=lambda c: c["index"])

        with ThreadPoolExecutor(max_workers=min(32, len(prompts))) as pool:  # vLLM batches them as they come
            choices = [c for answer in pool.map(complete, range(len(prompts))) for c in answer]
        longest = max(len(c["token_ids"]) for c in choices)
        tokens = torch.zeros(len(choices), longest, dtype=torch.long)
        logprobs = torch.zeros(len(choices), longest)
        for row, choice in enumerate(choices):
            ids = choice["token_ids"]
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[row, : len(ids)] = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float32)
        return tokens.to(queries.device), logprobs.to(queries.device)

    # -- weight sync and its check ------------------------------------------------------------------------------

    def sync(self, updates: int) -> None:
        """Push the policy's weights (after ``updates`` optimizer steps), then check vLLM samples from them. On the
        job's own server through rlhf's plugin (``/v1/rlhf/...``); on an operator's through vLLM's dev mode and
        runtime adapter loading, which the operator switched on."""
        t0 = time.perf_counter()
        if updates != self.skip_sync_at:
            if not self.lora:
                self._reload(self._weights_folder())
            else:
                if self.synced is None and self.server is None:  # an operator's server: another job's weights
                    self._reload(self.folder / "base")
                self._load_adapter()
            # cached prompts' keys and values are the old weights'
            self._request("POST", "/v1/rlhf/reset_prefix_cache" if self.server is not None else "/reset_prefix_cache")
        self.synced = updates
        seconds = time.perf_counter() - t0
        gap = self.check()
        self.last = {"rollout/sync_gap": gap, "rollout/sync_seconds": seconds}
        if gap > self.max_gap:
            raise RolloutOutOfSyncError(
                f"after the weight sync at optimizer step {updates}, vLLM's log-probs of the probe differ from the "
                f"trainer's by {gap:.3g} per token on average (rollout_sync_max_gap {self.max_gap:g}): the rollout "
                f"engine is not sampling the trained policy"
            )

    def _weights_folder(self) -> Path:
        """The policy's whole state dict as one safetensors file, every name in it: a tied output embedding too
        (``lm_head.weight``), which ``save_pretrained`` leaves out and vLLM's in-place reload (0.32) then keeps
        from before, so that the model samples with a stale head."""
        folder = self.files / "weights"
        folder.mkdir(parents=True, exist_ok=True)
        state = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in self.model.state_dict().items()}
        partial = folder / "model.safetensors.partial"
        save_file(state, str(partial), metadata={"format": "pt"})
        partial.replace(folder / "model.safetensors")
        return folder

    def _reload(self, folder: Path) -> None:
        if self.server is not None:  # the plugin reloads its own weights/ folder, the one written
            self._request("POST", "/v1/rlhf/reload_weights")
            return
        self._request("POST", "/collective_rpc", {"method": "reload_weights",
                                                  "kwargs": {"weights_path": str(folder)}})  # fmt: skip

    def _load_adapter(self) -> None:
        self.version += 1
        name = f"policy-{self.tag}-v{self.version}"
        folder = self.files / "adapters" / name
        self.model.save_pretrained(folder)
        if self.server is not None:  # the plugin loads adapters/<name> of its own folder
            self._request("POST", "/v1/rlhf/load_adapter", {"name": name})
        else:
            path = folder / "default" if (folder / "default").is_dir() else folder  # peft's folder per adapter
            self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        previous, self.served = self.served, name
        if previous.startswith("policy-"):
            self._unload_adapter(previous)

    def _unload_adapter(self, name: str) -> None:
        if self.server is not None:
            self._request("POST", "/v1/rlhf/unload_adapter", {"name": name})
        else:
            self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    @torch.inference_mode()
    def check(self) -> float:
        """Mean |vLLM's − trainer's| log-prob of the probe's tokens at temperature 1."""
        assert self.probe is not None
        answer = self._request("POST", "/v1/completions", {"model": self.served, "prompt": self.probe,
                                                           "max_tokens": 1, "temperature": 1.0,
                                                           "prompt_logprobs": 0})  # fmt: skip
        positions = answer["choices"][0]["prompt_logprobs"][1:]
        served = torch.tensor([p[str(t)]["logprob"] for p, t in zip(positions, self.probe[1:], strict=True)])
        ids = torch.tensor([self.probe], device=self.model.device)
        self.model.eval()
        trainer = token_logprobs(self.model, ids, torch.ones_like(ids), 1)[0][0].float().cpu()
        return float((served - trainer).abs().mean())

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    def close(self) -> None:
        """Stop the server the job started; on a server that outlives the job, unload the job's adapter."""
        try:
            if not (self.server is not None and self.stops_server) and self.served.startswith("policy-"):
                self._unload_adapter(self.served)
        except (RolloutEngineError, RolloutEngineLost):
            pass  # the server's own trouble; the job's result stands
        finally:
            self.client.close()
            if self.server is not None and self.stops_server:
                self.server.close()


def start_sampler(
    settings: VllmSettings,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    folder: Path,
    max_model_len: int,
    max_gap: float,
    lora_rank: int | None,
    base_state: dict[str, torch.Tensor] | None,
) -> VllmSampler:
    """A :class:`VllmSampler` of ``model`` on the operator's server, or on one started for the job from the
    operator's vLLM environment with the policy's starting weights (``base_state``: a LoRA policy's base weights,
    under the base model's names) saved in ``folder/base``."""
    base = folder / "base"  # what a started server loads, and what an operator's server reloads under adapters
    if lora_rank is not None:
        model.get_base_model().save_pretrained(base, state_dict=base_state)  # type: ignore[operator]
        tokenizer.save_pretrained(base)
    elif settings.url is None and settings.server is None:
        model.save_pretrained(base)
        tokenizer.save_pretrained(base)
    options: dict[str, Any] = {"skip_sync_at": settings.skip_sync_at, "lora": lora_rank is not None}
    if settings.server is not None:  # the tests' hook: a server of theirs, shared by their jobs
        assert isinstance(settings.server, VllmServer)
        return VllmSampler(model, folder, max_gap, server=settings.server, stops_server=False, **options)
    if settings.url is not None:
        return VllmSampler(model, folder, max_gap, url=settings.url, **options)
    assert settings.python is not None
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    server = VllmServer(settings.python, base, max_model_len, dtype, lora_rank, folder / "vllm.log")
    try:
        server.wait_ready(settings.start_timeout)
        return VllmSampler(model, folder, max_gap, server=server, **options)
    except BaseException:
        server.close()
        raise
