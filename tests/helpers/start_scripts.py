"""Starts scripts with `--help` inside this one process, as `python PATH --help` and `python -m MODULE --help`
would, and prints one JSON line per script: its name, whether it ended with exit status 0 having printed a usage,
and otherwise what it printed or raised. One process for all: each script's imports (torch, transformers, vLLM)
cost seconds, paid here once (tests/benchmarks/test_scripts_start.py).

    python tests/helpers/start_scripts.py benchmarks/bench_topk.py openrlhf_growmtp.experiments.demo ...

An argument ending in .py is a script path (its folder first on sys.path, as `python PATH` puts it); any other is
a module name (`python -m`).
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback


def start(target: str) -> dict:
    out = io.StringIO()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    code, error = None, ""
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if target.endswith(".py"):
                sys.argv = [target, "--help"]
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                runpy.run_path(target, run_name="__main__")
            else:
                sys.argv = [target, "--help"]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        error = "ended without exiting (no argument parser answered --help)"
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:  # noqa: BLE001 - any failure to start is the finding, reported by name
        error = traceback.format_exc(limit=-3)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    printed = out.getvalue()
    ok = code in (0, None) and not error and "usage:" in printed
    if code not in (0, None):
        error = f"exit status {code}"
    elif not error and "usage:" not in printed:
        error = "no usage text printed"
    return {"target": target, "ok": ok, "error": error, "printed": printed[-2000:]}


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(json.dumps(start(name)), flush=True)
