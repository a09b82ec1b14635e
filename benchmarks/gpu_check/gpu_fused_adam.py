"""DeepSpeed's fused Adam for check `trainer_step`, built on the device within a time box, else torch's AdamW.

DeepSpeed builds its fused Adam from C++/CUDA sources at first use (torch's cpp_extension: ninja and nvcc),
which takes a minute or more and fails on a machine without a compiler; the example scripts' training uses
it. The check's runs have used torch's AdamW (`torch_adam`, the same update) so that nothing compiles.
With `--fused-adam-s S` trainer_step starts the build in a process of its own (on the host's cores, while the
reference drafter runs on the device) into a directory of the check's (`TORCH_EXTENSIONS_DIR`), and before
its first run waits for it until S seconds after the start. Built and loaded, and one step of it moved a
parameter on the device: every run loads it from that directory (DeepSpeed finds it built). Otherwise: torch's
AdamW, and the reason is recorded. The build's log sits beside the runs' logs.

    python -m benchmarks.gpu_check.gpu_fused_adam RESULT.json     # the build, as trainer_step starts it
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FUSED = "DeepSpeed FusedAdam (built on this device)"
TORCH_ADAM = "torch AdamW through DeepSpeed (torch_adam)"


class FusedAdamBuild:
    """The build started in a process of its own; `outcome()` waits for it within the time box."""

    def __init__(self, extensions_dir: Path, out_dir: Path, budget_s: float):
        self.extensions_dir, self.budget_s = extensions_dir, budget_s
        self.result_path, self.log_path = out_dir / "fused_adam_build.json", out_dir / "fused_adam_build.log"
        self.started = time.perf_counter()
        extensions_dir.mkdir(parents=True, exist_ok=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.result_path.unlink(missing_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_check.gpu_fused_adam",
                                          str(self.result_path)], cwd=Path(__file__).resolve().parents[2], stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, **self.env()})

    def env(self) -> dict[str, str]:
        """What the build and every run that loads it share: where torch keeps built extensions, and a PATH with
        the carried ninja first (the ninja wheel's binary is a script of the wheel: `pip install --target
        .gpu-site`, as run.sh installs the wheels, puts it in .gpu-site/bin)."""
        site_bin = Path(__file__).resolve().parents[2] / ".gpu-site" / "bin"
        path = os.environ.get("PATH", "")
        return {"TORCH_EXTENSIONS_DIR": str(self.extensions_dir),
                "PATH": f"{site_bin}{os.pathsep}{path}" if site_bin.is_dir() else path}

    def outcome(self) -> dict:
        """The optimizer the runs take: {"optimizer", "fused", "build_s", "reason"}; the build stopped where it is
        still running at the end of its time box."""
        left = self.budget_s - (time.perf_counter() - self.started)
        try:
            self.proc.wait(max(left, 0.0))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return {"optimizer": TORCH_ADAM, "fused": False, "build_s": None,
                    "reason": f"not built within {self.budget_s:g} s (log: {self.log_path.name})"}
        found = json.loads(self.result_path.read_text()) if self.result_path.exists() else {}
        if not found.get("ok"):
            return {"optimizer": TORCH_ADAM, "fused": False, "build_s": found.get("seconds"),
                    "reason": f"the build failed: {found.get('error', f'exit {self.proc.returncode}')[-300:]} "
                              f"(log: {self.log_path.name})"}
        return {"optimizer": FUSED, "fused": True, "build_s": found["seconds"], "reason": None}


def no_build(reason: str) -> dict:
    return {"optimizer": TORCH_ADAM, "fused": False, "build_s": None, "reason": reason}


def _build(result_path: Path) -> None:
    """Build and load DeepSpeed's fused Adam for this device, then one step of it on a parameter here."""
    import traceback

    import torch

    t0 = time.perf_counter()
    try:
        from deepspeed.ops.adam import FusedAdam
        from deepspeed.ops.op_builder import FusedAdamBuilder

        FusedAdamBuilder().load()
        param = torch.nn.Parameter(torch.zeros(64, device="cuda"))
        optimizer = FusedAdam([param], lr=0.1)
        param.grad = torch.ones_like(param)
        optimizer.step()
        torch.cuda.synchronize()
        if not bool((param < 0).all()):
            raise RuntimeError(f"one FusedAdam step did not move the parameter against its gradient: {param[:4]}")
        result = {"ok": True, "seconds": time.perf_counter() - t0}
    except BaseException:
        result = {"ok": False, "seconds": time.perf_counter() - t0, "error": traceback.format_exc()}
        print(result["error"], file=sys.stderr, flush=True)
    result_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="where the build's outcome (JSON) goes")
    _build(parser.parse_args().result)
