"""Every benchmark script (benchmarks/, gpu_check/ included) and every runnable experiment module answers `--help`
with a usage and exit status 0 on this CPU machine, so none of them
rots unseen between the runs that use it (a GPU-only script at least parses its flags here). A script is a module
with a `__main__` block; the modules without one (the scripts' shared pieces) are imported by the scripts that
start. A benchmark starts by its path (`python benchmarks/X.py`, from another directory than the checkout's root, with
nothing added to PYTHONPATH: as on a fresh clone after `make venv`), an experiment as a module. All of them start in
one process (tests/helpers/start_scripts.py): each process pays seconds of imports."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAIN = 'if __name__ == "__main__":'


def runnable(folder: Path) -> list[str]:
    return [".".join(p.relative_to(ROOT).with_suffix("").parts)
            for p in sorted(folder.rglob("*.py")) if MAIN in p.read_text()]


def test_every_script_answers_help(tmp_path):
    scripts = [str(ROOT / (name.replace(".", os.sep) + ".py")) for name in runnable(ROOT / "benchmarks")]
    names = scripts + runnable(ROOT / "growmtp_lab")
    # the discovery itself could find nothing and pass: the folders hold at least these
    assert {str(ROOT / "benchmarks" / "bench_draft_vocab.py"), str(ROOT / "benchmarks" / "gpu_check" / "gpu_check.py"),
            "growmtp_lab.demo"} <= set(names)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "start_scripts.py"), *names],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and [r["module"] for r in results] == names, proc.stderr[-3000:]
    failed = {r["module"]: f"{r['error']}\n{r['printed']}" for r in results if not r["ok"]}
    assert not failed, "\n\n".join(f"{name}: {why}" for name, why in failed.items())
