"""The `vllm.general_plugins` entry point: vLLM calls `register` in every process it starts."""

from __future__ import annotations


def register() -> None:
    from . import check_vllm_version

    check_vllm_version()
    from .capture import install_hooks
    from .cpu_fixes import apply_cpu_fixes
    from .head_model import register_head_model
    from .seeded_drafts import install_seeded_drafts

    register_head_model()
    apply_cpu_fixes()
    install_hooks()
    install_seeded_drafts()
