"""Everything that touches vLLM internals, pinned to vLLM 0.29.0 (built in a later issue; empty for now)."""
