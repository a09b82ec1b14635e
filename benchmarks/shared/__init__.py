"""What the CPU benchmarks and the GPU check share: `bench_common` (Qwen3-4B's shapes, records at a given τ, the head
update) and `cycle_timing` (a cycle's phases timed, the cycle formula)."""
