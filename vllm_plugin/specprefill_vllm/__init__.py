"""specprefill-vllm: vLLM honours ``vllm_xargs.position_ids`` (SpecPrefill's kept tokens at their positions)."""

from __future__ import annotations

import os

from specprefill_vllm.supported import SUPPORTED_ARCHITECTURES, SUPPORTED_VLLM

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_VLLM", "UnsupportedVLLMError", "register"]


class UnsupportedVLLMError(RuntimeError):
    pass


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point; runs in every vLLM process, possibly more than once."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VLLM):
        raise UnsupportedVLLMError(
            f"specprefill-vllm supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; this is vLLM {version}. "
            "Install a supported vLLM, or uninstall specprefill-vllm (pip uninstall specprefill-vllm)."
        )
    # positions live in the V1 model runner's M-RoPE path; the V2 runner has its own (not covered)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from specprefill_vllm.patches import apply

    apply()
