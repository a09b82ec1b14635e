"""Run an untrusted Python program on stdin and judge its stdout, or call one of its functions and
judge the return value (LeetCode-style tests); the code-RL reward's executor.

Each run gets its own interpreter process (`python -I -B -X utf8`) in a fresh temporary directory that
is its cwd, HOME and TMPDIR, with a minimal environment, and the directory is deleted afterwards.
Layers, each useful on its own (Linux only):

* Resource limits (RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE=0, optionally
  RLIMIT_NPROC), set in the child before any of the program's code runs.
* A wall-clock limit: the child leads its own session/process group and the whole group is killed
  with SIGKILL when the time is up, when stdout passes its cap, and after every run.
* Namespaces when the kernel allows them (probed once per process, see `namespace_flags`): a new
  network namespace (no interfaces but a down loopback, so nothing is reachable) and a new pid
  namespace in which the program is PID 1, so the kernel kills anything it started when it ends and
  host processes are invisible to pid-based calls. Without them the run goes on with the other layers.
* In the child: PR_SET_NO_NEW_PRIVS and all capabilities dropped (so a root trainer's sandbox cannot
  mknod devices, chroot, mount, ptrace or raise its limits back).
* A `sys.addaudithook` hook, installed before the program runs (hooks cannot be removed from Python),
  that ends the process with a "blocked" exit code on: process creation (fork, exec, spawn, system,
  subprocess), socket creation/connect/bind and name lookups, ctypes, writing, creating, deleting,
  renaming or chmod-ing anything outside the sandbox directory (paths are judged lexically after
  joining with cwd or `dir_fd`, and symlink/hard-link creation is denied so lexical means real),
  chdir out of it, opening directories outside it with `os.open` (their descriptors could serve as
  `dir_fd`), signalling other processes, tracing/profiling hooks, code-object construction, gc
  introspection and attribute changes on the hook's own functions. Imports of `ctypes`,
  `_posixsubprocess` (its `fork_exec` is not audited), interpreter-test and subinterpreter modules,
  and of non-`.py` files from the sandbox fail with ImportError instead, so libraries that probe for
  them keep working. Reading files is allowed.

Threat model, honestly: this stops accidents and the obvious escapes of a policy model writing
competitive-programming code (rm -rf, stray files, network calls, fork bombs, runaway memory/CPU).
It is not a VM and not a boundary against a determined attacker: CPython's audit hooks are documented
as not being a sandbox, and routes such as bytecode crafted through `marshal` or a planted `.pyc`,
interpreter memory-safety bugs, or the unaudited `os.mknod`/`os.mkfifo` (empty files outside the
sandbox) and `pidfd_open`/`pidfd_send_signal` (signals to same-user processes when no pid namespace is
available) are not closed. Reading is allowed everywhere the trainer's user may read, so a program
could look for the dataset's expected outputs on disk; keep them out of reach if that matters. The
process runs as the trainer's user; run the trainer as an unprivileged
user or in a container if the stakes are higher than reward hacking.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

logger = logging.getLogger(__name__)

STATUSES = ("ok", "timeout", "runtime_error", "memory", "output_limit", "blocked")

PROGRAM_NAME = "solution.py"
BLOCKED_EXIT = 86  # the audit hook ended the program
MEMORY_EXIT = 87  # a MemoryError reached the top level
SETUP_EXIT = 85  # the sandbox itself could not be set up (namespaces, capabilities)
STDERR_TAIL_BYTES = 4096
_POLL_S = 0.05  # how often the leader's exit is checked while its pipes stay open
_REAP_TIMEOUT_S = 5.0

CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
# Tried in order; the user namespace variants serve unprivileged trainers.
_NAMESPACE_CANDIDATES = (
    CLONE_NEWNET | CLONE_NEWPID,
    CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID,
    CLONE_NEWNET,
    CLONE_NEWUSER | CLONE_NEWNET,
)


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


# ----------------------------------------------------------------------------- program and output

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)\n[ \t]*```", re.DOTALL)
_PYTHON_TAGS = frozenset({"python", "python3", "py", "py3"})


def extract_program(response: str) -> str | None:
    """The body of the last closed ```python / ```py block, else of the last untagged ``` block, else None.

    Blocks tagged with another language are ignored; an unclosed (truncated) final block is ignored;
    an empty body counts as no program.
    """
    if not isinstance(response, str):
        return None
    tagged, untagged = None, None
    for match in _FENCE.finditer(response):
        tag, body = match.group(1).lower(), match.group(2)
        if tag in _PYTHON_TAGS:
            tagged = body
        elif not tag:
            untagged = body
    program = tagged if tagged is not None else untagged
    return program if program is not None and program.strip() else None


_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_FLOAT_TOL = 1e-6


def _significant_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _tokens_match(actual: str, expected: str) -> bool:
    """Equal tokens, or decimal numbers (at least one with a point or exponent) within 1e-6 rel/abs.
    Two integer tokens must match exactly, so large integer answers are not accepted by rounding."""
    if actual == expected:
        return True
    if not (_NUMBER.fullmatch(actual) and _NUMBER.fullmatch(expected)):
        return False
    if not any(c in token for token in (actual, expected) for c in ".eE"):
        try:
            return int(actual) == int(expected)
        except ValueError:  # past int()'s digit limit: the texts differ, so call them different
            return False
    a, b = float(actual), float(expected)
    return math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=_FLOAT_TOL, abs_tol=_FLOAT_TOL)


def compare_output(actual: str, expected: str) -> bool:
    """Line by line after stripping trailing whitespace and trailing blank lines; a line that differs
    as text still matches when its whitespace-separated tokens match (see `_tokens_match`)."""
    got, want = _significant_lines(actual), _significant_lines(expected)
    if len(got) != len(want):
        return False
    for line, reference in zip(got, want):
        if line == reference:
            continue
        tokens, reference_tokens = line.split(), reference.split()
        if len(tokens) != len(reference_tokens):
            return False
        if not all(_tokens_match(a, e) for a, e in zip(tokens, reference_tokens)):
            return False
    return True


def _values_match(actual, expected) -> bool:
    """JSON values equal, lists and objects element by element; floats within 1e-6 rel/abs of a number;
    a bool equals only a bool (LeetCode prints `true`, never `1`)."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, list):
        return (isinstance(actual, list) and len(actual) == len(expected)
                and all(_values_match(a, e) for a, e in zip(actual, expected)))
    if isinstance(expected, dict):
        return (isinstance(actual, dict) and actual.keys() == expected.keys()
                and all(_values_match(actual[key], expected[key]) for key in expected))
    numbers = (int, float)
    if isinstance(actual, numbers) and isinstance(expected, numbers) and float in (type(actual), type(expected)):
        return math.isfinite(actual) and math.isfinite(expected) and math.isclose(
            actual, expected, rel_tol=_FLOAT_TOL, abs_tol=_FLOAT_TOL)
    return type(actual) is type(expected) and actual == expected


def compare_json(actual: str, expected: str) -> bool:
    """Whether two JSON texts hold matching values (see `_values_match`); unparsable text never matches."""
    try:
        return _values_match(json.loads(actual), json.loads(expected))
    except (ValueError, RecursionError, OverflowError):  # OverflowError: an int too large for a float
        return False


# Names a call-based program may use without importing them, as on LeetCode's judge (its starter code
# uses `List[int]` and the like without an import). Not `from math import *`: math.pow would shadow
# the built-in three-argument pow.
CALL_PREAMBLE = """\
from typing import *
from collections import *
from heapq import *
from bisect import *
from itertools import *
from functools import *
from math import inf, gcd, lcm, sqrt, isqrt, ceil, floor, comb, perm, factorial, log, log2
import bisect, collections, functools, heapq, itertools, math, operator, re, string
"""


# ----------------------------------------------------------------------------- the child's guard

# Runs as `python -I -B -X utf8 -c _GUARD_SOURCE <config json>` with the sandbox as cwd. The hook's
# functions read nothing but their parameters: every object they use is bound as a default argument
# at creation (tuples, frozensets, str, int and C functions, none of which Python code can alter), and
# setting any attribute (__code__, __defaults__) of those functions is itself denied, so a program
# cannot change the hook's behaviour by monkeypatching modules, builtins or what a frame exposes.
_GUARD_SOURCE = r'''
import sys

CLONE_NEWPID = 0x20000000
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
CAPABILITY_VERSION_3 = 0x20080522

DENIED_EVENTS = frozenset({
    "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "os.startfile",
    "subprocess.Popen", "pty.spawn", "webbrowser.open", "os.killpg",
    "socket.__new__", "socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg",
    "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex", "socket.gethostbyaddr",
    "socket.getnameinfo", "socket.sethostname", "syslog.openlog", "syslog.syslog",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.cdata/buffer",
    "ctypes.call_function", "ctypes.addressof", "ctypes.string_at", "ctypes.wstring_at",
    "code.__new__", "sys.settrace", "sys.setprofile", "gc.get_objects", "gc.get_referrers",
    "gc.get_referents", "cpython.PyInterpreterState_New",
    "os.link", "os.symlink", "fcntl.ioctl",
})
# event -> (path index, dir_fd index or -1) for each path argument that must stay in the sandbox
PATH_EVENTS = (
    ("os.remove", ((0, 1),)), ("os.rmdir", ((0, 1),)), ("os.mkdir", ((0, 2),)),
    ("os.rename", ((0, 2), (1, 3))), ("os.chmod", ((0, 2),)), ("os.chown", ((0, 3),)),
    ("os.utime", ((0, 3),)), ("os.truncate", ((0, -1),)), ("os.setxattr", ((0, -1),)),
    ("os.removexattr", ((0, -1),)), ("os.chdir", ((0, -1),)),
)
WATCHED_EVENTS = DENIED_EVENTS | frozenset(name for name, _ in PATH_EVENTS) | frozenset(
    {"open", "import", "object.__setattr__", "os.kill", "resource.prlimit"})
BLOCKED_MODULES = frozenset({
    "ctypes", "_ctypes", "_ctypes_test", "_posixsubprocess", "_posixshmem", "_multiprocessing",
    "_xxsubinterpreters", "_xxinterpchannels", "_testcapi", "_testinternalcapi", "_testbuffer",
    "_testmultiphase", "_testsinglephase", "_testimportmultiple", "_testclinic", "termios",
})
WRITABLE_OUTSIDE = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr", "/proc/self/fd/1", "/proc/self/fd/2"})


def fail(code, message):
    import os
    os.write(2, ("sandbox: " + message + "\n").encode())
    os._exit(code)


def set_limits(rlimits):
    import resource
    for name, soft, hard in rlimits:
        which = getattr(resource, name)
        current_hard = resource.getrlimit(which)[1]
        if current_hard != resource.RLIM_INFINITY:
            hard = min(hard, current_hard)
            soft = min(soft, hard)
        resource.setrlimit(which, (soft, hard))


def become_pid_one():
    """Fork; the child (PID 1 of the new pid namespace) returns, the parent ends the way it ends."""
    import os, signal
    child = os.fork()
    if child == 0:
        return
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def drop_capabilities(libc, ctypes, setup_exit):
    for cap in range(64):  # EINVAL past the last capability, EPERM without CAP_SETPCAP: both harmless
        libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(cap), ctypes.c_ulong(0),
                   ctypes.c_ulong(0), ctypes.c_ulong(0))
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        fail(setup_exit, "capset failed: errno %d" % ctypes.get_errno())


def isolate(flags, setup_exit):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if flags and libc.unshare(ctypes.c_int(flags)) != 0:
        fail(setup_exit, "unshare failed: errno %d" % ctypes.get_errno())
    if flags & CLONE_NEWPID:
        become_pid_one()
    libc.prctl(ctypes.c_int(PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), ctypes.c_ulong(0),
               ctypes.c_ulong(0), ctypes.c_ulong(0))
    drop_capabilities(libc, ctypes, setup_exit)
    for name in [n for n in sys.modules if n in ("ctypes", "_ctypes") or n.startswith("ctypes.")]:
        del sys.modules[name]


def make_hook(root, blocked_exit):
    """The audit hook for a sandbox rooted at `root` (an absolute, symlink-free path)."""
    import os, posix

    def die(event, _write=posix.write, _exit=posix._exit, _code=blocked_exit, _Error=BaseException):
        try:
            _write(2, b"sandbox: blocked " + event.encode("ascii", "replace") + b"\n")
        except _Error:
            pass
        _exit(_code)

    def resolve(path, dir_fd, _type=type, _str=str, _bytes=bytes, _int=int,
                _getcwd=posix.getcwd, _readlink=posix.readlink):
        """Absolute path as text (a descriptor stands for the file it refers to), or None."""
        kind = _type(path)
        if kind is _int:
            return _readlink("/proc/self/fd/%d" % path)
        if kind is _bytes:
            path = path.decode("utf-8", "surrogateescape")
        elif kind is not _str:
            return None
        if path.startswith("/"):
            return path
        if dir_fd is None or dir_fd == -1:
            return _getcwd() + "/" + path
        if _type(dir_fd) is _int:
            return _readlink("/proc/self/fd/%d" % dir_fd) + "/" + path
        return None

    def inside(path, dir_fd=None, _resolve=resolve, _root=root, _prefix=root + "/", _skip=len(root) + 1):
        """Whether the path names the sandbox or something in it ("..", judged lexically, may not
        climb above the sandbox; lexical is real here because no symlink can be made inside)."""
        full = _resolve(path, dir_fd)
        if full is None or full == _root:
            return full is not None
        if not full.startswith(_prefix):
            return False
        depth = 0
        for part in full[_skip:].split("/"):
            if part == "..":
                depth -= 1
                if depth < 0:
                    return False
            elif part and part != ".":
                depth += 1
        return True

    def check_paths(event, args, _table=PATH_EVENTS, _inside=inside, _die=die):
        for name, positions in _table:
            if name == event:
                for path_at, dir_fd_at in positions:
                    if not _inside(args[path_at], None if dir_fd_at < 0 else args[dir_fd_at]):
                        _die(event)
                return

    def check_open(args, _inside=inside, _die=die, _type=type, _int=int, _str=str, _bytes=bytes,
                   _writing=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                   _devices=WRITABLE_OUTSIDE, _stat=posix.stat, _Error=OSError):
        path, mode, flags = args[0], args[1], args[2]
        kind = _type(path)
        if kind is _int:
            return
        if flags & _writing:
            if not ((kind is _str and path in _devices) or _inside(path)):
                _die("open")
            return
        if mode is None:  # os.open: its descriptor could serve as dir_fd, so no directories outside
            if kind is not _str and kind is not _bytes:
                _die("open")
            try:
                file_type = _stat(path).st_mode & 0o170000
            except _Error:
                return
            if file_type == 0o040000 and not _inside(path):
                _die("open")

    def check_import(args, _type=type, _str=str, _blocked=BLOCKED_MODULES, _inside=inside):
        """None to allow the import, else the ImportError message."""
        name, filename = args[0], args[1]
        if _type(name) is not _str or name.rpartition(".")[2] in _blocked:
            return "sandbox: this module cannot be imported here"
        if _type(filename) is _str and not filename.endswith(".py") and _inside(filename):
            return "sandbox: only .py modules can be imported from the sandbox"
        return None

    def decide(event, args, _denied=DENIED_EVENTS, _die=die, _open=check_open, _import=check_import,
               _paths=check_paths, _pid=posix.getpid()):
        """None to allow, a message to refuse with ImportError; violations end the process."""
        if event in _denied:
            _die(event)
        if event == "import":
            return _import(args)
        if event == "open":
            _open(args)
        elif event == "os.kill":
            if args[0] != _pid:
                _die(event)
        elif event == "resource.prlimit":
            if args[0] != 0 and args[0] != _pid:
                _die(event)
        elif event != "object.__setattr__":
            _paths(event, args)
        return None

    own = frozenset(map(id, (die, resolve, inside, check_paths, check_open, check_import, decide)))

    def hook(event, args, _watched=WATCHED_EVENTS, _decide=decide, _die=die, _own=own, _id=id,
             _Refusal=ImportError, _Error=BaseException):
        """Any error while judging ends the process; a refusal is raised from a frame whose locals
        were deleted, so its traceback exposes none of the hook's functions."""
        if event not in _watched:
            return
        try:
            if event == "object.__setattr__" and _id(args[0]) in _own:
                _die(event)
            refusal = _decide(event, args)
        except _Error:
            _die(event)
        if refusal is None:
            return
        error = _Refusal
        del _watched, _decide, _die, _own, _id, _Refusal, _Error
        raise error(refusal)

    return hook


def write_all(fd, data):
    import os
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def call_function(module, name, arguments):
    """`Solution().<name>(*arguments)` when the program defines class Solution, else `<name>(*arguments)`."""
    solution = module.__dict__.get("Solution")
    function = getattr(solution(), name, None) if isinstance(solution, type) else module.__dict__.get(name)
    if not callable(function):
        raise NameError("the program defines no callable %r" % name)
    return function(*arguments)


def run_program(config):
    """Run the program as __main__ on stdin; in call mode, import it as a module (its __main__ block
    does not run), call config["call"] with the JSON argument list read from stdin before the program
    starts (the program sees an empty stdin), and write the return value as JSON to the original
    stdout, while the program's own prints go to stderr."""
    import builtins, json, os, types
    root = os.getcwd()
    name, call = config["program"], config["call"]
    with open(name, "rb") as handle:
        source = handle.read()
    code = compile(source, name, "exec", dont_inherit=True)
    module = types.ModuleType("__main__" if call is None else "solution")
    module.__file__ = root + "/" + name
    module.__builtins__ = builtins
    sys.modules[module.__name__] = module
    sys.argv = [name]
    if call is not None:
        arguments = json.loads(sys.stdin.buffer.read())
        result_fd = os.dup(1)
        os.dup2(2, 1)
        exec(config["preamble"], module.__dict__)
    if config["audit_hook"]:
        sys.addaudithook(make_hook(root, config["blocked_exit"]))
    try:
        exec(code, module.__dict__)
        if call is not None:
            write_all(result_fd, json.dumps(call_function(module, call, arguments)).encode())
    except MemoryError:
        os.write(2, b"MemoryError\n")
        os._exit(config["memory_exit"])


def main():
    import json
    config = json.loads(sys.argv[1])
    set_limits(config["rlimits"])
    isolate(config["unshare"], config["setup_exit"])
    run_program(config)


if __name__ == "__main__":
    main()
'''

_NAMESPACE_PROBE = r"""
import ctypes, os, sys
flags = int(sys.argv[1])
if ctypes.CDLL(None, use_errno=True).unshare(ctypes.c_int(flags)) != 0:
    sys.exit(1)
if flags & 0x20000000:
    child = os.fork()
    if child == 0:
        os._exit(0 if os.getpid() == 1 else 1)
    sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
"""


# ----------------------------------------------------------------------------- the parent side

def _python() -> str:
    return sys.executable or shutil.which("python3") or "python3"


@lru_cache(maxsize=1)
def namespace_flags() -> int:
    """The unshare(2) flags sandboxes use on this machine: the first of `_NAMESPACE_CANDIDATES` a
    throwaway child could enter, probed once per process; 0 when none works (non-Linux, seccomp, no
    privileges and no user namespaces). Never raises."""
    if not sys.platform.startswith("linux"):
        return 0
    for flags in _NAMESPACE_CANDIDATES:
        try:
            probe = subprocess.run([_python(), "-I", "-c", _NAMESPACE_PROBE, str(flags)], env={},
                                   stdin=subprocess.DEVNULL, capture_output=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return flags
    logger.warning("code sandbox: no network/pid namespace available; relying on the audit hook")
    return 0


def network_isolation_available() -> bool:
    """Whether sandboxes get a fresh network namespace on this machine."""
    return bool(namespace_flags() & CLONE_NEWNET)


@dataclass
class _Execution:
    returncode: int | None
    stdout: bytes
    stderr_tail: bytes
    timed_out: bool
    output_exceeded: bool
    wall_time_s: float


def _leader_exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its pid, hence its group id, stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Pipes:
    """Feeds stdin and collects stdout (capped) and the stderr tail through one selector."""

    def __init__(self, proc: subprocess.Popen, stdin: bytes, max_output_bytes: int):
        self.stdout, self.stderr = bytearray(), bytearray()
        self.cap = max_output_bytes
        self.pending = memoryview(stdin)
        self.selector = selectors.DefaultSelector()
        self.proc = proc
        for stream in (proc.stdout, proc.stderr):
            os.set_blocking(stream.fileno(), False)
            self.selector.register(stream, selectors.EVENT_READ)
        if self.pending:
            os.set_blocking(proc.stdin.fileno(), False)
            self.selector.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()

    @property
    def exceeded(self) -> bool:
        return len(self.stdout) > self.cap

    def reading(self) -> bool:
        return any(key.events & selectors.EVENT_READ for key in self.selector.get_map().values())

    def pump(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            if key.fileobj is self.proc.stdin:
                self._feed()
            else:
                self._read(key.fileobj)

    def drain(self) -> None:
        """Read whatever is already buffered in the output pipes, without waiting."""
        registered = [key.fileobj for key in self.selector.get_map().values()]
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream in registered:
                while self._read(stream) and not self.exceeded:
                    pass

    def close(self) -> None:
        self.selector.close()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except OSError:
                pass

    def _feed(self) -> None:
        try:
            written = os.write(self.proc.stdin.fileno(), self.pending[:1 << 16])
        except BlockingIOError:
            return
        except OSError:  # the program closed stdin or exited
            written = len(self.pending)
        self.pending = self.pending[written:]
        if not self.pending:
            self.selector.unregister(self.proc.stdin)
            self.proc.stdin.close()

    def _read(self, stream) -> bool:
        """One read; False at EOF or when nothing is buffered."""
        try:
            chunk = os.read(stream.fileno(), 1 << 16)
        except BlockingIOError:
            return False
        if not chunk:
            self.selector.unregister(stream)
            return False
        if stream is self.proc.stdout:
            self.stdout += chunk
        else:
            self.stderr += chunk
            del self.stderr[:-STDERR_TAIL_BYTES]
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


def _pump_until_done(pipes: _Pipes, pid: int, deadline: float) -> tuple[bool, bool]:
    """(timed_out, output_exceeded). Returns once the leader has exited and its output is read (a
    left-over process may still hold the pipes), at the deadline, or when stdout passes the cap."""
    while pipes.reading():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return True, False
        pipes.pump(min(remaining, _POLL_S))
        if pipes.exceeded:
            return False, True
        if _leader_exited(pid):
            pipes.drain()
            return False, pipes.exceeded
    return _await_exit(pid, deadline), False


def _execute(argv: list[str], stdin: bytes, *, cwd: str, env: dict[str, str], time_limit_s: float,
             max_output_bytes: int) -> _Execution:
    """Run argv as the leader of a new session; kill the whole group when done, whatever happened."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=cwd, env=env, start_new_session=True, close_fds=True, bufsize=0)
    pipes = _Pipes(proc, stdin, max_output_bytes)
    try:
        timed_out, exceeded = _pump_until_done(pipes, proc.pid, start + time_limit_s)
    finally:
        _kill_group(proc.pid)  # before reaping, so the group id cannot have been reused
        pipes.close()
        try:
            proc.wait(timeout=_REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("code sandbox: pid %d did not exit after SIGKILL", proc.pid)
    return _Execution(returncode=proc.returncode, stdout=bytes(pipes.stdout[:max_output_bytes]),
                      stderr_tail=bytes(pipes.stderr[-STDERR_TAIL_BYTES:]), timed_out=timed_out,
                      output_exceeded=exceeded, wall_time_s=time.monotonic() - start)


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


def _classify(run: _Execution) -> str:
    if run.output_exceeded:
        return "output_limit"
    if run.timed_out or run.returncode == -signal.SIGXCPU:
        return "timeout"
    return {0: "ok", BLOCKED_EXIT: "blocked", MEMORY_EXIT: "memory"}.get(run.returncode, "runtime_error")


def _run_guarded(program: str, stdin: str, limits: SandboxLimits, *, call: str | None = None,
                 audit_hook: bool = True) -> RunResult:
    """run_program's body; `audit_hook=False` exists only to test the other layers on their own."""
    workdir = tempfile.mkdtemp(prefix="growmtp-sbx-")
    try:
        with open(os.path.join(workdir, PROGRAM_NAME), "w", encoding="utf-8", errors="replace") as handle:
            handle.write(program)
        config = {"program": PROGRAM_NAME, "rlimits": _rlimits(limits), "audit_hook": audit_hook,
                  "call": call, "preamble": CALL_PREAMBLE,
                  "unshare": namespace_flags() if limits.isolate_namespaces else 0,
                  "blocked_exit": BLOCKED_EXIT, "memory_exit": MEMORY_EXIT, "setup_exit": SETUP_EXIT}
        argv = [_python(), "-I", "-B", "-X", "utf8", "-c", _GUARD_SOURCE, json.dumps(config)]
        run = _execute(argv, stdin.encode("utf-8", errors="replace"), cwd=workdir, env=_child_env(workdir),
                       time_limit_s=limits.time_limit_s, max_output_bytes=limits.max_output_bytes)
    finally:
        _remove_tree(workdir)
    if run.returncode == SETUP_EXIT:
        logger.warning("code sandbox: exit %d, the sandbox setup may have failed: %s", SETUP_EXIT,
                       run.stderr_tail[-300:].decode("utf-8", errors="replace"))
    return RunResult(status=_classify(run), stdout=run.stdout.decode("utf-8", errors="replace"),
                     stderr=run.stderr_tail.decode("utf-8", errors="replace"),
                     wall_time_s=run.wall_time_s, returncode=run.returncode)


def run_program(program: str, stdin: str, limits: SandboxLimits | None = None, *, call: str | None = None
                ) -> RunResult:
    """Run `program` as __main__ with `stdin`, inside the sandbox described in the module docstring.

    With `call` (a function name; LeetCode's call-based tests), `stdin` is a JSON array of arguments:
    the program is imported as a module after CALL_PREAMBLE, `Solution().<call>(*arguments)` is called
    (`<call>(*arguments)` when there is no class Solution) and `stdout` is the JSON of its return value
    (tuples become lists); the program's own prints go to stderr, and a value JSON cannot encode is a
    runtime error.

    Guarantees: the call returns within about the time limit plus interpreter start-up (the process
    group is SIGKILLed at the deadline), the temporary directory is removed, and every process of the
    group is killed before returning. Raises only if the sandbox cannot be started at all (OSError
    from creating the directory or the process); `score_program` turns that into 0.0.
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
