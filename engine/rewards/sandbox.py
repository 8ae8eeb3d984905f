"""Running OpenAI-style python graders (user code) where they cannot hurt the service (stdlib only, torch-free).

Such a grader is a source string defining ``def grade(sample, item) -> float``
(https://platform.openai.com/docs/guides/graders#python-graders): ``sample`` holds ``output_text``,
``output_json``, ``output_tools`` and ``choices``, ``item`` is the dataset row. :func:`grade_source` runs one
batch of calls in one fresh process (this very file, run as a script: ``python -I -S``, the environment
:data:`GRADER_ENVIRONMENT`, an empty temporary working directory, a session of its own), which isolates itself
before it reads the source:

1. Namespaces (unshare(2)): new mount, network, IPC and PID namespaces, and a user namespace too when the service
   does not run as root (it grants the rights to mount). The network namespace has no interface up, so no
   connection reaches anything; in the PID namespace the grader sees no other process but the one waiting for it
   (which ignores its signals), and whatever it left running dies with them.
2. Filesystem: a tmpfs root holding read-only binds of the interpreter's ``sys.path`` and of the directories of its
   loaded shared libraries, every ``site-packages`` and ``dist-packages`` in them masked by an empty tmpfs, and a
   small writable ``/work`` (bytes and inodes capped); pivot_root(2) into it and the old root detached. /etc,
   /home, /root's files, the checkout, the virtualenv and the server's data are not there. Of the installed
   packages only those OpenAI's grader runtime documents (:data:`OPENAI_PACKAGES`) can be imported, each bound
   read-only under ``/packages`` with what it requires (:func:`offered_packages`).
3. Privileges: as root the process becomes nobody (65534), which drops every capability and makes RLIMIT_NPROC
   apply (the kernel exempts real root from it); otherwise it clears its capabilities in its user namespace.
4. rlimits: CPU time, address space, open files, file size, no new process or thread, no core dump. The grader is
   the second process of its PID namespace, below a first that waits for it: the first process of a namespace
   ignores the kernel's SIGXCPU, which tells a grader stopped at its CPU limit from one killed otherwise.
5. A :func:`sys.addaudithook` hook refusing process creation, signals, sockets, ctypes and the garbage collector's
   walks over every object: a second layer over the kernel's (``_posixsubprocess.fork_exec`` raises no audit
   event: there the rlimit alone stops it). It closes over its own copy of the table, so that nothing the grader
   can reach (this module is its ``__main__``) switches it off.

The source and the calls go in on stdin as JSON; the results come back on a pipe of their own as JSON lines: first
``{"ready": true}`` (or why the isolation failed, before any user code ran), then the results. What the grader
prints reaches only stdout, which the parent counts and discards. The grader could write to the results pipe
itself, but that is no more than returning those scores: the parent checks their shape and types.

A grader returning ``bool`` is an error, as any return that is not an ``int`` or a finite ``float``: OpenAI's
python grader returns a float. Everything the grader does wrong is in the :class:`GradeBatch`;
:class:`SandboxUnavailable` is raised only when the isolation cannot be set up, and then no user code ran.
"""

import contextlib
import ctypes
import functools
import glob
import importlib.util
import json
import math
import os
import re
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

NOBODY = 65534
"""The uid and gid a sandbox started by root runs as."""
GRADER_FILE = "<grader>"
"""The file name the user's source is compiled under: its frames in a traceback give the user's line."""
MAX_ERROR_CHARS = 500
"""Longest error message kept per call."""
OUTPUT_TAIL_BYTES = 2000
"""The end of the sandbox's stdout and stderr kept to say why it failed to start."""
EXIT_CPU = 90
"""Exit status of the sandbox when its grading process was killed at the CPU time limit."""
EXIT_MEMORY = 91
"""Exit status of the sandbox when the grader ran out of memory (RLIMIT_AS)."""
REFUSED_EVENTS = (
    "os.fork",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.system",
    "os.kill",
    "pty.spawn",
    "signal.pthread_kill",
    "subprocess.",
    "socket.",
    "ctypes.",
    "gc.",
)
"""Audit events (https://docs.python.org/3/library/audit_events.html) the grader's hook refuses, by prefix (``gc.``:
``gc.get_objects``, ``get_referrers`` and ``get_referents``, which would find the hook itself). The hook takes a
copy when it is installed: changing this table in the sandbox changes nothing."""
GRADER_ENVIRONMENT = {"HOME": "/work", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""The sandbox's whole environment: a home (nltk wants one as it loads), and one thread for numerical libraries:
no thread may start there (RLIMIT_NPROC), and numpy's OpenBLAS, told of no count, starts one per CPU as it loads
(and stops the process when it cannot)."""
CPU_GRACE_S = 1
"""Seconds of CPU past :attr:`SandboxLimits.cpu_s` (the soft limit, SIGXCPU) to the hard limit (SIGKILL), for a
grader that ignores SIGXCPU."""
PACKAGES_DIR = "/packages"
"""Where the sandbox binds the offered packages (:func:`offered_packages`), read-only, last on ``sys.path``."""
STOPPED = "stopped: the grading was abandoned"
"""The batch error of a batch whose ``should_stop`` asked for a stop."""
OPENAI_PACKAGES = (
    ("numpy", "numpy"),
    ("scipy", "scipy"),
    ("sympy", "sympy"),
    ("pandas", "pandas"),
    ("rapidfuzz", "rapidfuzz"),
    ("sklearn", "scikit-learn"),
    ("rouge_score", "rouge-score"),
    ("deepdiff", "deepdiff"),
    ("jsonschema", "jsonschema"),
    ("pydantic", "pydantic"),
    ("yaml", "PyYAML"),
    ("nltk", "nltk"),
    ("sqlparse", "sqlparse"),
    ("rdkit", "rdkit"),
    ("skbio", "scikit-bio"),
    ("ast_grep_py", "ast-grep-py"),
)
"""(import name, distribution) of the third-party packages OpenAI's python grader runtime documents beside the
standard library (https://platform.openai.com/docs/guides/graders#python-graders): a grader here may import those
installed for the service's Python (:func:`offered_packages`)."""

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522


@dataclass(frozen=True)
class SandboxLimits:
    """What one grading batch may use."""

    wall_s: float = 30.0
    """Wall-clock timeout of the whole batch (the process is killed at it)."""
    cpu_s: int = 20
    """CPU seconds of the grading process (RLIMIT_CPU)."""
    memory_bytes: int = 1 << 30
    """Address space of the grading process (RLIMIT_AS), the interpreter included."""
    open_files: int = 64
    """File descriptors the grading process may open (RLIMIT_NOFILE)."""
    output_bytes: int = 1 << 20
    """Most bytes read back from the process, its prints and its results together; more fails the batch."""
    file_bytes: int = 1 << 20
    """Largest file the grader may write (RLIMIT_FSIZE); its writable /work holds 4 times that in all."""
    work_files: int = 1000
    """Files and folders the grader may make in its /work (the tmpfs's ``nr_inodes``): an empty file holds no byte
    that ``file_bytes`` counts, but its inode costs the kernel memory."""


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate user code (e.g. user namespaces refused); the message says why."""


@dataclass
class GradeBatch:
    """The outcome of one batch of ``grade(sample, item)`` calls."""

    scores: list[float | None]
    """Per call: the number ``grade`` returned, as a float; None where the call failed."""
    errors: list[str | None]
    """Per call: None, or why it failed (``"ZeroDivisionError: division by zero (line 3)"``,
    ``"grade returned a str, not a number"``)."""
    batch_error: str | None
    """Why the whole batch failed (a limit, a source that does not compile or defines no ``grade``, the process
    died, :data:`STOPPED`), or None; when set, every score is None."""
    seconds: float
    """Wall-clock seconds the batch took."""


@functools.cache
def sandbox_problem() -> str | None:
    """None when this machine can run the sandbox, else why not: a trivial grader is tried once."""
    try:
        batch = grade_source("def grade(sample, item):\n    return 1.0\n", [({}, {})], SandboxLimits(wall_s=10))
    except SandboxUnavailable as exc:
        return str(exc)
    if batch.scores != [1.0]:
        return f"a trivial grader failed in the sandbox: {batch.batch_error or batch.errors[0]}"
    return None


@dataclass(frozen=True)
class OfferedPackages:
    """The packages of :data:`OPENAI_PACKAGES` a grader may import here."""

    modules: tuple[str, ...]
    """Their import names, e.g. ``("numpy", "rapidfuzz")``."""
    paths: tuple[str, ...]
    """The files and folders they import from (theirs and those of the distributions they require, recursively,
    with their metadata), bound read-only under :data:`PACKAGES_DIR`."""


@functools.cache
def offered_packages() -> OfferedPackages:
    """Those of :data:`OPENAI_PACKAGES` installed for this Python (importable, listed by their distribution's
    RECORD, readable), found once."""
    modules: list[str] = []
    paths: dict[str, str] = {}  # by the name it is bound under
    for module, distribution in OPENAI_PACKAGES:
        needed = _distribution_paths(distribution)
        if needed is None or importlib.util.find_spec(module) is None:
            continue
        if any(paths.get(os.path.basename(path), path) != path for path in needed):  # two folders of one name
            continue
        modules.append(module)
        paths.update((os.path.basename(path), path) for path in needed)
    return OfferedPackages(tuple(modules), tuple(sorted(paths.values())))


def _distribution_paths(name: str) -> list[str] | None:
    """The top-level files and folders of distribution ``name`` and of those it requires (their extras left out),
    or None when one of them is not installed as a readable RECORD lists it."""
    found: dict[str, str] = {}
    wanted, seen = [name], set()
    while wanted:
        current = wanted.pop()
        key = re.sub(r"[-_.]+", "-", current).lower()  # the normalised name (PEP 503)
        if key in seen:
            continue
        seen.add(key)
        try:
            distribution = metadata.distribution(current)
        except metadata.PackageNotFoundError:
            if current == name:
                return None
            continue  # a requirement for another platform or Python (its marker unread), or an optional one
        for file in distribution.files or []:
            top = file.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            path = os.path.realpath(str(distribution.locate_file(top)))
            if not os.access(path, os.R_OK):
                return None
            found[top] = path
        for requirement in distribution.requires or []:
            named, _, marker = requirement.partition(";")
            match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", named)
            if match and "extra" not in marker:
                wanted.append(match.group(1))
    return list(found.values()) if found else None


def grade_source(
    source: str,
    calls: Sequence[tuple[dict[str, Any], dict[str, Any]]],
    limits: SandboxLimits = SandboxLimits(),
    should_stop: Callable[[], bool] | None = None,
) -> GradeBatch:
    """``grade(sample, item)`` of ``source`` for each of ``calls``, in one isolated process; killed as soon as
    ``should_stop`` (asked every :data:`STOP_POLL_S`) says so, the batch failing with :data:`STOPPED`.

    Raises :class:`SandboxUnavailable` when the isolation cannot be set up (no user code ran then).
    """
    return _grade(source, calls, limits, should_stop=should_stop)


STOP_POLL_S = 0.25
"""How often a batch asks its ``should_stop`` whether to stop."""


def _grade(
    source: str,
    calls: Sequence[tuple[dict[str, Any], dict[str, Any]]],
    limits: SandboxLimits,
    *,
    should_stop: Callable[[], bool] | None = None,
    audit_hook: bool = True,
    user_namespace: bool | None = None,
) -> GradeBatch:
    """:func:`grade_source`, with the layers the tests choose: ``audit_hook=False`` leaves the kernel's alone;
    ``user_namespace`` (by default: unless root) isolates through a user namespace, as a non-root service does."""
    if sys.platform != "linux" or not sys.executable:
        raise SandboxUnavailable("the grader sandbox needs Linux namespaces and a Python executable")
    started = time.monotonic()
    payload = {
        "source": source,
        "calls": [[sample, item] for sample, item in calls],
        "limits": asdict(limits),
        "audit_hook": audit_hook,
        "user_namespace": os.geteuid() != 0 if user_namespace is None else user_namespace,
        "packages": list(offered_packages().paths),
    }
    try:
        message = json.dumps(payload).encode()
    except RecursionError:
        return GradeBatch([None] * len(calls), [None] * len(calls), "an item is nested too deeply to send", 0.0)
    results_read, results_write = os.pipe()
    try:
        with tempfile.TemporaryDirectory(prefix="grader-") as root:
            try:
                process = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-X", "utf8", __file__, str(results_write)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=dict(GRADER_ENVIRONMENT),
                    cwd=root,
                    start_new_session=True,
                    pass_fds=(results_write,),
                )
            finally:
                os.close(results_write)
            outcome = _communicate(process, results_read, message, limits, should_stop)
    finally:
        os.close(results_read)
    return _batch(outcome, len(calls), limits, time.monotonic() - started)


@dataclass
class _Outcome:
    """What the parent saw of one sandbox process."""

    results: bytes
    """Everything read from the results pipe."""
    output_tail: bytes
    """The last bytes of its stdout and stderr."""
    returncode: int
    killed_for: str | None
    """The limit the parent killed it for (wall clock, output), or None."""


def _communicate(
    process: subprocess.Popen[bytes],
    results_fd: int,
    payload: bytes,
    limits: SandboxLimits,
    should_stop: Callable[[], bool] | None,
) -> _Outcome:
    """Send ``payload``, read the results pipe and stdout up to the limits, kill the process group at one (or when
    ``should_stop`` says so)."""
    assert process.stdin is not None and process.stdout is not None
    deadline = time.monotonic() + limits.wall_s
    try:
        process.stdin.write(payload)
        process.stdin.close()
    except BrokenPipeError:
        pass  # it died before reading: its exit status says why
    stdout_fd = process.stdout.fileno()
    received = {stdout_fd: bytearray(), results_fd: bytearray()}
    killed_for = _read_until_closed(received, deadline, limits, should_stop)
    if killed_for is None:
        try:
            process.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            killed_for = f"wall-clock timeout of {limits.wall_s:g} s"
    if killed_for is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    process.stdout.close()
    output = bytes(received[stdout_fd])
    return _Outcome(bytes(received[results_fd]), output[-OUTPUT_TAIL_BYTES:], process.returncode, killed_for)


def _read_until_closed(
    received: dict[int, bytearray], deadline: float, limits: SandboxLimits, should_stop: Callable[[], bool] | None
) -> str | None:
    """Read the pipes of ``received`` into it until all are closed; None, or the limit that stopped the reading
    (:data:`STOPPED` when ``should_stop`` asked)."""
    total = 0
    with selectors.DefaultSelector() as selector:
        for fd in received:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                return f"wall-clock timeout of {limits.wall_s:g} s"
            if should_stop is not None and should_stop():
                return STOPPED
            poll = timeout if should_stop is None else min(timeout, STOP_POLL_S)
            for key, _ in selector.select(poll):
                chunk = os.read(key.fd, 1 << 16)
                total += len(chunk)
                received[key.fd] += chunk
                if not chunk:
                    selector.unregister(key.fd)
            if total > limits.output_bytes:
                return f"output over {limits.output_bytes} bytes"
    return None


def _batch(outcome: _Outcome, n_calls: int, limits: SandboxLimits, seconds: float) -> GradeBatch:
    """The :class:`GradeBatch` of a finished sandbox process; raises :class:`SandboxUnavailable` when it never
    got as far as isolating itself."""
    if outcome.killed_for == STOPPED:  # perhaps before it was ready: whether it could isolate is unknown
        return GradeBatch([None] * n_calls, [None] * n_calls, STOPPED, seconds)
    lines = outcome.results.split(b"\n")
    first = _json_or_none(lines[0])
    if not (isinstance(first, dict) and first.get("ready") is True):
        why = first.get("unavailable") if isinstance(first, dict) else None
        if why is None:
            tail = outcome.output_tail.decode(errors="replace").strip()
            why = f"the sandbox process ended ({outcome.killed_for or outcome.returncode}) before isolating: {tail}"
        raise SandboxUnavailable(str(why))

    def failed(batch_error: str) -> GradeBatch:
        return GradeBatch([None] * n_calls, [None] * n_calls, batch_error, seconds)

    if outcome.killed_for is not None:
        return failed(outcome.killed_for)
    result = _json_or_none(lines[1]) if len(lines) == 3 and lines[2] == b"" else None
    if isinstance(result, dict) and isinstance(result.get("batch_error"), str):
        return failed(result["batch_error"][:MAX_ERROR_CHARS])
    if isinstance(result, dict) and _valid_results(result, n_calls):
        return GradeBatch(result["scores"], [e and e[:MAX_ERROR_CHARS] for e in result["errors"]], None, seconds)
    if outcome.returncode != 0:
        return failed(_exit_reason(outcome.returncode, limits))
    return failed("the grader process returned malformed results")


def _json_or_none(line: bytes) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # not JSON; nested past the parser's depth (the grader may write here)
        return None


def _valid_results(result: dict[str, Any], n_calls: int) -> bool:
    """Whether ``result`` has a finite float or None per call, and a str or None per call."""
    scores, errors = result.get("scores"), result.get("errors")
    if not (isinstance(scores, list) and isinstance(errors, list) and len(scores) == len(errors) == n_calls):
        return False
    scores_ok = all(s is None or (type(s) is float and math.isfinite(s)) for s in scores)
    return scores_ok and all(e is None or isinstance(e, str) for e in errors)


def _exit_reason(returncode: int, limits: SandboxLimits) -> str:
    """Why a sandbox that returned no results ended, from its exit status."""
    if returncode == EXIT_CPU:
        return f"CPU time limit of {limits.cpu_s} s"
    if returncode == EXIT_MEMORY:
        return f"memory limit of {limits.memory_bytes / 2**20:g} MiB"
    if returncode > 128 or returncode < 0:
        number = returncode - 128 if returncode > 128 else -returncode
        name = signal.Signals(number).name if number in signal.valid_signals() else str(number)
        return f"the grader process was killed by {name}"
    return f"the grader process exited with status {returncode} before returning results"


# The sandbox process, from here on: this file run as a script.


def _child_main() -> None:
    """Isolate (1-4), install the audit hook (5), say ready, grade; all before exiting."""
    payload = json.loads(sys.stdin.buffer.read())
    results_fd, user_namespace = int(sys.argv[1]), payload["user_namespace"]
    limits = SandboxLimits(**payload["limits"])
    packages = payload["packages"]
    try:
        _enter_namespaces(user_namespace)
        _fork_grader(results_fd, limits.cpu_s)
        owner = (os.getuid(), os.getgid()) if user_namespace else (NOBODY, NOBODY)
        _build_root(limits, owner=owner, packages=packages)
        _drop_privileges(user_namespace)
        _set_limits(limits)
    except OSError as exc:
        _send(results_fd, {"unavailable": f"cannot isolate the grader: {exc}"})
        os._exit(0)
    if packages:
        sys.path.append(PACKAGES_DIR)  # last: no package shadows the standard library
    if payload["audit_hook"]:
        _install_audit_hook(REFUSED_EVENTS)
    _send(results_fd, {"ready": True})
    try:
        result = _run_grader(payload["source"], payload["calls"])
        sys.stdout.flush()
        _send(results_fd, result)
    except MemoryError:
        os._exit(EXIT_MEMORY)
    os._exit(0)


def _libc(name: str, *args: int | str | None) -> None:
    """Call libc's ``name`` (str arguments as bytes, ints as unsigned long); an OSError when it fails."""
    function = getattr(ctypes.CDLL(None, use_errno=True), name)
    converted = [arg.encode() if isinstance(arg, str) else arg if arg is None else ctypes.c_ulong(arg) for arg in args]
    if function(*converted) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}{args}: {os.strerror(errno)}")


def _enter_namespaces(user_namespace: bool) -> None:
    """1. New mount, network, IPC and PID namespaces, in a new user namespace mapping only our uid and gid if
    ``user_namespace``."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID
    _libc("unshare", flags | CLONE_NEWUSER if user_namespace else flags)
    if user_namespace:
        for name, line in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(line)
    _libc("prctl", PR_SET_PDEATHSIG, signal.SIGKILL)  # after unshare: a change of credentials clears it


def _fork_grader(results_fd: int, cpu_s: int) -> None:
    """Fork the PID namespace's first process, which forks the grader: that one returns and grades. Each of the
    two above it waits for the one it forked and exits as it did: with its status, 128 + the signal that killed it,
    or :data:`EXIT_CPU` when that was the CPU limit. The grader is not the namespace's first process, which the
    kernel spares every signal it has no handler for: the SIGXCPU of the soft CPU limit among them."""
    for _ in ("the namespace's first process", "the grader"):
        pid = os.fork()
        if pid != 0:
            _exit_as(pid, results_fd, cpu_s)


def _exit_as(pid: int, results_fd: int, cpu_s: int) -> None:
    """Wait for process ``pid`` and exit as it did (:func:`_fork_grader`)."""
    os.close(0)
    os.close(results_fd)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python's handler would let the grader signal this one
    _, status, usage = os.wait4(pid, 0)
    if not os.WIFSIGNALED(status):
        os._exit(os.waitstatus_to_exitcode(status))
    killed_by = os.WTERMSIG(status)
    # SIGXCPU at the soft limit; SIGKILL at the hard one (CPU_GRACE_S later) for a grader that ignores SIGXCPU.
    # The CPU time wait4 reports may fall short of the kernel's own count (by a third under load): it only tells
    # a hard-limit SIGKILL from another one.
    at_cpu_limit = killed_by == signal.SIGXCPU or (
        killed_by == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= cpu_s
    )
    os._exit(EXIT_CPU if at_cpu_limit else 128 + killed_by)


def _host_dirs() -> list[str]:
    """What the interpreter needs to go on: its ``sys.path`` directories and those of its loaded shared
    libraries (from /proc/self/maps), each once (none inside another)."""
    with open("/proc/self/maps") as maps:
        mapped = {line.split(maxsplit=5)[-1].strip() for line in maps if line.count(" ") >= 5}
    libraries = {os.path.dirname(path) for path in mapped if ".so" in os.path.basename(path) and os.path.isfile(path)}
    dirs = sorted({path for path in sys.path if os.path.isdir(path)} | libraries)
    return [d for d in dirs if not any(d.startswith(other + "/") for other in dirs)]


def _build_root(limits: SandboxLimits, owner: tuple[int, int], packages: Sequence[str]) -> None:
    """2. Mount the new root on the working directory (the parent's empty temporary one), with the offered
    ``packages`` (files and folders) under :data:`PACKAGES_DIR`, pivot into it, detach the old one, and go to the
    writable /work (``owner``'s). Every tmpfs caps its inodes (``nr_inodes``, its root folder one of them) as well
    as its bytes."""
    root = os.getcwd()
    os.umask(0o022)  # the service's may be 077 (Settings.prepare_data_dir): the folders made here must be searchable
    host_dirs = _host_dirs()
    masked = [p for d in host_dirs for p in glob.glob(f"{d}/*-packages") + glob.glob(f"{d}/python3*/*-packages")]
    _libc("mount", None, "/", None, MS_REC | MS_PRIVATE, None)
    _libc("mount", "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=755,size=1m,nr_inodes=4096")
    for path in host_dirs:
        os.makedirs(root + path)
        _bind_read_only(path, root + path)
    for path in masked:
        flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
        _libc("mount", "tmpfs", root + path, "tmpfs", flags, "size=4k,nr_inodes=1")
    if packages:
        os.mkdir(root + PACKAGES_DIR)
    for path in packages:
        target = f"{root}{PACKAGES_DIR}/{os.path.basename(path)}"
        if os.path.isdir(path):
            os.mkdir(target)
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))  # a file is bound on a file
        _bind_read_only(path, target)
    for link in ("/lib", "/lib64", "/lib32"):  # the loader's default paths, when the host makes them links
        if os.path.islink(link):
            os.symlink(os.readlink(link), root + link)
    os.mkdir(root + "/work")
    work = f"size={4 * limits.file_bytes},nr_inodes={limits.work_files + 1}"
    _libc("mount", "tmpfs", root + "/work", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, work)
    os.chown(root + "/work", *owner)
    os.chmod(root + "/work", 0o700)
    _libc("mount", None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.chdir(root)
    _libc("pivot_root", ".", ".")  # pivot_root(2): the old root now lies over the new one, until detached
    _libc("umount2", ".", MNT_DETACH)
    os.chdir("/work")


def _bind_read_only(path: str, target: str) -> None:
    """Bind ``path`` (a folder or a file) on ``target``, read-only, without setuid or devices."""
    _libc("mount", path, target, None, MS_BIND, None)
    # a remount in a user namespace must keep the flags it inherited (nosuid, noatime...): statvfs gives them
    kept = os.statvfs(target).f_flag
    _libc("mount", None, target, None, kept | MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def _drop_privileges(user_namespace: bool) -> None:
    """3. Root becomes nobody; in a user namespace, every capability is cleared (capset(2): effective, permitted
    and inheritable, both 32-bit halves). No exec may gain any."""
    if user_namespace:
        cleared = (ctypes.c_uint32 * 6)()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.capset(ctypes.byref(_CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), cleared) != 0:
            raise OSError(ctypes.get_errno(), "capset")
    else:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    _libc("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _libc("prctl", PR_SET_PDEATHSIG, signal.SIGKILL)  # the uid change cleared it


def _set_limits(limits: SandboxLimits) -> None:
    """4. The rlimits (never above the hard limits we were given), soft and hard alike but the CPU's: at its soft
    limit the kernel sends SIGXCPU, which ends the grader (:func:`_fork_grader`), and SIGKILL at its hard limit,
    :data:`CPU_GRACE_S` later. A file over ``file_bytes`` fails its write (EFBIG) rather than killing the
    process."""
    wanted = {
        resource.RLIMIT_CPU: (limits.cpu_s, limits.cpu_s + CPU_GRACE_S),
        resource.RLIMIT_AS: (limits.memory_bytes, limits.memory_bytes),
        resource.RLIMIT_NOFILE: (limits.open_files, limits.open_files),
        resource.RLIMIT_FSIZE: (limits.file_bytes, limits.file_bytes),
        resource.RLIMIT_NPROC: (0, 0),
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, (soft, hard) in wanted.items():
        given = resource.getrlimit(which)[1]
        if given != resource.RLIM_INFINITY:
            soft, hard = min(soft, given), min(hard, given)
        resource.setrlimit(which, (soft, hard))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.signal(signal.SIGXCPU, signal.SIG_DFL)


def _install_audit_hook(refused_events: Sequence[str]) -> None:
    """5. The audit hook: process creation, signals, sockets, ctypes and gc's object walks raise PermissionError.
    The hook closes over its own tuple of the events and over the exception it raises; nothing else refers to it,
    and the interpreter offers no way to remove it."""
    refused, error = tuple(refused_events), PermissionError

    def refuse(event: str, _args: tuple[Any, ...]) -> None:
        if event.startswith(refused):
            raise error(f"{event} is not allowed in a grader")

    sys.addaudithook(refuse)


def _send(fd: int, message: dict[str, Any]) -> None:
    """Write one JSON line to the results pipe."""
    data = json.dumps(message).encode() + b"\n"
    while data:
        data = data[os.write(fd, data) :]


def _run_grader(source: str, calls: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Compile and load ``source``, then call its ``grade`` per call: ``{"scores", "errors"}``, or
    ``{"batch_error"}``. A MemoryError goes up: the batch failed at the memory limit."""
    try:
        code = compile(source, GRADER_FILE, "exec")
    except SyntaxError as exc:
        return {"batch_error": f"the source does not compile: {exc.msg} (line {exc.lineno})"}
    except (ValueError, RecursionError) as exc:
        return {"batch_error": f"the source does not compile: {_describe(exc)}"}
    namespace: dict[str, Any] = {"__name__": "grader"}
    try:
        exec(code, namespace)
    except MemoryError:
        raise
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: all are the source's
        return {"batch_error": f"loading the source failed: {_describe(exc)}"}
    grade = namespace.get("grade")
    if not callable(grade):
        return {"batch_error": "the source defines no grade() function"}
    graded = [_call(grade, sample, item) for sample, item in calls]
    return {"scores": [score for score, _ in graded], "errors": [error for _, error in graded]}


def _call(grade: Any, sample: dict[str, Any], item: dict[str, Any]) -> tuple[float | None, str | None]:
    """One ``grade(sample, item)``: (its score, None), or (None, why it failed)."""
    try:
        value = grade(sample, item)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None, f"grade returned a {type(value).__name__}, not a number"
        score = float(value)
    except MemoryError:
        raise
    except BaseException as exc:
        return None, _describe(exc)
    if not math.isfinite(score):
        return None, f"grade returned {score}, not a finite number"
    return score, None


def _describe(exc: BaseException) -> str:
    """``"ZeroDivisionError: division by zero (line 3)"``: the exception, and the user's line it came from."""
    try:
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except Exception:
        message = type(exc).__name__
    lines = [line for frame, line in traceback.walk_tb(exc.__traceback__) if frame.f_code.co_filename == GRADER_FILE]
    return (message[:MAX_ERROR_CHARS] + (f" (line {lines[-1]})" if lines else ""))[: MAX_ERROR_CHARS + 20]


if __name__ == "__main__":
    _child_main()
