"""The processes of ``rlhf serve``: the API, a train worker and an inference worker, each a ``python -m jobs.cli``
child of this process. A child that exits is started again; SIGINT or SIGTERM stops them all. While it runs,
``data_dir/server.json`` tells the client commands on this machine the server's URL."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from jobs.client import KEY_FILE, SERVER_FILE


def serve(data_dir: Path, *, host: str, port: int, allow_remote: bool) -> None:
    """Run the children until a signal; then stop them (killed after 10 s) and remove ``server.json``. The
    database must be ready (jobs/store/bootstrap.py)."""
    url = f"http://{host}:{port}"
    env = {**os.environ, "RLHF_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    commands = {
        "api": [sys.executable, "-m", "jobs.cli", "api", "--host", host, "--port", str(port)]
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
