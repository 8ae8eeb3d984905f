"""engine/rewards/sandbox.py: python graders scored in the sandbox as in-process, their faults reported per call or
per batch, and each escape (network, host files, processes, signals, memory, CPU, output, the server's packages, its
environment, big files, many files, forged results) ending as an error with the test process unharmed. The escapes
run twice: with every layer, and with the kernel's alone (no audit hook); the main ones again as a non-root service
runs them (as nobody, through a user namespace). The audit hook holds against the grader's attempts to switch it
off, in each mode; OpenAI's documented packages import, read-only."""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from engine.rewards import sandbox
from engine.rewards.sandbox import (
    GRADER_ENVIRONMENT,
    NOBODY,
    GradeBatch,
    SandboxLimits,
    grade_source,
    offered_packages,
    sandbox_problem,
)

ROOT = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(wall_s=5, cpu_s=2, memory_bytes=256 * 2**20, output_bytes=2**20, file_bytes=2**20)
SECRET = "correct-horse-battery-staple"
Calls = list[tuple[dict[str, Any], dict[str, Any]]]
Run = Callable[..., GradeBatch]


@pytest.fixture(autouse=True)
def sandbox_available() -> None:
    """Skip where this machine cannot isolate a grader; on CI (``CI=true``, root, ``unshare -rn`` works) fail."""
    problem = sandbox_problem()
    if problem is not None and os.environ.get("CI") == "true":
        pytest.fail(f"the grader sandbox must work on CI: {problem}")
    if problem is not None:
        pytest.skip(problem)


AS_NOBODY = "as nobody"
"""The mode of a service running as a user other than root: the sandbox isolates through a user namespace."""
CAN_BE_NOBODY = os.geteuid() == 0 and bool(shutil.which("unshare") and shutil.which("setpriv"))


@pytest.fixture(params=["all layers", "kernel only"])
def run(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Run]:
    """Grade in the sandbox with every layer, or without the audit hook; no process of its sessions may outlive
    the batch (each sandbox starts a session; the pids are recorded from its Popen)."""
    sessions: set[int] = set()

    class RecordedPopen(subprocess.Popen[bytes]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            sessions.add(self.pid)

    monkeypatch.setattr(sandbox.subprocess, "Popen", RecordedPopen)

    def grade(source: str, calls: Calls, limits: SandboxLimits = LIMITS) -> GradeBatch:
        return sandbox._grade(source, calls, limits, audit_hook=request.param == "all layers")

    yield grade
    assert sessions
    deadline = time.monotonic() + 2  # one being torn down by the kernel may take a moment; a survivor stays
    while processes_in(sessions) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_in(sessions) == set()


@pytest.fixture(scope="module")
def sandbox_copy() -> Iterator[Path]:
    """A folder anyone can read holding a copy of the sandbox module (stdlib only, importable alone)."""
    with tempfile.TemporaryDirectory() as copy:
        os.chmod(copy, 0o755)
        shutil.copy(sandbox.__file__, Path(copy) / "sandbox.py")
        yield Path(copy)


AS_NOBODY_SCRIPT = """
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
import sandbox
pids = []

class RecordedPopen(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pids.append(self.pid)

sandbox.subprocess.Popen = RecordedPopen
source, calls, limits, options = json.load(sys.stdin)
try:
    batch = sandbox._grade(source, calls, sandbox.SandboxLimits(**limits), **options).__dict__
except sandbox.SandboxUnavailable as exc:
    batch = {"unavailable": str(exc)}
print(json.dumps({"batch": batch, "pids": pids}))
"""


def grade_as_nobody(
    copy: Path, source: str, calls: Calls, limits: SandboxLimits, **options: Any
) -> tuple[GradeBatch, list[int]]:
    """``sandbox._grade(..., **options)`` in a process of nobody's (the sandbox module's copy in ``copy``), and the
    pids of the sandboxes it started."""
    python = os.path.realpath(sys.executable)
    as_nobody = f'setpriv --reuid {NOBODY} --regid {NOBODY} --clear-groups {python} -I -c "$0" {copy}'
    command = f"set -e; {reachable_by_nobody(python)}exec {as_nobody}"
    given = json.dumps([source, calls, asdict(limits), options])
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", command, AS_NOBODY_SCRIPT], input=given, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    ran = json.loads(result.stdout)
    assert "unavailable" not in ran["batch"], ran["batch"]
    return GradeBatch(**ran["batch"]), ran["pids"]


def processes_in(sessions: set[int]) -> set[int]:
    """The live processes whose session or process group is one of ``sessions`` (from /proc/<pid>/stat)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group, session = stat.read_text().rpartition(")")[2].split()[:4]
        except OSError:
            continue
        if state != "Z" and (int(group) in sessions or int(session) in sessions):
            found.add(int(stat.parent.name))
    return found


def one_per(item_key: str, *values: Any) -> Calls:
    return [({"output_text": ""}, {item_key: value}) for value in values]


def assert_all_failed(batch: GradeBatch) -> None:
    assert batch.scores == [None] * len(batch.scores)
    assert batch.batch_error is not None or None not in batch.errors, batch


EXACT_MATCH = """
def grade(sample, item):
    if sample["output_json"] is not None:
        return float(sample["output_json"].get("answer") == item["answer"])
    return 1.0 if sample["output_text"].strip() == item["answer"] else 0.25 * len(sample["output_text"])
"""


def test_scores_match_the_grader_run_in_process() -> None:
    outputs = [("4", None), (" 4 ", None), ("five", None), ('{"answer": "4"}', {"answer": "4"}), ("{}", {})]
    calls: Calls = [
        ({"output_text": text, "output_json": parsed, "output_tools": [], "choices": []}, {"answer": "4"})
        for text, parsed in outputs
    ]
    namespace: dict[str, Any] = {}
    exec(EXACT_MATCH, namespace)
    expected = [namespace["grade"](sample, item) for sample, item in calls]

    batch = grade_source(EXACT_MATCH, calls, LIMITS)

    assert batch.scores == expected == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert batch.errors == [None] * 5
    assert batch.batch_error is None
    assert 0 < batch.seconds < LIMITS.wall_s


def test_a_failing_call_is_its_own_error() -> None:
    source = """
def grade(sample, item):
    returns = {"zero": lambda: 1 / 0, "str": lambda: "1.0", "bool": lambda: True, "nan": lambda: float("nan")}
    return returns.get(item["kind"], lambda: 7)()
"""
    batch = grade_source(source, one_per("kind", "zero", "int", "str", "bool", "nan"), LIMITS)

    assert batch.batch_error is None
    assert batch.scores == [None, 7.0, None, None, None]
    assert batch.errors == [
        "ZeroDivisionError: division by zero (line 3)",
        None,
        "grade returned a str, not a number",
        "grade returned a bool, not a number",
        "grade returned nan, not a finite number",
    ]


@pytest.mark.parametrize(
    ("source", "batch_error"),
    [
        ("def grade(sample, item):\n    return (1.0\n", "the source does not compile: '(' was never closed (line 2)"),
        ("def score(sample, item):\n    return 1.0\n", "the source defines no grade() function"),
        ("import os\n\nraise KeyError('x')\n", "loading the source failed: KeyError: 'x' (line 3)"),
    ],
)
def test_a_broken_source_fails_the_batch(source: str, batch_error: str) -> None:
    batch = grade_source(source, one_per("n", 1, 2), LIMITS)

    assert batch == GradeBatch([None, None], [None, None], batch_error, batch.seconds)


def test_no_connection_leaves_the_sandbox(run: Run) -> None:
    source = """
import socket
def grade(sample, item):
    socket.create_connection(("127.0.0.1", item["port"]), timeout=2).close()
    return 1.0
"""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        batch = run(source, one_per("port", listener.getsockname()[1], 5432))  # a listener of ours; PostgreSQL's

        assert_all_failed(batch)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert all(e and ("Network is unreachable" in e or "socket." in e) for e in batch.errors), batch


def test_host_files_cannot_be_read(run: Run, tmp_path: Path) -> None:
    data = tmp_path / "data"  # the server's data folder
    data.mkdir()
    (data / "secret.txt").write_text(SECRET)
    source = """
def grade(sample, item):
    with open(item["path"]) as file:
        raise ValueError(file.read())
"""
    paths = ["/etc/passwd", str(data / "secret.txt"), str(ROOT / "pyproject.toml"), str(Path.home() / ".bashrc")]

    batch = run(source, one_per("path", *paths))

    assert_all_failed(batch)
    assert all(e and e.startswith("FileNotFoundError") for e in batch.errors), batch
    assert SECRET not in repr(batch) and "root:" not in repr(batch)


def test_the_services_umask_leaves_the_interpreter_reachable(run: Run) -> None:
    """The service runs under umask 077 (Settings.prepare_data_dir); the sandbox's root is still searchable by
    nobody: the standard library imports, and a host path is missing rather than forbidden."""
    source = """
import socket
def grade(sample, item):
    open("/root/.bashrc")
"""
    previous = os.umask(0o077)
    try:
        batch = run(source, [({}, {})])
    finally:
        os.umask(previous)
    assert batch.batch_error is None and batch.errors[0] is not None, batch
    assert batch.errors[0].startswith("FileNotFoundError"), batch


def test_the_root_holds_only_the_interpreter(run: Run) -> None:
    source = """
import os
def grade(sample, item):
    raise ValueError(sorted(os.listdir(item["dir"])))
"""
    batch = run(source, one_per("dir", "/", "/work"))

    top, work = batch.errors
    assert top is not None and work is not None
    assert not {"'etc'", "'home'", "'tmp'", "'proc'", "'dev'", "'var'"} & set(top.split(" "))
    assert work == "ValueError: [] (line 4)"  # the sandbox's empty /work, not the host's


def test_no_new_process_or_thread(run: Run) -> None:
    source = """
import os, subprocess, threading
def grade(sample, item):
    if item["how"] == "fork":
        while True:
            os.fork()
    if item["how"] == "subprocess":
        subprocess.run(["/bin/sh", "-c", "sleep 60 &"])
    if item["how"] == "posix_spawn":
        os.posix_spawn("/bin/sh", ["sh"], {})
    if item["how"] == "thread":
        threading.Thread(target=lambda: None).start()
    return 1.0
"""
    batch = run(source, one_per("how", "fork", "subprocess", "posix_spawn", "thread"))

    assert_all_failed(batch)
    assert batch.batch_error is None
    assert batch.errors[-1] == "RuntimeError: can't start new thread (line 12)"


def test_no_signal_leaves_the_sandbox(run: Run) -> None:
    # a process of the sandbox's own user (nobody, when the tests run as root) is one it could otherwise kill
    canary = subprocess.Popen(["sleep", "30"], user=NOBODY if os.geteuid() == 0 else None)
    source = """
import os
def grade(sample, item):
    os.kill(item["pid"], 9)
    return 1.0
"""
    try:
        batch = run(source, one_per("pid", os.getpid(), canary.pid, -1))
        time.sleep(0.1)
        assert canary.poll() is None
    finally:
        canary.kill()
        canary.wait()
    assert batch.scores[:2] == [None, None]  # -1: every process the sandbox can see, that is none


@pytest.mark.parametrize(
    "body",
    ["bytearray(10 * 2**30)", "chunks = []\n    while True:\n        chunks.append(bytearray(2**20))"],
)
def test_memory_limit(run: Run, body: str) -> None:
    batch = run(f"def grade(sample, item):\n    {body}\n", one_per("n", 1, 2))

    assert batch.batch_error == "memory limit of 256 MiB"
    assert batch.scores == [None, None]


@pytest.fixture
def busy_cpu() -> Iterator[None]:
    """This process, and those it starts, on one CPU shared with a busy loop: a loaded machine, where the CPU time
    the kernel reports of a process killed at its limit often falls short of the limit (by up to 30 %)."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        loop.kill()
        loop.wait()
        os.sched_setaffinity(0, cpus)


def test_cpu_limit(busy_cpu: None) -> None:
    """Reported as the CPU limit on a loaded machine too (the kernel's SIGXCPU says it, whatever CPU time is
    counted), in every mode alike (the same rlimit)."""
    limits = SandboxLimits(wall_s=30, cpu_s=1)  # a wall clock far enough for a loaded machine to spend 1 CPU second

    batch = grade_source("def grade(sample, item):\n    while True:\n        pass\n", one_per("n", 1), limits)

    assert batch.batch_error == "CPU time limit of 1 s"
    assert batch.seconds < limits.wall_s


def test_wall_clock_limit(run: Run) -> None:
    source = "import time\ndef grade(sample, item):\n    time.sleep(60)\n"

    batch = run(source, one_per("n", 1), SandboxLimits(wall_s=1, cpu_s=2))

    assert batch.batch_error == "wall-clock timeout of 1 s"
    assert batch.seconds < 3


def test_output_limit(run: Run) -> None:
    source = "def grade(sample, item):\n    for _ in range(100):\n        print('x' * 2**20)\n    return 1.0\n"

    batch = run(source, one_per("n", 1))

    assert batch.batch_error == f"output over {2**20} bytes"
    assert batch.scores == [None]


def test_server_packages_cannot_be_imported(run: Run) -> None:
    spec = importlib.util.find_spec("sqlalchemy")
    assert spec is not None and spec.origin is not None
    site_packages = str(Path(spec.origin).parents[1])
    base = sys.base_prefix  # the interpreter's own site-packages (pip's) lies inside its bound library folder
    base_site_packages = sysconfig.get_paths(vars={"base": base, "platbase": base})["purelib"]
    jobs = importlib.util.find_spec("jobs")
    assert jobs is not None and jobs.origin is not None
    jobs_parent = str(Path(jobs.origin).resolve().parents[1])  # the checkout, by the real path of the package
    source = """
import importlib, sys
def grade(sample, item):
    sys.path.insert(0, item["path"])
    importlib.import_module(item["module"])
    return 1.0
"""
    calls: Calls = [
        ({}, {"path": "", "module": "jobs.store.db"}),
        ({}, {"path": "", "module": "sqlalchemy"}),
        ({}, {"path": jobs_parent, "module": "jobs"}),
        ({}, {"path": jobs_parent, "module": "engine.rewards.graders"}),
        ({}, {"path": site_packages, "module": "sqlalchemy"}),
        ({}, {"path": base_site_packages, "module": "pip"}),
        ({}, {"path": "", "module": "httpx"}),  # installed, but not one of OpenAI's grader packages
    ]

    batch = run(source, calls)

    assert_all_failed(batch)
    assert all(e and e.startswith("ModuleNotFoundError") for e in batch.errors), batch


def test_the_environment_does_not_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLHF_DATABASE_URL", f"postgresql://rlhf:{SECRET}@127.0.0.1:5432/rlhf")
    source = "import os\ndef grade(sample, item):\n    raise ValueError(dict(os.environ))\n"

    batch = grade_source(source, one_per("n", 1), LIMITS)

    # the sandbox's own environment alone; Python sets LC_CTYPE itself in the C locale (PEP 538)
    expected = [GRADER_ENVIRONMENT, {**GRADER_ENVIRONMENT, "LC_CTYPE": "C.UTF-8"}]
    assert batch.errors in ([f"ValueError: {environment} (line 3)"] for environment in expected)
    assert SECRET not in repr(batch)


def test_a_file_over_the_size_limit_cannot_be_written(run: Run) -> None:
    source = """
def grade(sample, item):
    with open("out.bin", "wb") as file:
        file.write(b"x" * item["size"])
    return 1.0
"""
    batch = run(source, one_per("size", 1000, 2 * 2**20))

    assert batch.scores == [1.0, None]
    assert batch.errors[1] is not None and "File too large" in batch.errors[1]


def test_files_are_counted_not_only_their_bytes(run: Run) -> None:
    source = """
def grade(sample, item):
    made = 0
    try:
        while True:
            open(f"empty-{made}", "w").close()
            made += 1
    except OSError as exc:
        raise ValueError(made, exc.strerror)
"""
    batch = run(source, one_per("n", 1), SandboxLimits(wall_s=10, cpu_s=5, work_files=20))

    assert batch.errors == ["ValueError: (20, 'No space left on device') (line 9)"]


def test_results_cannot_be_forged_by_printing(run: Run) -> None:
    forged = [json.dumps({"ready": True}), json.dumps({"scores": [1.0], "errors": [None]})]
    source = f"""
import sys
def grade(sample, item):
    for line in {forged!r}:
        print(line)
        print(line, file=sys.stderr)
    return 0.0
"""
    batch = run(source, one_per("n", 1))

    assert batch == GradeBatch([0.0], [None], None, batch.seconds)


def test_ctypes_cannot_undo_the_isolation(run: Run) -> None:
    """With ctypes (which the audit hook refuses), a grader may enter a user namespace of its own and have every
    capability there; still no host file is behind its mounts, and no mount of its sandbox can be undone."""
    source = """
import ctypes, os
def grade(sample, item):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.unshare(0x10000000 | 0x00020000)  # CLONE_NEWUSER | CLONE_NEWNS
    for path in [b"/", b"/work", b"/usr"]:
        libc.umount2(path, 2)  # MNT_DETACH
    with open("/etc/passwd") as file:
        raise ValueError(file.read())
"""
    batch = run(source, one_per("n", 1))

    assert_all_failed(batch)
    assert "root:" not in repr(batch)
    assert batch.errors[0] is not None and batch.errors[0].startswith(("FileNotFoundError", "PermissionError"))


def test_results_nested_too_deeply_are_malformed(run: Run) -> None:
    """A grader may write to the results pipe itself (its number is the sandbox's argument): a line nested past
    the JSON parser's depth is a batch of malformed results, not an error of the service."""
    source = """
import os, sys
def grade(sample, item):
    os.write(int(sys.argv[1]), b"[" * 100_000 + b"\\n")
    os._exit(0)
"""
    batch = run(source, one_per("n", 1))

    assert batch == GradeBatch([None], [None], "the grader process returned malformed results", batch.seconds)


BYPASSES = """
import __main__, gc, os, socket, types
def grade(sample, item):
    how = item["how"]
    if how == "table":
        for name, value in vars(__main__).items():
            if isinstance(value, tuple) and all(isinstance(event, str) for event in value):
                setattr(__main__, name, ())
    if how == "hook":
        for name, value in list(vars(__main__).items()):
            if isinstance(value, types.FunctionType) and name not in ("_send", "_run_grader", "_call", "_describe"):
                value.__code__ = (lambda *args, **kwargs: None).__code__
    if how == "closure":
        for found in gc.get_objects():
            if isinstance(found, types.FunctionType) and found.__closure__:
                for cell in found.__closure__:
                    if isinstance(cell.cell_contents, tuple):
                        cell.cell_contents = ()
    if item["then"] == "fork":
        if os.fork() == 0:
            os._exit(0)
    else:
        socket.socket().close()  # the kernel lets a grader make a socket (it reaches nothing): only the hook refuses
    return 1.0
"""
BYPASS_CALLS: Calls = [
    ({}, {"how": how, "then": then}) for how in ("table", "hook", "closure") for then in ("socket", "fork")
]


@pytest.mark.parametrize(
    "mode",
    [
        "as root",
        "in a user namespace, as root",
        pytest.param(AS_NOBODY, marks=pytest.mark.skipif(not CAN_BE_NOBODY, reason="needs root to become nobody")),
    ],
)
def test_the_audit_hook_cannot_be_switched_off(mode: str, sandbox_copy: Path) -> None:
    """The hook's table and code are out of the grader's reach: after each attempt on them (the module's table, its
    functions, the cells of every closure gc finds), a socket or a fork is still refused, by the hook. In a user
    namespace as root (no RLIMIT_NPROC there) the hook alone stops the fork."""
    if mode == AS_NOBODY:
        batch, _ = grade_as_nobody(sandbox_copy, BYPASSES, BYPASS_CALLS, LIMITS)
    else:
        batch = sandbox._grade(BYPASSES, BYPASS_CALLS, LIMITS, user_namespace=mode != "as root")

    assert batch.batch_error is None, batch
    assert batch.scores == [None] * len(BYPASS_CALLS), batch
    assert all(e and e.startswith("PermissionError") and "not allowed in a grader" in e for e in batch.errors), batch


OPENAI_RAPIDFUZZ = """
from rapidfuzz import fuzz, utils

def grade(sample, item) -> float:
    output_text = sample["output_text"]
    reference_answer = item["reference_answer"]
    return fuzz.WRatio(output_text, reference_answer, processor=utils.default_process) / 100.0
"""
"""OpenAI's python grader example (https://platform.openai.com/docs/guides/graders#python-graders)."""


def test_openais_example_grader_runs() -> None:
    calls: Calls = [({"output_text": text}, {"reference_answer": "Paris"}) for text in ("paris", "Lyon")]

    batch = grade_source(OPENAI_RAPIDFUZZ, calls, LIMITS)

    assert batch.batch_error is None and batch.errors == [None, None], batch
    assert batch.scores[0] == 1.0 and batch.scores[1] is not None and batch.scores[1] < 0.5


def test_every_offered_package_imports_read_only() -> None:
    offered = offered_packages()
    assert {"numpy", "rapidfuzz", "rouge_score", "nltk"} <= set(offered.modules)  # the service's own dependencies
    source = """
import importlib
def grade(sample, item):
    if item["module"] == "write":
        open("/packages/numpy/__init__.py", "a")
    importlib.import_module(item["module"])
    return 1.0
"""
    calls: Calls = [({}, {"module": module}) for module in (*offered.modules, "write")]

    batch = grade_source(source, calls, SandboxLimits(wall_s=60, cpu_s=30))

    assert batch.batch_error is None, batch
    assert batch.scores == [1.0] * len(offered.modules) + [None], batch
    assert batch.errors[-1] is not None and batch.errors[-1].startswith(("PermissionError", "OSError")), batch


def reachable_by_nobody(python: str) -> str:
    """Shell commands (root's, in a private mount namespace) after which nobody can run ``python``: when it lies
    under /root (mode 700; pyenv's does), /root becomes a folder holding only its top folder there."""
    if not python.startswith("/root/"):
        return ""
    top = Path(python).parts[2]
    return f"d=$(mktemp -d); chmod 711 $d; mkdir $d/{top}; mount --bind /root/{top} $d/{top}; mount --rbind $d /root; "


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")), reason="needs root")
def test_a_non_root_service_isolates_through_a_user_namespace() -> None:
    """The module run by nobody (a copy of it: stdlib only, importable alone) isolates through a user namespace,
    where it keeps its uid; the kernel's limits hold there too (RLIMIT_NPROC, the files /work may hold, the
    mounts ctypes cannot undo, the checkout out of reach), with the audit hook switched off by the grader as
    without it. Without one (root's way) it cannot isolate, and says so rather than run the grader."""
    source = """
import __main__, ctypes, os, socket, sys, threading
def grade(sample, item):
    how = item["how"]
    if how == "bypass":
        __main__.REFUSED_EVENTS = ()
        if os.fork() == 0:
            os._exit(0)
    if how == "files":
        for n in range(100_000):
            open(f"empty-{n}", "w").close()
    if how == "ctypes":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.unshare(0x10000000 | 0x00020000)  # CLONE_NEWUSER | CLONE_NEWNS
        for path in [b"/", b"/work", b"/usr"]:
            libc.umount2(path, 2)  # MNT_DETACH
        open("/etc/passwd").read()
    if how == "checkout":
        sys.path.insert(0, item["checkout"])
        import jobs
    if how == "fork":
        os.fork()
    if how == "thread":
        threading.Thread(target=lambda: None).start()
    if how == "socket":
        socket.create_connection(("127.0.0.1", 5432), timeout=2)
    if how == "passwd":
        open("/etc/passwd").read()
    if how == "kill":
        os.kill(item["pid"], 9)
    return 1.0
"""
    jobs = importlib.util.find_spec("jobs")
    assert jobs is not None and jobs.origin is not None
    checkout = str(Path(jobs.origin).resolve().parents[1])
    hows = ["fork", "thread", "socket", "passwd", "kill", "bypass", "files", "ctypes", "checkout", "ok"]
    calls: Calls = [({}, {"how": how, "pid": os.getpid(), "checkout": checkout}) for how in hows]
    script = f"""
import json, sys
sys.path.insert(0, sys.argv[1])
import sandbox
batches = [sandbox._grade({source!r}, {calls!r}, sandbox.SandboxLimits(), audit_hook=h) for h in (True, False)]
try:
    sandbox._grade("raise SystemExit", [], sandbox.SandboxLimits(), user_namespace=False)
    refused = None
except sandbox.SandboxUnavailable as exc:
    refused = str(exc)
print(json.dumps({{"batches": [batch.__dict__ for batch in batches], "refused": refused}}))
"""
    python = os.path.realpath(sys.executable)
    with tempfile.TemporaryDirectory() as copy:
        os.chmod(copy, 0o755)
        shutil.copy(sandbox.__file__, Path(copy) / "sandbox.py")
        as_nobody = f'setpriv --reuid {NOBODY} --regid {NOBODY} --clear-groups {python} -I -c "$0" {copy}'
        command = f"set -e; {reachable_by_nobody(python)}exec {as_nobody}"
        result = subprocess.run(["unshare", "-m", "sh", "-c", command, script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    ran = json.loads(result.stdout)
    assert ran["refused"].startswith("cannot isolate the grader: [Errno 1] unshare"), ran["refused"]
    for batch in ran["batches"]:
        assert batch["batch_error"] is None, batch
        assert batch["scores"] == [None] * (len(hows) - 1) + [1.0], batch
        assert "No space left on device" in batch["errors"][hows.index("files")], batch
