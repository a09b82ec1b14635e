"""A pure-torch stand-in for the parts of flash-attn that OpenRLHF imports (CPU machines only).

flash-attn cannot be built without CUDA, yet `openrlhf.models` imports its padding helpers at module
level. This package provides those helpers with flash-attn 2.8's semantics. It ships no attention
kernel and no dist-info, so transformers never believes flash attention is available: run with sdpa.
`openrlhf_growmtp.cpu_support` puts this directory on sys.path only when CUDA is absent.
"""

__version__ = "0.0.0+growmtp.cpu.shim"
