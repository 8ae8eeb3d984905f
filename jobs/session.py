"""A training session on a train worker: the models the client's loop trains live in this process while the client
does; its requests (stored by the API, jobs/store/sessions.py) run one at a time, each model's in the ``seq_id``
order the SDK gives them, and their results go back to the database for the client's ``retrieve_future``.

A session ends when its client closes it (``succeeded``, or as the client says), when it is cancelled (a request in
progress is interrupted between decoding steps), or, ``cancelled`` with an error code that says why, when its
heartbeats stop for ``session_timeout_seconds`` (``session_abandoned``), when it sent no request for
``session_idle_seconds`` (``session_idle``) or held its worker for ``session_max_seconds`` (``session_expired``):
then each model's state is saved first, as ``tinker://<model>/weights/ended-<step>``. Its saved weights stay. A
session whose first model cannot be loaded ends ``failed`` with the reason: a worker is held only for a model it
holds. A request's bad input fails that request (category ``user``), never the session.
A worker lost mid-session loses its models: the recovery fails their requests (category ``server``), the job is
queued again, and the next worker serves new training clients made from saved states."""

import json
import logging
import math
import shutil
import time
from collections import OrderedDict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.orm import Session
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.core.checkpoint import list_checkpoints, save_checkpoint
from engine.core.generate import Interrupted
from engine.core.models import ModelNotFoundError, context_length, load_causal_lm, load_tokenizer, pick_device
from engine.session.errors import UserError
from engine.session.losses import find_loss
from engine.session.models import Lora, TrainingModel
from engine.session.sampler import SamplingParams, check_prompt, check_work, sample
from engine.session.wire import decode_datums, encode_forward_backward_output, encode_sample_response, loss_config
from engine.spec.tinker_proto import TooLarge, parse_stored
from jobs.runner import DbCallbacks, Ending, Outcome, cancelled, failed, handed_back, in_transaction
from jobs.store import crud, sessions
from jobs.store.models import ACTIVE_STATUSES, SessionModel, SessionRequest, TrainingSession, utcnow
from jobs.store.settings import SESSION_BOUNDS, Settings

log = logging.getLogger(__name__)

POLL_S = (0.002, 0.05)
"""The first and the longest pause between two looks for new requests."""
SESSION_CHECK_S = 1.0
"""How often the session's heartbeat and finish are read, and a running request's cancel."""
SAMPLERS_KEPT = 2
"""Sampler weights kept loaded (the least recently used are let go)."""
LOST = (
    "this model's worker was lost and the model with it; create a training client from your last saved state "
    "(create_training_client_from_state) to continue"
)


class SessionWorker:
    """Runs one session's requests until the session ends."""

    def __init__(self, job_id: str, settings: Settings, out_dir: Path, callbacks: DbCallbacks) -> None:
        self.job_id, self.settings, self.out_dir, self.callbacks = job_id, settings, out_dir, callbacks
        self.url = settings.resolved_database_url
        self.artifacts = settings.resolved_artifacts_dir
        self.device = pick_device()
        self.models: dict[str, TrainingModel] = {}
        self.next_seq: dict[str, int] = {}
        """The next seq_id of each model this worker holds."""
        self.samplers: OrderedDict[str, tuple[PreTrainedModel, PreTrainedTokenizerBase]] = OrderedDict()
        self.gathered: dict[str, float] = {}
        """Metrics of the forward/backward passes since the last optimizer step (summed)."""
        job = in_transaction(self.url, lambda s: crud.get_job(s, job_id=job_id))
        assert job is not None
        self.step = job.step
        """Optimizer steps of the session (all its models): the step of its metrics."""
        self.saves = max((step for step, _ in list_checkpoints(out_dir)), default=0)
        """Sampler weights saved so far: each is the session job's checkpoint of the next number."""
        self.started = _aware(job.started_at or utcnow())
        """When a worker first took the session (its lifetime counts from there)."""
        self.active_at = time.monotonic()
        """When this worker last ran a request, or took the session (its idle time counts from there)."""
        self.has_pending = False
        """Whether the session had requests waiting at the last look."""
        self.ending: Ending | None = None
        """How the session ends, once a request decided it (its first model could not be loaded)."""
        self.request_checked = 0.0
        """When the running request's own status was last read (its client may have cancelled it)."""

    # --- the loop ---------------------------------------------------------------------------------

    def run(self) -> Ending:
        pause, checked = POLL_S[0], 0.0
        while True:
            stop = self.callbacks.should_stop()
            if stop is not None:
                return self._stopped(stop)
            if time.monotonic() - checked > SESSION_CHECK_S:
                checked = time.monotonic()
                if (ending := self._ended()) is not None:
                    return ending
            request = self._next_request()
            if request is None:
                time.sleep(pause)
                pause = min(pause * 1.5, POLL_S[1])
                continue
            pause = POLL_S[0]
            self._run(request)
            self.active_at = time.monotonic()
            if self.ending is not None:
                return self.ending

    def _ended(self) -> Ending | None:
        """The session's ending once its client closed it or stopped beating, or it was idle or lived too long."""

        def read(session: Session) -> tuple[str | None, float]:
            row = session.get(TrainingSession, self.job_id)
            assert row is not None
            return row.finish_reason, (utcnow() - _aware(row.heartbeat_at)).total_seconds()

        reason, silent_s = in_transaction(self.url, read)
        idle_s, lived_s = time.monotonic() - self.active_at, (utcnow() - self.started).total_seconds()
        if reason is not None:
            why = f"closed by its client ({reason})"
            self._fail_unfinished(f"the session ended: {why}", "user")
            if reason == "errored":
                return failed("client_error", "the client closed the session as errored"), ("error", why, {})
            if reason == "interrupted":
                return cancelled(), ("info", f"session {why}", {})
            values: dict[str, Any] = {"output_step": self.saves or None, "finished_at": utcnow()}
            outcomes: list[Outcome] = [(ACTIVE_STATUSES, "succeeded", values)]
            return outcomes, ("info", f"session {why}", {"step": self.step, "sampler_checkpoints": self.saves})
        if silent_s > self.settings.session_timeout_seconds:
            return self._end(sessions.ABANDONED, sessions.abandoned_message(silent_s))
        idle, lifetime = self.settings.session_idle_seconds, self.settings.session_max_seconds
        if idle and idle_s > idle and not self.has_pending:
            return self._end("session_idle", f"no request for {idle_s:.0f} s (RLHF_SESSION_IDLE_SECONDS is {idle})")
        if lifetime and lived_s > lifetime:
            return self._end(
                "session_expired",
                f"the session held its train worker for {lived_s:.0f} s (RLHF_SESSION_MAX_SECONDS is {lifetime})",
            )
        return None

    def _end(self, code: str, why: str) -> Ending:
        """End the session without its client: each model's state saved first (``weights/ended-<step>``, for
        ``create_training_client_from_state``), then ``cancelled`` with ``code`` and ``why``."""
        paths = [self._save_state(target, f"ended-{self.step}", overwrite=True) for target in list(self.models)]
        message = why + (f"; its models' state was saved: {', '.join(paths)}" if paths else "")
        self._fail_unfinished(f"the session ended: {message}", "user")
        values = {"error_code": code, "error_message": message, "finished_at": utcnow()}
        return [(ACTIVE_STATUSES, "cancelled", values)], (
            "info",
            f"session ended: {message}",
            {"code": code, "saved": paths},
        )

    def _stopped(self, stop: str) -> Ending:
        if stop == "cancel":
            self._fail_unfinished("the session was cancelled", "user")
            return cancelled(), None
        # this worker is shutting down (a pause, which sessions do not take, ends the same way): the models go
        self._fail_unfinished(LOST, "server")
        return handed_back(), (
            "info",
            f"{self.callbacks.worker} is shutting down: the session's models were let go",
            {},
        )

    def _fail_unfinished(self, error: str, category: str) -> None:
        in_transaction(self.url, lambda s: sessions.fail_unfinished(s, session_id=self.job_id, error=error,
                                                                    category=category))  # fmt: skip

    def _next_request(self) -> SessionRequest | None:
        """The oldest pending request whose turn it is: a model's next ``seq_id`` (a model this worker does not hold
        fails at once), or any sample."""
        pending = in_transaction(self.url, lambda s: sessions.pending_requests(s, session_id=self.job_id))
        self.has_pending = bool(pending)
        for request in pending:
            if request.kind == "sample" or request.kind == "create_model":
                return request
            if request.target not in self.next_seq:
                self._finish(request, error=(LOST, "server"))
                continue
            if request.seq_id == self.next_seq[request.target]:
                return request
        return None

    # --- one request ------------------------------------------------------------------------------

    def _run(self, request: SessionRequest) -> None:
        if not in_transaction(self.url, lambda s: sessions.start_request(s, request_id=request.id)):
            return  # failed meanwhile (the session is ending)
        started = time.perf_counter()
        try:
            result, result_format = getattr(self, f"_{request.kind}")(request)
        except Interrupted:
            self._finish(request, error=self._interruption())
        except UserError as e:
            self._finish(request, error=(str(e), "user"))
        except (ModelNotFoundError, ValueError) as e:
            self._finish(request, error=(f"{type(e).__name__}: {e}", "user"))
            if request.kind == "create_model":
                self._unloadable(e)
        except Exception as e:  # the request fails, the session goes on
            log.exception("session %s: %s %s failed", self.job_id, request.kind, request.id)
            self._finish(request, error=(f"{type(e).__name__}: {e}"[:2000], "server"))
        else:
            self._finish(request, result=(result, result_format))
        finally:
            if request.target in self.next_seq:
                self.next_seq[request.target] = max(self.next_seq[request.target], request.seq_id + 1)
        log.debug("session %s: %s in %.3f s", self.job_id, request.kind, time.perf_counter() - started)

    def _unloadable(self, error: Exception) -> None:
        """A model that could not be loaded, in a session that holds nothing else: the session ends ``failed`` with
        the reason, and frees its worker."""

        def holds_anything(session: Session) -> bool:
            samplers = sessions.samplers_of(session, session_id=self.job_id)
            return bool(samplers) or any(
                request.kind != "sample" for request in sessions.pending_requests(session, session_id=self.job_id)
            )

        if self.models:
            return
        if in_transaction(self.url, holds_anything):
            return
        code = "model_not_found" if isinstance(error, ModelNotFoundError) else "invalid_model"
        message = f"its model could not be loaded: {error}"
        self._fail_unfinished(f"the session ended: {message}", "user")
        self.ending = failed(code, message), ("error", message, {"code": code})

    def _interrupted(self, request: SessionRequest) -> bool:
        """Whether a request in progress is to stop: its session is cancelled, its worker is shutting down, or its
        client cancelled it (``cancel_future``); read at most every :data:`SESSION_CHECK_S`."""
        if self.callbacks.should_stop() is not None:
            return True
        if time.monotonic() - self.request_checked < SESSION_CHECK_S:
            return False
        self.request_checked = time.monotonic()
        return in_transaction(self.url, lambda s: sessions.request_status(s, request_id=request.id)) != "running"

    def _interruption(self) -> tuple[str, str]:
        """The error of an interrupted request: why it stopped, and whose it is."""
        stop = self.callbacks.should_stop()
        if stop == "cancel":
            return "the session was cancelled while the request ran", "user"
        if stop is not None:
            return LOST, "server"
        return "cancelled by the client", "user"

    def _finish(self, request: SessionRequest, result: tuple[bytes, str] | None = None,
                error: tuple[str, str] | None = None) -> None:  # fmt: skip
        def write(session: Session) -> None:
            if result is not None:
                sessions.complete_request(session, request_id=request.id, result=result[0], result_format=result[1])
            else:
                assert error is not None
                sessions.fail_request(session, request_id=request.id, error=error[0], category=error[1])
            sessions.touch_model(session, model_id=request.target)

        in_transaction(self.url, write)

    def _model(self, request: SessionRequest) -> TrainingModel:
        return self.models[request.target]

    # --- the operations: each returns (result, "json" | "proto") --------------------------------------

    def _create_model(self, request: SessionRequest) -> tuple[bytes, str]:
        """A new model: from the base model (``create_model``), or from saved training weights (the SDK's
        ``create_training_client_from_state``, a ``load_weights`` with a session)."""
        body = json.loads(request.payload)
        lora_config = body.get("lora_config", body.get("lora"))
        lora = Lora.of(lora_config) if lora_config else None
        model = TrainingModel(body["resolved"], lora, self.device)
        if "folder" in body:
            model.load_state(self.artifacts / body["folder"], optimizer=body["optimizer"])
        self.models[request.target], self.next_seq[request.target] = model, 1
        tokenizer_dir = self.out_dir / "tokenizers" / request.target.rsplit(":", 1)[-1]
        model.tokenizer.save_pretrained(tokenizer_dir)
        info = {**model.info(), "tokenizer_id": str(tokenizer_dir)}
        in_transaction(self.url, lambda s: sessions.set_model_info(s, model_id=request.target, info=info))
        self.callbacks.on_event("info", f"model {request.target} ready", {"model_id": request.target, **model.info()})
        if "folder" in body:
            return _json({"model_id": request.target, "path": body["path"], "type": "load_weights"}), "json"
        return _json({"model_id": request.target, "type": "create_model"}), "json"

    def _forward(self, request: SessionRequest) -> tuple[bytes, str]:
        return self._forward_backward(request)

    def _forward_backward(self, request: SessionRequest) -> tuple[bytes, str]:
        """The stored body decompressed, its input names and dense elements checked before any tensor is made."""
        try:
            message = parse_stored(request.payload, max_bytes=self.settings.session_max_body_bytes)
            loss = find_loss(message.loss_fn)
            datums = decode_datums(message, budget=self.settings.session_budget, inputs=loss.required + loss.optional)
        except TooLarge as e:
            raise UserError(f"{e} ({SESSION_BOUNDS[e.bound]})") from None
        backward, config = request.kind == "forward_backward", loss_config(message)
        outputs, metrics = self._model(request).forward_backward(datums, message.loss_fn, config, backward=backward)
        if backward:
            for name, value in metrics.items():
                self.gathered[name] = self.gathered.get(name, 0.0) + value
        return encode_forward_backward_output(outputs, metrics), "proto"

    def _optim_step(self, request: SessionRequest) -> tuple[bytes, str]:
        adam = json.loads(request.payload)["adam_params"]
        metrics = self._model(request).optim_step(**adam)
        self.step += 1
        recorded = {f"train/{name.replace(':', '_')}": value for name, value in self.gathered.items()}
        recorded.update({f"train/{name}": value for name, value in metrics.items()})
        self.callbacks.on_metrics(self.step, {k: v for k, v in recorded.items() if math.isfinite(v)})
        self.gathered = {}
        return _json({"metrics": metrics, "type": "optim_step"}), "json"

    def _save_weights(self, request: SessionRequest) -> tuple[bytes, str]:
        body = json.loads(request.payload)
        path = self._save_state(request.target, body["path"], overwrite=bool(body.get("overwrite")))
        return _json({"path": path, "type": "save_weights"}), "json"

    def _save_state(self, target: str, name: str, overwrite: bool) -> str:
        """Model ``target``'s weights and optimizer state saved as ``name``; its ``tinker://`` path."""
        folder = self.out_dir / "weights" / target.rsplit(":", 1)[-1] / name
        if folder.exists() and not overwrite:
            raise UserError(f"path: weights named {name!r} were saved already; pick another name or pass overwrite")
        size = self.models[target].save_state(folder)
        return self._record(target, "weights", name, folder, None, size)

    def _save_weights_external(self, request: SessionRequest) -> tuple[bytes, str]:
        """The model as a Hugging Face folder (LoRA: its PEFT adapter), ``external_weights/<name>`` of the session's
        folder, written aside and then put in place of an earlier save of that name."""
        name = json.loads(request.payload)["path"]
        models = self.out_dir / "external_weights" / request.target.rsplit(":", 1)[-1]
        written = self.out_dir / "tmp" / f"external-{request.id}"
        shutil.rmtree(written, ignore_errors=True)

        def base_model(session: Session) -> str:
            row = session.get(SessionModel, request.target)
            assert row is not None
            return row.base_model

        try:
            size = self._model(request).save_external(written, in_transaction(self.url, base_model))
        except BaseException:
            shutil.rmtree(written, ignore_errors=True)
            raise
        models.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(models / name, ignore_errors=True)
        written.rename(models / name)
        path = self._record(request.target, "external_weights", name, models / name, None, size)
        return _json({"path": path, "size_bytes": size, "type": "save_weights_external"}), "json"

    def _save_weights_for_sampler(self, request: SessionRequest) -> tuple[bytes, str]:
        """Sampler weights: the model as a Hugging Face folder, the session job's next checkpoint (served by the
        OpenAI endpoints and ``generate``, and a ``job:<session>@<n>`` model for any later job)."""
        body = json.loads(request.payload)
        model = self._model(request)
        step = self.saves + 1
        name = body.get("path") or f"sampler-{step}"
        checkpoint = save_checkpoint(self.out_dir, step, {"policy": model.model}, model.tokenizer,
                                     {"model_id": request.target, "name": name}, keep=2**31)  # fmt: skip
        self.saves = step
        self.callbacks.on_checkpoint(step, checkpoint, {"optim_step": float(self.step)})
        size = sum(file.stat().st_size for file in (checkpoint / "policy").rglob("*") if file.is_file())
        path = self._record(request.target, "sampler_weights", name, checkpoint / "policy", step, size)
        sampler = body.get("sampler_id")
        if sampler is not None:
            folder = (checkpoint / "policy").relative_to(self.artifacts).as_posix()
            in_transaction(self.url, lambda s: sessions.set_sampler_folder(s, sampler_id=sampler, folder=folder,
                                                                           model_path=path))  # fmt: skip
        return _json({"path": path, "sampling_session_id": sampler, "type": "save_weights_for_sampler"}), "json"

    def _record(self, target: str, kind: str, name: str, folder: Path, step: int | None, size: int) -> str:
        relative = folder.relative_to(self.artifacts).as_posix()

        def write(session: Session) -> None:
            job = crud.get_job(session, job_id=self.job_id)
            assert job is not None
            sessions.add_checkpoint(
                session,
                session_id=self.job_id,
                project_id=job.project_id,
                model_id=target,
                kind=kind,
                name=name,
                path=relative,
                step=step,
                size_bytes=size,
            )

        in_transaction(self.url, write)
        return f"tinker://{target}/{kind}/{name}"

    def _load_weights(self, request: SessionRequest) -> tuple[bytes, str]:
        body = json.loads(request.payload)
        self._model(request).load_state(self.artifacts / body["folder"], optimizer=body["optimizer"])
        return _json({"model_id": request.target, "path": body["path"], "type": "load_weights"}), "json"

    def _sample(self, request: SessionRequest) -> tuple[bytes, str]:
        body = json.loads(request.payload)
        model, tokenizer = self._sampler(request.target)
        prompt = _prompt_tokens(body["prompt"])
        params = SamplingParams(**_sampling_params(body["sampling_params"]))
        vocab = int(model.get_output_embeddings().weight.shape[0])
        check_prompt(prompt, params, vocab, context_length(model))
        check_work(prompt, params, body["num_samples"], context_length(model), self.settings.session_max_sample_tokens)
        self.request_checked = time.monotonic()
        sequences, prompt_logprobs = sample(
            model,
            tokenizer,
            prompt,
            body["num_samples"],
            params,
            prompt_logprobs=body.get("prompt_logprobs", False),
            stop=lambda: self._interrupted(request),
        )
        return encode_sample_response(sequences, prompt_logprobs), "proto"

    def _sampler(self, sampler_id: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        row = in_transaction(self.url, lambda s: sessions.get_sampler(s, sampler_id=sampler_id))
        if row is None or row.folder is None:
            raise UserError(f"sampling session {sampler_id} has no weights to sample from yet")
        ref = row.folder if row.model_path is None else str(self.artifacts / row.folder)
        if ref not in self.samplers:
            tokenizer = load_tokenizer(ref)
            model = load_causal_lm(ref, tokenizer, seed=0)
            model.to(self.device)  # type: ignore[arg-type]
            model.eval()
            self.samplers[ref] = (model, tokenizer)
            while len(self.samplers) > SAMPLERS_KEPT:
                self.samplers.popitem(last=False)
        self.samplers.move_to_end(ref)
        return self.samplers[ref]


def _aware(when: datetime) -> datetime:
    """A time read back from the database, with its UTC zone (SQLite keeps none)."""
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _prompt_tokens(prompt: dict[str, Any]) -> list[int]:
    """The tokens of a ``ModelInput``'s chunks (text chunks only)."""
    tokens: list[int] = []
    for i, chunk in enumerate(prompt.get("chunks", [])):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"prompt.chunks[{i}]: {chunk.get('type')} chunks are not supported by this server")
        tokens.extend(int(token) for token in chunk.get("tokens", []))
    return tokens


def _sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    known = ("max_tokens", "temperature", "top_k", "top_p", "stop", "seed")
    return {key: params[key] for key in known if key in params}


def _json(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()


def run_session(job_id: str, settings: Settings, out_dir: Path, callbacks: DbCallbacks) -> Ending:
    """Serve session ``job_id`` on this worker until it ends."""
    worker = SessionWorker(job_id, settings, out_dir, callbacks)
    try:
        return worker.run()
    finally:
        worker.models.clear()
        worker.samplers.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
