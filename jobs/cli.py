"""The ``rlhf`` command.

Server:  rlhf serve | rlhf api | rlhf worker --queues train | rlhf db upgrade | rlhf keys create
Client:  rlhf submit SPEC | rlhf jobs list|get|cancel|pause|resume | rlhf logs JOB --follow | rlhf generate JOB PROMPT
Local:   rlhf train SPEC --out DIR | rlhf generate --model DIR --prompt TEXT | rlhf demo [--local]
"""

import argparse
import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from engine import cli as engine_cli
from jobs.client import KEY_FILE, SERVER_FILE, Client, ClientError
from jobs.store import bootstrap, crud
from jobs.store.db import session_scope
from jobs.store.settings import Settings, get_settings

log = logging.getLogger("rlhf")


# --- server ------------------------------------------------------------------------------------


def upgrade_database(settings: Settings) -> None:
    from jobs.store.migrate import upgrade

    settings.prepare_data_dir()
    upgrade(settings.resolved_database_url)


def ensure_key_file(settings: Settings) -> None:
    """First start: create the ``default`` project and a key, written to ``data_dir/api-key`` (mode 0600)."""
    key_file = settings.data_dir / KEY_FILE
    if key_file.exists():
        with session_scope(settings.resolved_database_url) as session:
            if crud.project_for_key(session, key=key_file.read_text().strip()):
                return
    key = bootstrap.create_key(settings, bootstrap.DEFAULT_PROJECT)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    log.info("a new API key for project %r is in %s", bootstrap.DEFAULT_PROJECT, key_file)


def orphaned_jobs_to_queue(settings: Settings) -> None:
    """Embedded mode owns every worker: jobs left running by a previous run expire now and get requeued."""
    from sqlalchemy import update

    from jobs.store.models import ACTIVE_STATUSES, Job, utcnow

    with session_scope(settings.resolved_database_url) as session:
        session.execute(update(Job).where(Job.status.in_(ACTIVE_STATUSES)).values(lease_until=utcnow()))


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_address(host: str, allow_remote: bool) -> None:
    """Refuse to listen beyond this machine unless explicitly allowed (``--allow-remote`` or
    ``RLHF_ALLOW_REMOTE=true``). Every request needs an API key either way: this is about opting in."""
    if is_loopback(host) or allow_remote:
        return
    raise SystemExit(
        f"error: refusing to listen on {host!r}: it is not a loopback address, so other machines could reach the "
        "API. Pass --allow-remote (or set RLHF_ALLOW_REMOTE=true) to allow it, or use --host 127.0.0.1."
    )


def cmd_serve(args: argparse.Namespace) -> None:
    data_dir = args.data_dir.resolve()
    os.environ["RLHF_DATA_DIR"] = str(data_dir)
    get_settings.cache_clear()
    settings = get_settings()
    allow_remote = args.allow_remote or settings.allow_remote
    check_bind_address(args.host, allow_remote)
    upgrade_database(settings)
    ensure_key_file(settings)
    orphaned_jobs_to_queue(settings)
    url = f"http://{args.host}:{args.port}"
    env = {**os.environ, "RLHF_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    commands = {
        "api": [sys.executable, "-m", "jobs.cli", "api", "--host", args.host, "--port", str(args.port)]
        + (["--allow-remote"] if allow_remote else []),
        "train worker": [sys.executable, "-m", "jobs.cli", "worker", "--queues", "train"],
        "inference worker": [sys.executable, "-m", "jobs.cli", "worker", "--queues", "inference"],
    }
    children = {name: subprocess.Popen(cmd, env=env) for name, cmd in commands.items()}
    server_file = data_dir / SERVER_FILE
    server_file.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    print(f"rlhf serving at {url} (data in {data_dir}; API key in {data_dir / KEY_FILE}); Ctrl-C stops", flush=True)

    stopping = False

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        while not stopping:
            for name, child in children.items():
                if child.poll() is not None and not stopping:
                    print(f"{name} exited with {child.returncode}; restarting it", file=sys.stderr, flush=True)
                    children[name] = subprocess.Popen(commands[name], env=env)
            time.sleep(0.5)
    finally:
        for child in children.values():
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + 10
        for child in children.values():
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
        server_file.unlink(missing_ok=True)
        print("rlhf stopped", flush=True)


def cmd_api(args: argparse.Namespace) -> None:
    import uvicorn

    settings = get_settings()
    check_bind_address(args.host, args.allow_remote or settings.allow_remote)
    settings.check()
    settings.prepare_data_dir()
    uvicorn.run("api.main:app", host=args.host, port=args.port, log_level="warning")


def cmd_worker(args: argparse.Namespace) -> None:
    from jobs.worker import start_worker

    settings = get_settings()
    settings.check()
    start_worker(args.queues.split(","), settings)


def cmd_db_upgrade(args: argparse.Namespace) -> None:
    upgrade_database(get_settings())
    print("database at the newest revision")


def cmd_keys_create(args: argparse.Namespace) -> None:
    print(json.dumps({"project": args.project, "api_key": bootstrap.create_key(get_settings(), args.project)}))


# --- client ------------------------------------------------------------------------------------


def client(args: argparse.Namespace) -> Client:
    return Client.discover(get_settings(), args.url, args.api_key)


def cmd_submit(args: argparse.Namespace) -> None:
    spec = engine_cli.read_spec(args.spec)
    engine_cli.parse_spec(spec, str(args.spec))  # the same validation the server does, before any upload
    job = client(args).create_job(spec, args.idempotency_key)
    print(json.dumps(job))
    if args.follow:
        follow(client(args), job["id"])


def cmd_jobs(args: argparse.Namespace) -> None:
    c = client(args)
    if args.action == "list":
        params = {k: v for k, v in (("status", args.status), ("type", args.type), ("limit", args.limit)) if v}
        for job in c.request("GET", "/v1/jobs", params=params)["data"]:
            print(f"{job['id']}  {job['type']:<4} {job['status']:<10} step {job['step']}/{job['total_steps'] or '?'}")
        return
    if args.job is None:
        raise SystemExit(f"rlhf jobs {args.action} needs a job id")
    if args.action == "get":
        print(json.dumps(c.get_job(args.job), indent=2))
    else:
        print(json.dumps(c.request("POST", f"/v1/jobs/{args.job}/{args.action}")))


def follow(c: Client, job_id: str, label: str | None = None) -> dict[str, Any]:
    """Live progress bar and key metrics of a job from its SSE stream, until it ends; returns the job."""
    job = c.get_job(job_id)
    bar = engine_cli.ProgressBar(job["type"], label or job.get("name") or job_id)
    started = False
    try:
        for message in c.stream(job_id):
            if message.event in ("metrics", "status") and not started:
                total = c.get_job(job_id)["total_steps"]
                if total:
                    bar.on_start(0, total)
                    started = True
            if message.event == "metrics" and started:
                bar.on_metrics(message.data["step"], message.data["metrics"])
            elif message.event == "event" and message.data["kind"] in ("warning", "error"):
                bar.on_event(message.data["kind"], message.data["message"])
    finally:
        bar.close()
    job = c.get_job(job_id)
    error = f" ({job['error']['code']}: {job['error']['message']})" if job.get("error") else ""
    print(f"{bar.label}: {job['status']} at step {job['step']}{error}", flush=True)
    return job


def cmd_logs(args: argparse.Namespace) -> None:
    c = client(args)
    if args.follow:
        follow(c, args.job)
        return
    for event in c.request("GET", f"/v1/jobs/{args.job}/events", params={"limit": 100})["data"]:
        print(f"{event['created_at']}  {event['kind']:<10} {event['message']}")


def cmd_generate(args: argparse.Namespace) -> None:
    if args.model:  # local: a job folder, checkpoint or model, no server
        if not args.prompt:
            raise SystemExit("rlhf generate --model DIR needs --prompt TEXT")
        engine_cli.cmd_generate(args)
        return
    if args.job is None or not (args.prompt or args.prompt_text):
        raise SystemExit("usage: rlhf generate JOB PROMPT [--checkpoint N], or rlhf generate --model DIR --prompt TEXT")
    body = {
        "prompts": (args.prompt or []) + ([args.prompt_text] if args.prompt_text else []),
        "checkpoint": args.checkpoint,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "score": args.score,
    }
    result = client(args).request("POST", f"/v1/jobs/{args.job}/generate", json=body)
    for completion in result["completions"]:
        print(json.dumps({"checkpoint": result["checkpoint"], **completion}))


def cmd_demo(args: argparse.Namespace) -> None:
    if args.local:
        engine_cli.cmd_demo(args)
        return
    from jobs.demo import run_http_demo

    run_http_demo(args.data_dir, args.port)


# --- parser ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="Train language models from human feedback.")
    sub = parser.add_subparsers(dest="command", required=True)

    def client_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--url", help="server URL (default: RLHF_URL, or the embedded server's)")
        p.add_argument("--api-key", help="API key (default: RLHF_API_KEY, or the embedded server's key file)")
        return p

    def bind_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
        p.add_argument("--port", type=int, default=8000)
        p.add_argument(
            "--allow-remote",
            action="store_true",
            help="allow a non-loopback --host such as 0.0.0.0 (also RLHF_ALLOW_REMOTE=true)",
        )

    p = sub.add_parser("serve", help="embedded server: SQLite database and broker, API, train and inference worker")
    bind_args(p)
    p.add_argument("--data-dir", type=Path, default=Path("rlhf-data"))
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("api", help="the HTTP API alone (production: behind a proxy)")
    bind_args(p)
    p.set_defaults(func=cmd_api)

    p = sub.add_parser("worker", help="a Celery worker: --queues train (one per GPU), a train queue, or inference")
    p.add_argument(
        "--queues", default="train", help="comma-separated: train, inference, or a train queue named by resources.queue"
    )
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("db", help="database maintenance")
    p.add_argument("action", choices=["upgrade"])
    p.set_defaults(func=cmd_db_upgrade)

    p = sub.add_parser("keys", help="API keys")
    p.add_argument("action", choices=["create"])
    p.add_argument("--project", default="default", help="project name; a new name creates a new project")
    p.set_defaults(func=cmd_keys_create)

    p = client_args(sub.add_parser("submit", help="submit a job spec to the server"))
    p.add_argument("spec", type=Path)
    p.add_argument("--idempotency-key")
    p.add_argument("--follow", action="store_true", help="then show its progress until it ends")
    p.set_defaults(func=cmd_submit)

    p = client_args(sub.add_parser("jobs", help="list, inspect, cancel, pause or resume jobs"))
    p.add_argument("action", choices=["list", "get", "cancel", "pause", "resume"])
    p.add_argument("job", nargs="?")
    p.add_argument("--status")
    p.add_argument("--type")
    p.add_argument("--limit", type=int)
    p.set_defaults(func=cmd_jobs)

    p = client_args(sub.add_parser("logs", help="a job's events, or its live progress with --follow"))
    p.add_argument("job")
    p.add_argument("--follow", action="store_true")
    p.set_defaults(func=cmd_logs)

    p = client_args(sub.add_parser("generate", help="sample from a job's checkpoint (server) or a folder (--model)"))
    p.add_argument("job", nargs="?", help="job id (server)")
    p.add_argument("prompt_text", nargs="?", metavar="PROMPT")
    p.add_argument("--prompt", action="append", help="prompt text; repeat for several")
    p.add_argument("--model", help="local job folder, checkpoint folder, model folder or hub id (no server)")
    p.add_argument("--checkpoint", default="latest", type=lambda s: s if s == "latest" else int(s))
    p.add_argument("--score", action="store_true", help="add reward-model scores (PPO jobs)")
    engine_cli.add_sampling_arguments(p)
    p.set_defaults(func=cmd_generate)

    engine_cli.add_train_command(sub)

    p = engine_cli.add_demo_command(sub)
    p.add_argument("--local", action="store_true", help="train in this process, without the server")
    p.add_argument("--data-dir", type=Path, default=Path("runs/demo-server"), help="the demo server's data folder")
    p.add_argument("--port", type=int, default=8765)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress bars
    args = build_parser().parse_args(argv)
    try:
        engine_cli.run_command(args)
    except ClientError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
