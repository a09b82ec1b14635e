"""Record capture in the worker, in two parts (`vllm_patches/README.md` maps the hook points):

- `core`: runner-independent. It takes each verification step in plain terms (request ids, starts,
  drafts, the target's top-k log-probs, q, accepted counts) and exact mode's hidden rows, and `drain`
  turns them into one payload of cycle rows grouped by request.
- `v1`: the adapter to vLLM 0.29's V1 model runner, the only code that knows that runner's names. An
  adapter to the V2 runner would be one more module beside it, calling the same `core` functions.

On the driver, `vllm_patches/collector.py` joins drained payloads with finished outputs into records; it
reads only vLLM's engine-level outputs (`RequestOutput`, per-request spec-decode metrics), none of a
runner's names.

Importing this package imports neither part.
"""
