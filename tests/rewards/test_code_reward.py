"""The code-execution reward: judging, limits, and that sandboxed programs leave nothing behind."""

from __future__ import annotations

import ast
import dis
import importlib.util
import json
import os
import socket
import sys
import time
import types
import uuid
from dataclasses import replace

import pytest
import torch

import openrlhf_growmtp.rewards
from openrlhf_growmtp.data import loaders
from openrlhf_growmtp.rewards.code import sandbox, sandbox_child
from openrlhf_growmtp.rewards.code.judge import compare_json, compare_output, extract_program
from openrlhf_growmtp.rewards.code.label import code_label, parse_label
from openrlhf_growmtp.rewards.code.sandbox import SandboxLimits, run_program, score_program
from openrlhf_growmtp.rewards.code_reward import TIME_LIMIT_ENV, reward_func

FAST = SandboxLimits(time_limit_s=5.0)  # generous, for programs that should finish (the machine may be busy)
TIGHT = SandboxLimits(time_limit_s=1.0)  # for programs that should not
HOOK_ONLY = replace(FAST, isolate_namespaces=False)  # the audit hook without the namespaces behind it
SUM = "a, b = map(int, input().split())\nprint(a + b)\n"


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_dead(pid: int, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return not _alive(pid)


# ----------------------------------------------------------------------------- extraction, comparison

def test_extract_program_takes_last_python_block():
    response = ("Try this:\n```python\nprint(1)\n```\nbetter:\n```py\nprint(2)\n```\n"
                "sample output:\n```\n2\n```\nand in C:\n```cpp\nint main(){}\n```\n")
    assert extract_program(response) == "print(2)"
    assert extract_program("```\nprint(3)\n```") == "print(3)"
    assert extract_program("no code here") is None
    assert extract_program("```python\nprint(4)\n") is None  # truncated, never closed
    assert extract_program("```cpp\nint main(){}\n```") is None


def test_compare_output_tolerances():
    assert compare_output("5  \n\n\n", "5")
    assert compare_output("1 2\r\n3\n", "1 2\n3")
    assert compare_output("0.3333333333\n", "0.333333")
    assert compare_output("1e-9", "0.0")
    assert not compare_output("0.3334", "0.3333")
    assert not compare_output("123456789012345678", "123456789012345679")  # integers stay exact
    assert not compare_output("5\n6", "5")
    assert not compare_output("", "5")
    assert not compare_output("abc", "abd")


# ----------------------------------------------------------------------------- judging

def test_correct_program_scores_one():
    assert score_program(SUM, [("2 3\n", "5\n"), ("10 -4", "6")], FAST) == 1.0


def test_wrong_output_scores_zero():
    assert score_program(SUM, [("2 3\n", "5\n"), ("1 1\n", "3\n")], FAST) == 0.0
    assert score_program("print(42)", [("", "41")], FAST) == 0.0


def test_float_output_within_tolerance():
    program = "print(1 / 3)\n"
    assert score_program(program, [("", "0.333333333")], FAST) == 1.0
    assert score_program(program, [("", "0.3334")], FAST) == 0.0


def test_trailing_whitespace_and_newlines_are_ignored():
    assert score_program("print('1 2   ')\nprint()\nprint()", [("", "1 2\n")], FAST) == 1.0


def test_large_stdin_and_stdout_flow_without_deadlock():
    result = run_program("import sys\ndata = sys.stdin.read()\nprint(len(data))\nprint('y' * 500000)",
                         "x" * (3 << 20), FAST)
    assert result.status == "ok"
    assert result.stdout.splitlines()[0] == str(3 << 20)


def test_output_cap():
    result = run_program("import sys\nsys.stdout.write('x' * (4 << 20))", "", FAST)
    assert result.status == "output_limit"
    assert len(result.stdout) == FAST.max_output_bytes


# ----------------------------------------------------------------------------- time, crashes, memory

@pytest.mark.parametrize("program", ["while True:\n    pass\n", "import time\ntime.sleep(100)\n"])
def test_slow_program_times_out_quickly(program):
    started = time.monotonic()
    result = run_program(program, "", TIGHT)
    assert result.status == "timeout"
    assert time.monotonic() - started < 3.0
    assert score_program(program, [("", "")], TIGHT) == 0.0


@pytest.mark.parametrize("leader", ["time.sleep(100)", "pass"])
def test_whole_process_group_is_killed(tmp_path, leader):
    """The group kill on its own (no guard, so fork is allowed): a forked child sleeping forever dies
    whether the leader times out or exits at once while the child still holds the pipes."""
    program = ("import os, sys, time\nchild = os.fork()\nif child == 0:\n    time.sleep(100)\n"
               f"print(child, flush=True)\n{leader}\n")
    run = sandbox._execute([sandbox._python(), "-c", program], b"", cwd=str(tmp_path), env={},
                           time_limit_s=1.0, max_output_bytes=1 << 16)
    child = int(run.stdout.split()[0])
    assert run.wall_time_s < 3.0
    assert _wait_dead(child)


def test_fork_is_blocked_in_the_sandbox():
    result = run_program("import os\npid = os.fork()\nprint('forked', pid)", "", HOOK_ONLY)
    assert result.status == "blocked"
    assert "forked" not in result.stdout


@pytest.mark.parametrize("program", ["raise ValueError('boom')", "import sys\nprint(5)\nsys.exit(3)",
                                     "def f(:\n    pass"])
def test_crashing_program_scores_zero(program):
    assert run_program(program, "", FAST).status == "runtime_error"
    assert score_program(program, [("", "5")], FAST) == 0.0


def test_memory_hungry_program_is_stopped():
    started = time.monotonic()
    result = run_program("buffer = bytearray(4 * 1024 ** 3)\nprint(len(buffer))", "", FAST)
    assert result.status in ("memory", "runtime_error")
    assert result.stdout == ""
    assert time.monotonic() - started < 3.0


# ----------------------------------------------------------------------------- files

@pytest.mark.parametrize("limits", [FAST, HOOK_ONLY], ids=["all-layers", "hook-only"])
def test_writing_outside_is_blocked(tmp_path, limits):
    target = tmp_path / "escaped.txt"
    program = f"open({str(target)!r}, 'w').write('x')\nprint(open({str(target)!r}).read())"
    result = run_program(program, "", limits)
    assert result.status == "blocked"
    assert not target.exists()
    assert score_program(program, [("", "x")], limits) == 0.0


@pytest.mark.parametrize("action", [
    "os.remove(SENTINEL)",
    "os.rename(SENTINEL, SENTINEL + '.moved')",
    "os.rename(SENTINEL, 'stolen')",
    "os.chmod(SENTINEL, 0o777)",
    "os.truncate(SENTINEL, 0)",
    "shutil.rmtree(os.path.dirname(SENTINEL))",
    "os.mkdir(os.path.join(os.path.dirname(SENTINEL), 'new'))",
    "os.symlink(SENTINEL, 'link')",
    "os.link(SENTINEL, 'hard')",
    "os.chdir(os.path.dirname(SENTINEL)); open('new', 'w')",
    "fd = os.open(os.path.dirname(SENTINEL), os.O_RDONLY); os.open('new', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
    "open('../' * 12 + SENTINEL.lstrip('/'), 'a').write('x')",
])
def test_touching_files_outside_is_blocked(tmp_path, action):
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("keep")
    mode = sentinel.stat().st_mode
    program = f"import os, shutil\nSENTINEL = {str(sentinel)!r}\n{action}\nprint('done')"
    result = run_program(program, "", HOOK_ONLY)
    assert result.status == "blocked", result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sentinel.txt"]
    assert sentinel.read_text() == "keep" and sentinel.stat().st_mode == mode


def test_writing_inside_its_directory_is_allowed():
    program = ("import os, shutil, tempfile\nos.makedirs('d/e')\nwith open('d/e/f.txt', 'w') as out:\n"
               "    out.write('hi')\nos.chdir('d')\nos.rename('e/f.txt', 'g.txt')\nos.chdir('..')\n"
               "with tempfile.NamedTemporaryFile('w') as tmp:\n    tmp.write('t')\n"
               "print(open('d/g.txt').read())\nshutil.rmtree('d')\nprint(sorted(os.listdir('.')))")
    result = run_program(program, "", FAST)
    assert result.status == "ok", result.stderr
    assert result.stdout.split() == ["hi", "['solution.py']"]


def test_sandbox_directory_is_removed(monkeypatch):
    made = []
    real_mkdtemp = sandbox.tempfile.mkdtemp
    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])
    assert run_program("open('left.txt', 'w').write('x')\nprint(1)", "", FAST).status == "ok"
    assert made and not os.path.exists(made[0])


# ----------------------------------------------------------------------------- network, processes

@pytest.mark.parametrize("limits", [FAST, HOOK_ONLY], ids=["all-layers", "hook-only"])
def test_network_is_unreachable(limits):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        program = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
                   f"s.connect(('127.0.0.1', {port}))\ns.sendall(b'leak')\nprint('sent')")
        result = run_program(program, "", limits)
        assert result.status == "blocked"
        assert score_program(program, [("", "sent")], limits) == 0.0
        listener.settimeout(0.3)
        with pytest.raises(socket.timeout):
            listener.accept()


@pytest.mark.skipif(not sandbox.namespace_flags() & sandbox.CLONE_NEWNET, reason="no network namespace here")
def test_namespaces_and_capabilities_hold_without_the_hook():
    """The kernel layers on their own: no route to the host's loopback, PID 1 of a fresh pid namespace,
    no capabilities."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        program = ("import os, socket\ntry:\n"
                   f"    socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=0.5)\n"
                   "    print('connected')\nexcept OSError:\n    print('unreachable')\n"
                   "print(os.getpid())\n"
                   "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
        result = sandbox._run_guarded(program, "", FAST, audit_hook=False)
        listener.settimeout(0.3)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert result.status == "ok", result.stderr
    assert result.stdout.split() == ["unreachable", "1", "0000000000000000"]


# ----------------------------------------------------------------------------- reading the answers

@pytest.mark.parametrize("steal", [
    "print(open(DATASET).read())",
    "import pathlib\nprint(pathlib.Path(DATASET).read_text())",
    "import io\nprint(io.open_code(DATASET).read())",
    "fd = os.open(DATASET, os.O_RDONLY)\nprint(os.read(fd, 1 << 16))",
    "fd = os.open(os.path.dirname(DATASET), os.O_RDONLY)\nprint(os.read(os.open('prompts.jsonl', 0, dir_fd=fd), 99))",
    "import linecache\nprint(''.join(linecache.getlines(DATASET)))",
    "import importlib.machinery as m\nprint(m.SourceFileLoader('x', DATASET).get_data(DATASET))",
    "import numpy\nprint(numpy.fromfile(DATASET, dtype='uint8').tobytes())",
    "print(open('/proc/self/root' + DATASET).read())",
    "print(open('../' * 20 + DATASET.lstrip('/')).read())",
    "print(os.listdir(os.path.dirname(DATASET)))",
])
def test_a_program_cannot_read_the_prompt_dataset_whose_labels_hold_the_answers(tmp_path, steal):
    secret = uuid.uuid4().hex
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"input": "print the answer", "label": secret}) + "\n")
    result = run_program(f"import os\nDATASET = {str(dataset)!r}\n{steal}", "", FAST)
    assert result.status == "blocked", (result.status, result.stderr[-300:])
    assert secret not in result.stdout and "prompts.jsonl" not in result.stdout


@pytest.mark.parametrize("steal", [
    "for pid in os.listdir('/proc'):\n    print(open(f'/proc/{pid}/cmdline').read())",
    "print(open(f'/proc/{TRAINER}/cmdline').read())",
    "print(open(f'/proc/{TRAINER}/environ').read())",
    "print(open('/proc/1/environ').read())",
    "import glob\nprint(glob.glob('/proc/*/cmdline'))",
])
def test_a_program_cannot_read_the_process_table_or_other_environments(steal):
    """Other processes' command lines name the dataset and the run's paths; their environments hold keys."""
    result = run_program(f"import os\nTRAINER = {os.getpid()}\n{steal}", "", FAST)
    assert result.status == "blocked", (result.status, result.stderr[-300:])
    assert "pytest" not in result.stdout and result.stdout.strip() == ""


def test_a_program_sees_a_minimal_environment_not_the_trainers(monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("WANDB_API_KEY", secret)
    result = run_program("import os\nprint(sorted(os.environ.items()))", "", FAST)
    assert result.status == "ok", result.stderr
    assert secret not in result.stdout and "WANDB_API_KEY" not in result.stdout


def test_honest_programs_still_read_what_they_need():
    """Standard-library and site-packages imports (numpy), a missing module's ImportError, time zones, stdin,
    and an uncaught error's traceback, which quotes the sandbox's own file (a runtime error, not blocked)."""
    program = ("import sys, json, heapq, decimal, fractions, statistics, zoneinfo\nimport numpy as np\n"
               "try:\n    import no_such_module\nexcept ImportError:\n    pass\n"
               "zoneinfo.ZoneInfo('UTC')\nprint(int(np.array(json.loads(sys.stdin.read())).sum()))")
    result = run_program(program, "[1, 2, 3]", FAST)
    assert result.status == "ok" and result.stdout.strip() == "6", result.stderr
    crashed = run_program("import json\njson.loads('not json')", "", FAST)
    assert crashed.status == "runtime_error" and "JSONDecodeError" in crashed.stderr


def test_shell_and_subprocess_are_blocked(tmp_path):
    marker = tmp_path / f"touched-{uuid.uuid4().hex}"
    shell = run_program(f"import os\nos.system('touch {marker}')\nprint('ran')", "", HOOK_ONLY)
    assert shell.status == "blocked"
    spawned = run_program(f"import subprocess\nsubprocess.run(['touch', {str(marker)!r}])", "", HOOK_ONLY)
    assert spawned.status in ("blocked", "runtime_error")
    assert "ImportError" in spawned.stderr or spawned.status == "blocked"
    posix_spawn = run_program(f"import os\nos.posix_spawn('/usr/bin/touch', ['touch', {str(marker)!r}], {{}})",
                              "", HOOK_ONLY)
    assert posix_spawn.status == "blocked"
    assert not marker.exists()


@pytest.mark.parametrize("program", [
    "import os\nos.kill(os.getppid() or 1, 0)\nos.kill(2, 0)",
    "import sys\nsys.settrace(lambda *a: None)",
    "import gc\ngc.get_objects()",
    "f = lambda: 0\nf.__code__.replace(co_name='g')",
])
def test_hook_escape_hatches_are_blocked(program):
    assert run_program(program, "", HOOK_ONLY).status == "blocked"


def test_ctypes_import_fails_softly():
    program = "try:\n    import ctypes\nexcept ImportError:\n    print('no ctypes')\n"
    result = run_program(program, "", HOOK_ONLY)
    assert result.status == "ok" and result.stdout == "no ctypes\n"


def test_hook_functions_cannot_be_patched_from_a_signal_handler():
    """A signal handler can see the hook's frames; rebinding the defaults of what it finds ends the run."""
    program = (
        "import signal, types\nfound = []\n"
        "def handler(sig, frame):\n    while frame is not None:\n"
        "        found.extend(v for v in list(frame.f_locals.values())\n"
        "                     if isinstance(v, types.FunctionType) and v.__name__ in ('decide', 'check_open'))\n"
        "        frame = frame.f_back\n"
        "signal.signal(signal.SIGALRM, handler)\nsignal.setitimer(signal.ITIMER_REAL, 1e-4, 1e-4)\n"
        "for _ in range(200000):\n    open('solution.py').close()\n    if found:\n        break\n"
        "signal.setitimer(signal.ITIMER_REAL, 0)\n"
        "if found:\n    found[0].__defaults__ = found[0].__defaults__\nprint('patched' if found else 'none found')\n")
    result = run_program(program, "", HOOK_ONLY)
    assert result.status == "blocked" and "blocked object.__setattr__" in result.stderr, result.stdout


def test_hook_reads_no_globals():
    """Everything the hook uses is bound at creation, so a program cannot monkeypatch its behaviour."""
    hook = sandbox_child.make_hook("/sandbox", sandbox_child.BLOCKED_EXIT)
    functions, seen = [hook], set()
    while functions:
        function = functions.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        loads = {i.argval for i in dis.get_instructions(function) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME",
                                                                                  "LOAD_DEREF", "LOAD_CLASSDEREF")}
        assert not loads, (function.__name__, loads)
        functions += [d for d in function.__defaults__ or () if callable(d) and hasattr(d, "__code__")]
    assert len(seen) == 10


# ----------------------------------------------------------------------------- the child module itself

def test_child_imports_only_the_standard_library():
    """It runs under `python -I`, where neither this package nor site-packages may be importable."""
    tree = ast.parse(open(sandbox_child.__file__).read())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert names and names <= sys.stdlib_module_names, names - sys.stdlib_module_names


def test_call_function_prefers_class_solution():
    module = types.ModuleType("solution")
    exec("class Solution:\n    def f(self, a, b):\n        return a - b\ndef f(a, b):\n    return a + b\n",
         module.__dict__)
    assert sandbox_child.call_function(module, "f", [5, 3]) == 2
    del module.Solution
    assert sandbox_child.call_function(module, "f", [5, 3]) == 8
    with pytest.raises(NameError, match="no callable 'g'"):
        sandbox_child.call_function(module, "g", [])


LIB = "/usr/lib/python3"  # a read root in the judge's unit tests, as the interpreter's import path is in a run


@pytest.fixture
def decide(tmp_path, monkeypatch):
    """The hook's decisions for a sandbox at tmp_path, the cwd as in a run."""
    root = os.path.realpath(tmp_path)
    monkeypatch.chdir(root)
    return sandbox_child.make_judge(root, read_roots=(LIB,))[0]


WRITE = os.O_WRONLY | os.O_CREAT


@pytest.mark.parametrize("event, args", [
    ("open", ("out.txt", "w", WRITE)), ("open", ("d/../out.txt", "a", WRITE)), ("open", ("solution.py", "r", 0)),
    ("open", (LIB + "/json/__init__.py", "r", 0)), ("open", (LIB, None, os.O_RDONLY)), ("os.listdir", (LIB,)),
    ("os.scandir", (None,)), ("os.listdir", ("d",)), ("open", ("/dev/urandom", "rb", 0)),
    ("open", ("/dev/null", "w", WRITE)), ("os.remove", ("out.txt", -1)), ("os.rename", ("a", "b", -1, -1)),
    ("os.mkdir", ("d", 0o777, -1)), ("os.chdir", (".",)), ("os.kill", (os.getpid(), 0)),
    ("resource.prlimit", (0, 7, (1, 1))), ("compile", (b"1", "<string>")),
])
def test_judge_allows_work_inside_the_sandbox(decide, event, args):
    assert decide(event, args) is None


@pytest.mark.parametrize("event, args", [
    ("open", ("/tmp/escaped.txt", "w", WRITE)), ("open", ("../escaped.txt", "a", WRITE)),
    ("open", ("d/../../escaped.txt", "w", WRITE)), ("open", ("/", None, os.O_RDONLY)),
    ("os.remove", ("/etc/hostname", -1)), ("os.rename", ("mine", "/tmp/stolen", -1, -1)), ("os.chdir", ("..",)),
    ("os.kill", (1, 9)), ("resource.prlimit", (1, 7, (1, 1))), ("os.system", (b"ls",)), ("os.fork", ()),
    ("socket.connect", (None, ("127.0.0.1", 9))), ("os.symlink", ("/etc", "link", -1)), ("code.__new__", ()),
    ("open", ("/etc/hostname", "r", 0)), ("open", (LIB + "/../../../etc/passwd", "r", 0)),
    ("open", (LIB + "x/secret", "r", 0)), ("open", ("/proc/1/cmdline", "rb", 0)), ("os.listdir", ("/proc",)),
    ("os.scandir", ("/",)), ("open", ("/proc/self/root/etc/hostname", "r", 0)), ("open", ("/etc", None, 0)),
])
def test_judge_refuses_work_outside_the_sandbox(decide, event, args):
    with pytest.raises(PermissionError, match=event.replace(".", r"\.")):
        decide(event, args)


@pytest.mark.parametrize("name, filename, refusal", [
    ("json", "/usr/lib/python3/json/__init__.py", None), ("solution_helper", "helper.py", None),
    ("ctypes", None, "cannot be imported"), ("_posixsubprocess", None, "cannot be imported"),
    ("sqlite3", None, "cannot be imported"), ("dbm._gdbm", None, "cannot be imported"),
    ("readline", None, "cannot be imported"),
    ("evil", "evil.so", "only .py modules"),
])
def test_judge_refuses_some_imports_softly(decide, name, filename, refusal):
    verdict = decide("import", (name, filename, [], [], []))
    assert verdict is None if refusal is None else refusal in verdict


# ----------------------------------------------------------------------------- labels

def test_code_labels_have_one_owner_and_round_trip():
    assert loaders.code_label is code_label and loaders.parse_label is parse_label
    stdin = parse_label(code_label(["1 2\n", "3 4\n"], ["3\n", "7\n"]))
    assert stdin.fn_name is None and stdin.tests == [("1 2\n", "3\n"), ("3 4\n", "7\n")]
    call = parse_label(code_label(["[1, 2]\n3"], ["[4, 5]"], fn_name="shift"))
    assert call.fn_name == "shift" and call.tests == [("[[1, 2], 3]", "[4, 5]")]
    assert parse_label(json.dumps({"inputs": ["x"], "outputs": ["y"], "time_limit_s": 2})).time_limit_s == 2.0
    for bad in [json.dumps({"inputs": ["x"], "outputs": ["y"], "time_limit_s": 0}), "[1, 2]", "{not json",
                json.dumps({"inputs": [], "outputs": []}), json.dumps({"inputs": ["a"], "outputs": ["b", "c"]})]:
        with pytest.raises(ValueError):
            parse_label(bad)


# ----------------------------------------------------------------------------- call-based (LeetCode) tests

TWO_SUM = """
class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        print("debugging output that must not count")
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return (seen[target - x], i)  # a tuple: judged as the list it serialises to
            seen[x] = i

if __name__ == "__main__":
    input()  # would fail on the empty stdin if this block ran: an imported module's does not
"""
TWO_SUM_TESTS = [(json.dumps([[2, 7, 11, 15], 9]), "[0, 1]"), (json.dumps([[3, 2, 4], 6]), "[1,2]")]


@pytest.mark.parametrize("actual, expected, same", [
    ("[0, 1]", "[0,1]", True), ("[1, 0]", "[0, 1]", False), ("[[1], [2, 3]]", "[[1],[2,3]]", True),
    ("0.30000000000000004", "0.3", True), ("2", "2.0", True), ("0.3334", "0.3333", False),
    ("123456789012345678", "123456789012345679", False), ("true", "true", True), ("1", "true", False),
    ("false", "0", False), ('"abc"', '"abc"', True), ('"1"', "1", False), ("null", "null", True),
    ('{"a": [1.0]}', '{"a": [1]}', True), ('{"a": 1}', '{"a": 1, "b": 2}', False), ("NaN", "NaN", False),
    ("1" + "0" * 400, "1e400", False), ("", "1", False), ("[1, 2", "[1, 2]", False),
])
def test_compare_json(actual, expected, same):
    assert compare_json(actual, expected) is same


def test_call_based_program_is_judged_on_its_return_value():
    result = run_program(TWO_SUM, TWO_SUM_TESTS[0][0], FAST, call="twoSum")
    assert result.ok and result.stdout == "[0, 1]"
    assert "debugging output" in result.stderr  # prints go to stderr, not into the judged value
    assert score_program(TWO_SUM, TWO_SUM_TESTS, FAST, call="twoSum") == 1.0
    assert score_program(TWO_SUM, [(json.dumps([[3, 2, 4], 6]), "[2, 1]")], FAST, call="twoSum") == 0.0
    function = "def twoSum(nums, target):\n    return [nums.index(target - nums[-1]), len(nums) - 1]\n"
    assert score_program(function, [(json.dumps([[3, 2, 4], 6]), "[1, 2]")], FAST, call="twoSum") == 1.0


def test_call_based_preamble_matches_leetcodes_judge():
    program = """
class Solution:
    def f(self, words: List[str], k: int) -> Optional[int]:
        counts = Counter(words)
        heap = [-c for c in counts.values()]
        heapify(heap)
        best = -heappop(heap)
        return pow(best, 3, k) + bisect_left([1, 5, 9], 6) + (inf > 10**9) + len(list(accumulate([1, 2])))
"""
    # Counter 3 -> 27 % 5 = 2 (three-argument built-in pow, not math.pow), bisect 2, inf True, accumulate 2
    assert score_program(program, [(json.dumps([["a", "b", "a", "a"], 5]), "7")], FAST, call="f") == 1.0


@pytest.mark.parametrize("program, status", [
    ("class Solution:\n    def other(self):\n        return 1\n", "runtime_error"),  # no such method
    ("def f(x):\n    return {x}\n", "runtime_error"),  # a set is not JSON
    ("def f(x):\n    raise ValueError(x)\n", "runtime_error"),
    ("def f(x):\n    while True:\n        pass\n", "timeout"),
    ("def f(x):\n    return bytearray(4 << 30)\n", "memory"),
    ("import socket\ndef f(x):\n    return socket.create_connection(('127.0.0.1', 9))\n", "blocked"),
    ("import os\ndef f(x):\n    return os.system('true')\n", "blocked"),
])
def test_call_based_failures_and_the_sandbox_still_holds(program, status):
    name = "other_name" if program.startswith("class") else "f"
    result = run_program(program, "[1]", TIGHT, call=name)
    assert result.status == status, result.stderr


def test_call_based_write_outside_is_blocked(tmp_path):
    target = tmp_path / "escaped.txt"
    program = f"def f():\n    open({str(target)!r}, 'w').write('x')\n    return 1\n"
    assert run_program(program, "[]", FAST, call="f").status == "blocked"
    assert not target.exists()


def test_call_based_program_sees_an_empty_stdin():
    program = "import sys\nAT_IMPORT = sys.stdin.read()\ndef f(x):\n    return [AT_IMPORT, sys.stdin.read(), x]\n"
    assert json.loads(run_program(program, "[41]", FAST, call="f").stdout) == ["", "", 41]


def test_call_based_labels_parse_in_livecodebenchs_layout():
    label = parse_label(json.dumps({"fn_name": "twoSum", "inputs": ["[2, 7, 11, 15]\n9\n", ""],
                                    "outputs": ["[0, 1]", "null"]}))
    assert label.fn_name == "twoSum"
    assert label.tests == [("[[2, 7, 11, 15], 9]", "[0, 1]"), ("[]", "null")]
    stdin = parse_label({"fn_name": "", "inputs": ["1 2"], "outputs": ["3"]})  # TACO's empty fn_name: stdin
    assert stdin.fn_name is None and stdin.tests == [("1 2", "3")]
    for bad, message in [({"fn_name": "f", "inputs": [[1]], "outputs": [1]}, "must be text"),
                         ({"fn_name": "f", "inputs": ["[1,"], "outputs": ["1"]}, "not JSON"),
                         ({"fn_name": "f", "inputs": ["1"], "outputs": ["x y"]}, "not JSON"),
                         ({"fn_name": "no such", "inputs": ["1"], "outputs": ["1"]}, "identifier"),
                         ({"fn_name": 3, "inputs": ["1"], "outputs": ["1"]}, "identifier")]:
        with pytest.raises(ValueError, match=message):
            parse_label(bad)


def test_reward_func_runs_call_based_labels(monkeypatch):
    monkeypatch.setenv(TIME_LIMIT_ENV, "5")
    label = json.dumps({"fn_name": "twoSum", "inputs": ["[2,7,11,15]\n9", "[3,2,4]\n6"], "outputs": ["[0,1]", "[1,2]"]})
    good = "p```python" + TWO_SUM + "```"
    wrong = "p```python\nclass Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n```"
    assert reward_func([good, wrong], ["p", "p"], [label, label])["rewards"].tolist() == [1.0, 0.0]


# ----------------------------------------------------------------------------- reward_func

def _label(inputs, outputs, **extra) -> str:
    return json.dumps({"inputs": inputs, "outputs": outputs, **extra})


def test_reward_func_batch(monkeypatch):
    monkeypatch.setenv(TIME_LIMIT_ENV, "1")
    prompt = "Read two integers and print their sum.\n"
    good = prompt + "Here you go:\n```python\n" + SUM + "```"
    wrong = prompt + "```python\nprint(0)\n```"
    label = _label(["1 2\n", "5 5\n"], ["3\n", "10\n"])
    out = reward_func([good, wrong, good, prompt + "I don't know.", good],
                      [prompt] * 5, [label, label, "{not json", label, json.dumps({"inputs": ["1 2"]})])
    assert out["rewards"].dtype == torch.float32
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert torch.equal(out["rewards"], out["scores"])


def test_reward_func_survives_odd_inputs():
    assert reward_func(["```python\nprint(1)\n```"], [None], [None])["rewards"].tolist() == [0.0]
    assert reward_func([], [], [])["rewards"].tolist() == []
    assert reward_func(["x", "y"], ["x"], [])["rewards"].tolist() == [0.0, 0.0]


def test_time_limit_from_env_and_label(monkeypatch):
    program = "import time\ntime.sleep(0.7)\nprint('late')"
    query = "p```python\n" + program + "\n```"
    monkeypatch.setenv(TIME_LIMIT_ENV, "0.3")
    # 0.0: cut at the limit (run to its end, the program prints what the label expects and scores 1.0, as below);
    # no wall-clock bound here, which a loaded machine's process start-up alone can exceed
    assert reward_func([query], ["p"], [_label([""], ["late"])])["rewards"].tolist() == [0.0]
    assert reward_func([query], ["p"], [_label([""], ["late"], time_limit_s=3)])["rewards"].tolist() == [1.0]
    monkeypatch.setenv(TIME_LIMIT_ENV, "3")
    assert reward_func([query], ["p"], [_label([""], ["late"])])["rewards"].tolist() == [1.0]


def test_a_nonfinite_or_negative_time_limit_is_not_taken(monkeypatch, caplog):
    """$GROWMTP_CODE_TIME_LIMIT_S falls back to 6 s (logged); a label's scores 0.0 as malformed."""
    from openrlhf_growmtp.rewards.code_reward import DEFAULT_TIME_LIMIT_S, code_score, default_time_limit_s

    for raw in ("nan", "inf", "-1", "soon"):
        monkeypatch.setenv(TIME_LIMIT_ENV, raw)
        assert default_time_limit_s() == DEFAULT_TIME_LIMIT_S
    label = json.dumps({"inputs": [""], "outputs": ["1"], "time_limit_s": float("inf")})  # JSON's Infinity
    assert code_score("p```python\nprint(1)\n```", "p", label) == 0.0 and "malformed label" in caplog.text


def test_reward_file_loads_the_way_openrlhf_loads_it():
    path = os.path.join(os.path.dirname(openrlhf_growmtp.rewards.__file__), "code_reward.py")
    spec = importlib.util.spec_from_file_location("reward_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.reward_func(["q```python\nprint(input()[::-1])\n```"], ["q"], [_label(["abc"], ["cba"])])
    assert out["rewards"].tolist() == [1.0]
