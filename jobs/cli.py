"""The ``rlhf`` command: its arguments, and which module runs each command.

Server:  rlhf serve | rlhf api | rlhf worker --queues train | rlhf db upgrade | rlhf keys create
Client:  rlhf submit SPEC|PIPELINE | rlhf jobs list|get|cancel|pause|resume | rlhf logs JOB --follow
         rlhf generate JOB PROMPT | rlhf download JOB[@STEP] [-o DIR]
Local:   rlhf train SPEC --out DIR | rlhf generate --model DIR --prompt TEXT | rlhf demo [--local]

The processes of ``rlhf serve`` are supervised by jobs/supervisor.py, the database and keys prepared by
jobs/store/bootstrap.py; the client commands are in jobs/client.py, the local ones in engine/cli.py, and the
demo through the server in jobs/demo.py.
"""

import argparse
import ipaddress
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from engine import cli as engine_cli
from engine.tracking import quiet_environment
from jobs import client, supervisor
from jobs.client import KEY_FILE, ClientError
from jobs.store import bootstrap
from jobs.store.settings import InvalidSettings, get_settings

# --- server ------------------------------------------------------------------------------------


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
    bootstrap.upgrade_database(settings)
    bootstrap.ensure_key_file(settings, data_dir / KEY_FILE)
    bootstrap.orphaned_jobs_to_queue(settings)
    supervisor.serve(data_dir, host=args.host, port=args.port, allow_remote=allow_remote)


def cmd_api(args: argparse.Namespace) -> None:
    from api import server

    settings = get_settings()
    check_bind_address(args.host, args.allow_remote or settings.allow_remote)
    settings.check()
    settings.prepare_data_dir()
    server.run(args.host, args.port)


def cmd_worker(args: argparse.Namespace) -> None:
    from jobs.worker import start_worker

    settings = get_settings()
    settings.check()
    start_worker(args.queues.split(","), settings)


def cmd_db_upgrade(args: argparse.Namespace) -> None:
    bootstrap.upgrade_database(get_settings())
    print("database at the newest revision")


def cmd_keys_create(args: argparse.Namespace) -> None:
    print(json.dumps({"project": args.project, "api_key": bootstrap.create_key(get_settings(), args.project)}))


# --- client and local ------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> None:
    if args.model:  # local: a job folder, checkpoint or model, no server
        if not args.prompt:
            raise SystemExit("rlhf generate --model DIR needs --prompt TEXT")
        engine_cli.cmd_generate(args)
        return
    client.cmd_generate(args)


def cmd_train(args: argparse.Namespace) -> None:
    """``rlhf train``: the engine's, on the vLLM the service's settings name (``RLHF_VLLM_PYTHON``,
    ``RLHF_VLLM_URL``, ``RLHF_VLLM_START_TIMEOUT_SECONDS``, as a train worker reads them) unless ``--vllm-python``
    or ``--vllm-url`` names another."""
    engine_cli.cmd_train(args, vllm=get_settings().vllm())


def cmd_demo(args: argparse.Namespace) -> None:
    if args.local:
        engine_cli.cmd_demo(args)
        return
    from jobs.demo import run_http_demo

    run_http_demo(args.data_dir, args.port, args.method)


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

    p = client_args(sub.add_parser("submit", help="submit a job spec, or a pipeline file of several, to the server"))
    p.add_argument("spec", type=Path)
    p.add_argument("--idempotency-key")
    p.add_argument("--follow", action="store_true", help="then show its progress until it ends")
    p.set_defaults(func=client.cmd_submit)

    p = client_args(sub.add_parser("jobs", help="list, inspect, cancel, pause or resume jobs"))
    p.add_argument("action", choices=["list", "get", "cancel", "pause", "resume"])
    p.add_argument("job", nargs="?")
    p.add_argument("--status")
    p.add_argument("--type")
    p.add_argument("--limit", type=int)
    p.set_defaults(func=client.cmd_jobs)

    p = client_args(sub.add_parser("logs", help="a job's events, or its live progress with --follow"))
    p.add_argument("job")
    p.add_argument("--follow", action="store_true")
    p.set_defaults(func=client.cmd_logs)

    p = client_args(sub.add_parser("generate", help="sample from a job's checkpoint (server) or a folder (--model)"))
    p.add_argument("job", nargs="?", help="job id (server)")
    p.add_argument("prompt_text", nargs="?", metavar="PROMPT")
    p.add_argument("--prompt", action="append", help="prompt text; repeat for several")
    p.add_argument("--model", help="local job folder, checkpoint folder, model folder or hub id (no server)")
    p.add_argument("--checkpoint", default="latest", type=lambda s: s if s == "latest" else int(s))
    p.add_argument("--score", action="store_true", help="add scores by the reward model the job trained against")
    engine_cli.add_sampling_arguments(p)
    p.set_defaults(func=cmd_generate)

    p = client_args(sub.add_parser("download", help="download a job's model (or a checkpoint's) into a folder"))
    p.add_argument("job", metavar="JOB[@STEP]", help="job id; @STEP for the checkpoint of that step")
    p.add_argument("-o", "--out", type=Path, help="folder to unpack into (default: ./JOB, or ./JOB-step-STEP)")
    p.add_argument("--force", action="store_true", help="unpack into a non-empty folder, replacing the model's files")
    p.set_defaults(func=client.cmd_download)

    engine_cli.add_train_command(sub).set_defaults(func=cmd_train)

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
    if args.command == "train":  # before a tracker's library starts: see engine.tracking.quiet_environment
        os.environ.update(quiet_environment(args.out / "trackers", os.environ))
    args.func = in_own_words(args.func)
    engine_cli.run_command(args)


def in_own_words(func: Callable[[argparse.Namespace], None]) -> Callable[[argparse.Namespace], None]:
    """``func`` ending in its own words on the service's errors: a client's error as its message, settings that do
    not read one line a variable. (A SystemExit, which the engine's ``run_command`` passes on as it is.)"""

    def run(args: argparse.Namespace) -> None:
        try:
            func(args)
        except ClientError as e:
            raise SystemExit(f"error: {e}") from None
        except InvalidSettings as e:  # at every command that reads the settings
            raise SystemExit("\n".join(f"error: {line}" for line in e.lines)) from None

    return run


if __name__ == "__main__":
    main(sys.argv[1:])
