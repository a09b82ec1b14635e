"""The sandbox's child: sets up limits, isolation and the audit hook, then runs the untrusted program.

`sandbox` runs it as `python -I -B -X utf8 <this file> <config json>` in the sandbox directory (`-I`: no
PYTHONPATH, user site or script directory on sys.path), or with `--probe <flags>` to test unshare(2).
Standard library only, imported inside functions, so importing this module (the tests do) runs nothing.

The hook's functions read nothing but their parameters: every object they use is bound as a default
argument at creation (tuples, frozensets, str, int and C functions, none of which Python code can alter),
and setting any attribute (__code__, __defaults__) of those functions is itself denied, so a program
cannot change the hook's behaviour by monkeypatching modules, builtins or what a frame exposes.
"""

import sys

BLOCKED_EXIT = 86  # the audit hook ended the program
MEMORY_EXIT = 87  # a MemoryError reached the top level
SETUP_EXIT = 85  # the sandbox itself could not be set up (namespaces, capabilities)

CLONE_NEWPID = 0x20000000
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
CAPABILITY_VERSION_3 = 0x20080522

DENIED_EVENTS = frozenset({
    "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "os.startfile", "subprocess.Popen",
    "pty.spawn", "webbrowser.open", "os.killpg", "socket.__new__", "socket.bind", "socket.connect", "socket.sendto",
    "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex", "socket.gethostbyaddr",
    "socket.getnameinfo", "socket.sethostname", "syslog.openlog", "syslog.syslog", "ctypes.dlopen", "ctypes.dlsym",
    "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.cdata/buffer", "ctypes.call_function", "ctypes.addressof",
    "ctypes.string_at", "ctypes.wstring_at", "code.__new__", "sys.settrace", "sys.setprofile", "gc.get_objects",
    "gc.get_referrers", "gc.get_referents", "cpython.PyInterpreterState_New", "os.link", "os.symlink", "fcntl.ioctl",
})
# event -> (path index, dir_fd index or -1) for each path argument that must stay in the sandbox
PATH_EVENTS = (
    ("os.remove", ((0, 1),)), ("os.rmdir", ((0, 1),)), ("os.mkdir", ((0, 2),)), ("os.rename", ((0, 2), (1, 3))),
    ("os.chmod", ((0, 2),)), ("os.chown", ((0, 3),)), ("os.utime", ((0, 3),)), ("os.truncate", ((0, -1),)),
    ("os.setxattr", ((0, -1),)), ("os.removexattr", ((0, -1),)), ("os.chdir", ((0, -1),)),
)
LISTING_EVENTS = ("os.listdir", "os.scandir")  # their path argument must be readable
WATCHED_EVENTS = DENIED_EVENTS | frozenset(name for name, _ in PATH_EVENTS) | frozenset(
    {"open", "import", "object.__setattr__", "os.kill", "resource.prlimit", *LISTING_EVENTS})
# imported by name they fail with ImportError, so libraries that probe for them keep working
BLOCKED_MODULES = frozenset({
    "ctypes", "_ctypes", "_ctypes_test", "_posixsubprocess", "_posixshmem", "_multiprocessing", "_xxsubinterpreters",
    "_xxinterpchannels", "_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase", "_testsinglephase",
    "_testimportmultiple", "_testclinic", "termios", "sqlite3", "_sqlite3", "_dbm", "_gdbm", "readline",
})
WRITABLE_OUTSIDE = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr", "/proc/self/fd/1", "/proc/self/fd/2"})
READABLE_OUTSIDE = frozenset({"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/stdin"})
# Besides the interpreter's import path, the one directory of data a program may read (zoneinfo's).
READABLE_ROOTS = ("/usr/share/zoneinfo",)

# Names a call-based program may use without importing them, as on LeetCode's judge (its starter code
# uses `List[int]` and the like without an import). Not `from math import *`: math.pow would shadow
# the built-in three-argument pow.
CALL_PREAMBLE = (
    "from typing import *\nfrom collections import *\nfrom heapq import *\nfrom bisect import *\n"
    "from itertools import *\nfrom functools import *\n"
    "from math import inf, gcd, lcm, sqrt, isqrt, ceil, floor, comb, perm, factorial, log, log2\n"
    "import bisect, collections, functools, heapq, itertools, math, operator, re, string\n")


def fail(code, message):
    import os
    os.write(2, ("sandbox: " + message + "\n").encode())
    os._exit(code)


def set_limits(rlimits):
    """setrlimit for each [name, soft, hard], never above a hard limit the parent already had."""
    import resource
    for name, soft, hard in rlimits:
        which = getattr(resource, name)
        current_hard = resource.getrlimit(which)[1]
        if current_hard != resource.RLIM_INFINITY:
            hard = min(hard, current_hard)
            soft = min(soft, hard)
        resource.setrlimit(which, (soft, hard))


def unshare(flags):
    """unshare(2) through libc; returns libc and a `prctl(option, arg)` for the caller's further calls."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if flags and libc.unshare(ctypes.c_int(flags)) != 0:
        fail(SETUP_EXIT, "unshare failed: errno %d" % ctypes.get_errno())
    return libc, lambda option, arg: libc.prctl(ctypes.c_int(option), *map(ctypes.c_ulong, (arg, 0, 0, 0)))


def become_pid_one():
    """Fork; the child (PID 1 of the new pid namespace) returns, the parent ends the way it ends."""
    import os
    import signal
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


def isolate(flags):
    """Enter the namespaces, forbid privilege gains, drop every capability, then forget ctypes."""
    import ctypes
    libc, prctl = unshare(flags)
    if flags & CLONE_NEWPID:
        become_pid_one()
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    for cap in range(64):  # EINVAL past the last capability, EPERM without CAP_SETPCAP: both harmless
        prctl(PR_CAPBSET_DROP, cap)
    if libc.capset((ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0), (ctypes.c_uint32 * 6)()) != 0:
        fail(SETUP_EXIT, "capset failed: errno %d" % ctypes.get_errno())
    for name in [n for n in sys.modules if n in ("ctypes", "_ctypes") or n.startswith("ctypes.")]:
        del sys.modules[name]


def probe(flags):
    """Exit status 0 when this process could enter the namespaces (and be PID 1 in a new pid namespace)."""
    import os
    unshare(flags)
    if not flags & CLONE_NEWPID:
        return 0
    child = os.fork()
    if child == 0:
        os._exit(0 if os.getpid() == 1 else 1)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


def readable_roots():
    """Where a program may read outside its directory: this interpreter's import path (the standard library,
    its extension modules, site-packages; under `-I` nothing else), READABLE_ROOTS, and this file (a traceback
    quotes it). Not the trainer's files: a policy that could read the prompt dataset (its labels hold the
    expected outputs) or another process's command line or environment under /proc could print the answer
    instead of computing it."""
    import os
    return tuple(os.path.abspath(path) for path in sys.path if path) + READABLE_ROOTS + (os.path.abspath(__file__),)


def make_judge(root, read_roots=()):
    """`decide(event, args)` for a sandbox rooted at `root` (absolute, symlink-free) whose programs may also
    read under `read_roots` (trusted install directories): None allows the event, a string refuses an import
    with that ImportError message, and any exception (PermissionError for a violation) ends the process.
    Returns decide and every function it uses."""
    import os
    import posix

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

    def within(full, top, _len=len):
        """Whether the absolute path `full` names `top` or something in it ("..", judged lexically, may not
        climb above it; lexical is real in the sandbox, where no symlink can be made)."""
        if full == top:
            return True
        prefix = top.rstrip("/") + "/"
        if not full.startswith(prefix):
            return False
        depth = 0
        for part in full[_len(prefix):].split("/"):
            if part == "..":
                depth -= 1
                if depth < 0:
                    return False
            elif part and part != ".":
                depth += 1
        return True

    def inside(path, dir_fd=None, _resolve=resolve, _within=within, _root=root):
        """Whether the path names the sandbox or something in it."""
        full = _resolve(path, dir_fd)
        return full is not None and _within(full, _root)

    def readable(path, _resolve=resolve, _within=within, _roots=(root,) + tuple(read_roots),
                 _devices=READABLE_OUTSIDE):
        """Whether the path may be read or listed: in the sandbox, under a read root, or a harmless device."""
        full = _resolve(path, None)
        if full is None:
            return False
        if full in _devices:
            return True
        for top in _roots:
            if _within(full, top):
                return True
        return False

    def check_paths(event, args, _table=PATH_EVENTS, _inside=inside, _Violation=PermissionError):
        for name, positions in _table:
            if name == event:
                for path_at, dir_fd_at in positions:
                    if not _inside(args[path_at], None if dir_fd_at < 0 else args[dir_fd_at]):
                        raise _Violation(event)
                return

    def check_open(args, _inside=inside, _readable=readable, _type=type, _int=int, _str=str,
                   _writing=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                   _devices=WRITABLE_OUTSIDE, _Violation=PermissionError):
        """Writing in the sandbox only; reading there and under the read roots (a directory opened there may
        serve as a dir_fd: a relative path is judged against the cwd, so it cannot climb out of it either)."""
        path, flags = args[0], args[2]
        kind = _type(path)
        if kind is _int:
            return
        if flags & _writing:
            if not ((kind is _str and path in _devices) or _inside(path)):
                raise _Violation("open")
        elif not _readable(path):
            raise _Violation("open")

    def check_import(args, _type=type, _str=str, _blocked=BLOCKED_MODULES, _inside=inside):
        name, filename = args[0], args[1]
        if _type(name) is not _str or name.rpartition(".")[2] in _blocked:
            return "sandbox: this module cannot be imported here"
        if _type(filename) is _str and not filename.endswith(".py") and _inside(filename):
            return "sandbox: only .py modules can be imported from the sandbox"
        return None

    def decide(event, args, _denied=DENIED_EVENTS, _open=check_open, _import=check_import,
               _paths=check_paths, _readable=readable, _listing=LISTING_EVENTS, _type=type, _int=int,
               _pid=posix.getpid(), _Violation=PermissionError):
        if event in _denied:
            raise _Violation(event)
        if event == "import":
            return _import(args)
        if event == "open":
            _open(args)
        elif event in _listing:
            if args[0] is not None and _type(args[0]) is not _int and not _readable(args[0]):
                raise _Violation(event)
        elif event == "os.kill":
            if args[0] != _pid:
                raise _Violation(event)
        elif event == "resource.prlimit":
            if args[0] != 0 and args[0] != _pid:
                raise _Violation(event)
        elif event != "object.__setattr__":
            _paths(event, args)
        return None

    return decide, (resolve, within, inside, readable, check_paths, check_open, check_import, decide)


def make_hook(root, blocked_exit=BLOCKED_EXIT, read_roots=()):
    """The audit hook: `make_judge(root, read_roots)`'s decisions, ending the process with `blocked_exit` on a
    violation."""
    import posix
    decide, judges = make_judge(root, read_roots)

    def die(event, _write=posix.write, _exit=posix._exit, _code=blocked_exit, _Error=BaseException):
        try:
            _write(2, b"sandbox: blocked " + event.encode("ascii", "replace") + b"\n")
        except _Error:
            pass
        _exit(_code)

    own = frozenset(map(id, judges + (die,)))

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
    import builtins
    import json
    import os
    import types
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
        exec(CALL_PREAMBLE, module.__dict__)
    if config["audit_hook"]:
        sys.addaudithook(make_hook(root, read_roots=readable_roots()))
    try:
        exec(code, module.__dict__)
        if call is not None:
            with open(result_fd, "wb") as result:  # buffered: writes it all however the pipe splits it
                result.write(json.dumps(call_function(module, call, arguments)).encode())
    except MemoryError:
        os.write(2, b"MemoryError\n")
        os._exit(MEMORY_EXIT)


def main():
    if sys.argv[1] == "--probe":
        sys.exit(probe(int(sys.argv[2])))
    import json
    config = json.loads(sys.argv[1])
    set_limits(config["rlimits"])
    isolate(config["unshare"])
    run_program(config)


if __name__ == "__main__":
    main()
