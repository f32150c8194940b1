"""The cost models' terms, by name and in order: what ``--cost-coefficients`` gives numbers for (the settings
check it) and what ``gateway.planning.costs`` fits. Beneath both, so that the settings import nothing above."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

TARGET_TERMS = ("fixed", "per_token", "per_cached_token", "per_token_pair")
DRAFT_TERMS = ("fixed", "per_token", "per_token_pair", "per_prompt_token")
TERMS = {"target": TARGET_TERMS, "draft": DRAFT_TERMS}


def check_coefficients(fixed: Mapping[str, Sequence[float]]) -> None:
    """A ValueError naming the model whose coefficients are missing or of the wrong count."""
    for name, terms in TERMS.items():
        if len(fixed.get(name, ())) != len(terms):
            raise ValueError(f"cost_coefficients needs {name!r}: {len(terms)} numbers ({', '.join(terms)})")


def coefficients_help() -> str:
    """The ``--cost-coefficients`` help: each model's terms in order."""
    models = ", ".join(f'"{name}": [{", ".join(terms)}]' for name, terms in TERMS.items())
    return f"fixed cost models instead of calibrated ones, seconds per unit: {{{models}}}"
