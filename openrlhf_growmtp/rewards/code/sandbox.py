"""Run an untrusted Python program on stdin and judge its stdout, or call one of its functions and judge
the return value (LeetCode-style tests); the code reward's executor.

Each run is `python -I -B -X utf8 sandbox_child.py <config>` in a fresh temporary directory (its cwd, HOME
and TMPDIR; deleted afterwards) with a minimal environment. Layers, each useful on its own (Linux only):
resource limits set before the program runs; a wall-clock limit, after which (and after every run, and
once stdout passes its cap) the whole process group is SIGKILLed; network and pid namespaces where the
kernel allows them (`namespace_flags`); no new privileges and no capabilities; and an audit hook
(`sandbox_child.make_hook`) that ends the program on process creation, sockets, ctypes, changes outside
the sandbox directory, signals to other processes, tracing and gc introspection, and on reading or listing
anything but its directory, the interpreter's import path and the time-zone database
(`sandbox_child.readable_roots`): not the prompt dataset, whose labels hold the expected outputs, nor
/proc, where other processes' command lines and environments are. Its environment is a minimal one.

Threat model, honestly: this stops accidents and the obvious escapes of a policy model writing
competitive-programming code (rm -rf, stray files, network calls, fork bombs, runaway memory/CPU). It is
not a VM: CPython's audit hooks are documented as not being a sandbox; crafted bytecode (`marshal`, a
planted `.pyc`), interpreter memory-safety bugs, the unaudited `os.mknod`/`os.mkfifo` and
`pidfd_send_signal` (without a pid namespace) stay open, and so do reads by C code that is not audited (a
C extension in site-packages opening a file itself). Run the trainer unprivileged or in a container if the
stakes are higher than reward hacking.
"""

from __future__ import annotations

import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from openrlhf_growmtp.rewards.code.judge import compare_json, compare_output
from openrlhf_growmtp.rewards.code.sandbox_child import BLOCKED_EXIT, MEMORY_EXIT, SETUP_EXIT

logger = logging.getLogger(__name__)

STATUSES = ("ok", "timeout", "runtime_error", "memory", "output_limit", "blocked")
PROGRAM_NAME = "solution.py"
CHILD = str(Path(__file__).resolve().with_name("sandbox_child.py"))
STDERR_TAIL_BYTES = 4096
_POLL_S = 0.05  # how often the leader's exit is checked while its pipes stay open
_REAP_TIMEOUT_S = 5.0
# unshare(2) flags, tried in order; the user-namespace variants serve unprivileged trainers
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_NAMESPACE_CANDIDATES = (CLONE_NEWNET | CLONE_NEWPID, CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID,
                         CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET)


@dataclass(frozen=True)
class SandboxLimits:
    """Per-test limits. `max_processes` (RLIMIT_NPROC) counts every process and thread of the user,
    trainer included, so it is off by default; forks are blocked by the audit hook anyway.
    `isolate_namespaces=False` skips the network/pid namespaces even where they are available."""

    time_limit_s: float = 6.0
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20
    max_file_bytes: int = 8 << 20
    max_open_files: int = 64
    max_processes: int | None = None
    isolate_namespaces: bool = True


@dataclass(frozen=True)
class RunResult:
    """The outcome of one run: `status` is one of STATUSES; `stdout` is capped at the limit;
    `stderr` is its last STDERR_TAIL_BYTES; `returncode` is negative for a signal, None if unknown."""

    status: str
    stdout: str
    stderr: str
    wall_time_s: float
    returncode: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _python() -> str:
    return sys.executable or shutil.which("python3") or "python3"


@lru_cache(maxsize=1)
def namespace_flags() -> int:
    """The unshare(2) flags sandboxes use here: the first candidate a throwaway child could enter, probed
    once per process; 0 when none works (non-Linux, seccomp, no privileges, no user namespaces)."""
    if not sys.platform.startswith("linux"):
        return 0
    for flags in _NAMESPACE_CANDIDATES:
        try:
            probe = subprocess.run([_python(), "-I", CHILD, "--probe", str(flags)], env={},
                                   stdin=subprocess.DEVNULL, capture_output=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return flags
    logger.warning("code sandbox: no network/pid namespace available; relying on the audit hook")
    return 0


def _leader_exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its pid, hence its group id, stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _await_exit(pid: int, deadline: float) -> bool:
    """Wait, without reaping, for the leader to exit; True when the deadline came first."""
    pause = 0.001
    while not _leader_exited(pid):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return True
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, _POLL_S)
    return False


def _collect(proc: subprocess.Popen, deadline: float, max_output_bytes: int) -> tuple[bytes, bytes, bool, bool]:
    """(stdout, stderr tail, timed_out, output_exceeded). Reads until the leader has exited and its output
    is read (a left-over process may still hold the pipes), the deadline, or stdout passing the cap."""
    out, err = bytearray(), bytearray()
    selector = selectors.DefaultSelector()  # epoll: a trainer may hold more than FD_SETSIZE descriptors
    selector.register(proc.stdout, selectors.EVENT_READ, out)
    selector.register(proc.stderr, selectors.EVENT_READ, err)
    try:
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return out, err, True, False
            exited = _leader_exited(proc.pid)  # before reading, so all it wrote is read below
            ready = selector.select(0 if exited else min(remaining, _POLL_S))
            for key, _ in ready:
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                key.data.extend(chunk)
            del err[:-STDERR_TAIL_BYTES]
            if len(out) > max_output_bytes:
                return out, err, False, True
            if exited and not ready:
                return out, err, False, False
        return out, err, _await_exit(proc.pid, deadline), False
    finally:
        selector.close()


def _status(returncode: int | None, timed_out: bool, output_exceeded: bool) -> str:
    if output_exceeded:
        return "output_limit"
    if timed_out or returncode == -signal.SIGXCPU:
        return "timeout"
    return {0: "ok", BLOCKED_EXIT: "blocked", MEMORY_EXIT: "memory"}.get(returncode, "runtime_error")


def _execute(argv: list[str], stdin: bytes, *, cwd: str, env: dict[str, str], time_limit_s: float,
             max_output_bytes: int) -> RunResult:
    """Run argv as the leader of a new session; kill the whole group when done, whatever happened."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as stdin_file:  # a file, not a pipe: nothing to feed while reading
        stdin_file.write(stdin)
        stdin_file.seek(0)
        proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=cwd, env=env, start_new_session=True, close_fds=True, bufsize=0)
    try:
        out, err, timed_out, exceeded = _collect(proc, start + time_limit_s, max_output_bytes)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # before reaping, so the group id cannot have been reused
        except (ProcessLookupError, PermissionError):
            pass
        proc.stdout.close()
        proc.stderr.close()
        try:
            proc.wait(timeout=_REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("code sandbox: pid %d did not exit after SIGKILL", proc.pid)
    return RunResult(_status(proc.returncode, timed_out, exceeded), out[:max_output_bytes].decode("utf-8", "replace"),
                     err.decode("utf-8", "replace"), time.monotonic() - start, proc.returncode)


def _rlimits(limits: SandboxLimits) -> list[tuple[str, int, int]]:
    cpu = max(1, math.ceil(limits.time_limit_s)) + 1
    memory = int(limits.memory_mb) << 20
    pairs = [("RLIMIT_AS", memory, memory), ("RLIMIT_CPU", cpu, cpu + 1),
             ("RLIMIT_FSIZE", limits.max_file_bytes, limits.max_file_bytes),
             ("RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files), ("RLIMIT_CORE", 0, 0)]
    if limits.max_processes is not None:
        pairs.append(("RLIMIT_NPROC", limits.max_processes, limits.max_processes))
    return pairs


def _child_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(function, target, _exc_info):
        try:
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
            function(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)


def _run_guarded(program: str, stdin: str, limits: SandboxLimits, *, call: str | None = None,
                 audit_hook: bool = True) -> RunResult:
    """run_program's body; `audit_hook=False` exists only to test the other layers on their own."""
    workdir = tempfile.mkdtemp(prefix="growmtp-sbx-")
    try:
        with open(os.path.join(workdir, PROGRAM_NAME), "w", encoding="utf-8", errors="replace") as handle:
            handle.write(program)
        config = {"program": PROGRAM_NAME, "call": call, "rlimits": _rlimits(limits), "audit_hook": audit_hook,
                  "unshare": namespace_flags() if limits.isolate_namespaces else 0}
        run = _execute([_python(), "-I", "-B", "-X", "utf8", CHILD, json.dumps(config)],
                       stdin.encode("utf-8", errors="replace"), cwd=workdir, env=_child_env(workdir),
                       time_limit_s=limits.time_limit_s, max_output_bytes=limits.max_output_bytes)
    finally:
        _remove_tree(workdir)
    if run.returncode == SETUP_EXIT:
        logger.warning("code sandbox: exit %d, the sandbox setup may have failed: %s", SETUP_EXIT, run.stderr[-300:])
    return run


def run_program(program: str, stdin: str, limits: SandboxLimits | None = None, *, call: str | None = None
                ) -> RunResult:
    """Run `program` as __main__ with `stdin`, inside the sandbox described in the module docstring.

    With `call` (a function name; LeetCode's call-based tests), `stdin` is a JSON array of arguments: the
    program is imported after `sandbox_child.CALL_PREAMBLE`, `Solution().<call>(*arguments)` (or
    `<call>(*arguments)` without a class Solution) is called, and `stdout` is the JSON of its return value;
    the program's own prints go to stderr, and a value JSON cannot encode is a runtime error.

    Returns within about the time limit plus interpreter start-up, with the directory removed and every
    process of the group killed. Raises only if the sandbox cannot start (OSError creating the directory
    or the process); `score_program` turns that into 0.0.
    """
    return _run_guarded(program, stdin, limits or SandboxLimits(), call=call)


def score_program(program: str | None, tests: list[tuple[str, str]], limits: SandboxLimits | None = None,
                  *, call: str | None = None) -> float:
    """1.0 when the program's run on every (stdin, expected stdout) test is "ok" and its output matches
    (`compare_output`), else 0.0; stops at the first failure. With `call`, each test is (JSON argument
    array, JSON of the expected return value), judged by `compare_json` (see `run_program`). No program
    or no tests scores 0.0. Never raises (an unexpected error is logged and scores 0.0)."""
    compare = compare_output if call is None else compare_json
    try:
        if not program or not tests:
            return 0.0
        for stdin, expected in tests:
            result = run_program(program, stdin, limits, call=call)
            if not result.ok or not compare(result.stdout, expected):
                return 0.0
        return 1.0
    except Exception:
        logger.warning("code sandbox: scoring failed", exc_info=True)
        return 0.0
