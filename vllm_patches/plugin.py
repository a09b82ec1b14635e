"""The `vllm.general_plugins` entry point: vLLM calls `register` in every process it starts."""

from __future__ import annotations


def register() -> None:
    from . import check_vllm_version

    check_vllm_version()
    from .fixes.image_processor_route import route_image_processor

    route_image_processor()  # before anything imports vLLM's Qwen3.5 model (model inspection does)
    from vllm.platforms import current_platform

    from .capture.v1 import install_hooks
    from .engine_depth import install_engine_depth
    from .draft_sampling import install_draft_sampling
    from .fixes.draft_config import install_draft_config_hook
    from .fixes.expand_kernel import install_expand_kernel
    from .head_model import register_head_model
    from .seeded_drafts import install_seeded_drafts

    register_head_model()
    install_draft_config_hook()
    install_expand_kernel()
    if current_platform.is_cpu():
        from .fixes.gdn_core import install_gdn_core

        install_gdn_core()  # before a Qwen3.5 model is built (its first GDN layer registers the op)
    install_hooks()
    install_engine_depth()
    install_draft_sampling()  # inside the seeded drafts' wrapper
    from openrlhf_growmtp.reproducibility import ingredient

    if ingredient("seeded_drafts"):
        install_seeded_drafts()
