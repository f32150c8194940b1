"""specprefill-vllm: vLLM honours ``vllm_xargs.position_ids`` (SpecPrefill's kept tokens at their positions) and
``vllm_xargs.kept_token_ids`` (the swap: a request vLLM renders itself, run as its kept tokens)."""

from __future__ import annotations

import logging
import os

from specprefill_vllm.supported import SUPPORTED_ARCHITECTURES, SUPPORTED_VLLM

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_VLLM", "UnsupportedVLLMError", "register"]


class UnsupportedVLLMError(RuntimeError):
    pass


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point; runs in every vLLM process, possibly more than once.

    The gate is what the plugin patches, checked in this vLLM's sources before anything is patched; the
    releases in ``SUPPORTED_VLLM`` are the ones it is tested on."""
    from pathlib import Path

    import vllm

    from specprefill_vllm.patch_points import missing_patch_points

    version = getattr(vllm, "__version__", "unknown")
    missing = missing_patch_points(Path(vllm.__file__).parent)
    if missing:
        raise UnsupportedVLLMError(
            f"specprefill-vllm cannot patch vLLM {version}: {'; '.join(missing)}. It supports vLLM "
            f"{', '.join(v + 'x' for v in SUPPORTED_VLLM)}; install one of those, or uninstall specprefill-vllm "
            "(pip uninstall specprefill-vllm)."
        )
    if not version.startswith(SUPPORTED_VLLM):
        logging.getLogger("vllm.specprefill").warning(
            "specprefill-vllm is tested on vLLM %s; this is vLLM %s (its patch points are all present)",
            ", ".join(v + "x" for v in SUPPORTED_VLLM),
            version,
        )
    # positions live in the V1 model runner's M-RoPE path; the V2 runner has its own (not covered)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from specprefill_vllm.patches import apply

    apply()
