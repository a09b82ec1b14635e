"""The GPU check (`make gpu-check`, docs/gpu.md): `python -m benchmarks.gpu_check.gpu_check`."""
