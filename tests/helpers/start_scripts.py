"""Starts modules with `--help` inside this one process, as `python -m MODULE --help` would (or, for a path ending in
`.py`, as `python PATH --help` would: the script's folder first on the path), and prints one JSON line per module:
its name, whether it ended with exit status 0 having printed a usage, and otherwise what it printed or
raised. One process for all: each module's imports (torch, transformers, vLLM) cost seconds, paid here once
(tests/benchmarks/test_scripts_start.py).

    python tests/helpers/start_scripts.py benchmarks/bench_topk.py growmtp_lab.demo ...
"""

import contextlib
import io
import json
import os
import runpy
import sys
import traceback


def start(module: str) -> dict:
    out = io.StringIO()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    code, error = None, ""
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            sys.argv = [module, "--help"]
            if module.endswith(".py"):  # `python PATH`: the script's own folder, not the working directory, on the path
                sys.path[0] = os.path.dirname(os.path.abspath(module))
                runpy.run_path(module, run_name="__main__")
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        error = "ended without exiting (no argument parser answered --help)"
    except SystemExit as exit_:
        code = exit_.code
        if code not in (0, None):
            error = f"exit status {code}"
    except BaseException:  # any failure to start is the finding, reported by name
        error = traceback.format_exc(limit=-3)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    printed = out.getvalue()
    if not error and "usage:" not in printed:
        error = "no usage text printed"
    return {"module": module, "ok": not error, "error": error, "printed": printed[-2000:]}


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(json.dumps(start(name)), flush=True)
