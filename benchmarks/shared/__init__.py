"""What the CPU benchmarks and the GPU check share: `bench_common` (Qwen3-4B's shapes, records at a given τ, the head
update) and `cycle_timing` (a cycle's phases timed, the cycle formula); what the CPU benchmarks share among
themselves: `cpu_runs` (timed generates, the toy policy at a depth, the engine's CPU GEMM, provenance) and
`peak_memory` (peak memory of one piece of work). No benchmark imports another."""
