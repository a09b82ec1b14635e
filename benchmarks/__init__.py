"""The benchmarks and the GPU check, a package: run each from the repository's root as `python -m benchmarks.NAME`
(`python -m benchmarks.gpu_check.gpu_check`). What several of them share lives in `benchmarks/shared/`."""
