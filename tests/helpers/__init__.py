"""The tests' shared helpers, in one place: tiny heads and records (`tiny`), the vLLM test engines (`engines`),
OpenRLHF's parsed arguments for one-rank steps (`trainer`), the fault suite's faults (`faults`). The toy world they run
on is the package's `growmtp_lab.worlds.toy` (bench_rollout.py times it too)."""
