"""The family x scheme support matrix, generated from the registries (README and tests use the same source)."""

from __future__ import annotations

from ..families.base import FAMILY_REGISTRY
from ..schemes.base import SCHEME_REGISTRY

PLACEMENT = {
    "absolute": "vectors added to the token embeddings",
    "rotary": "q/k rotation",
    "bias": "attention-logit bias",
    "none": "nothing",
}


def support_cell(family: str, scheme: str) -> str:
    """How ``scheme`` is carried in ``family``: every registered pair is supported; the cell says how."""
    adapter = FAMILY_REGISTRY.get(family)
    config_cls = SCHEME_REGISTRY.get(scheme)
    if config_cls.kind == "rotary" and adapter.rotary_module_path is not None:
        return "native: config.rope_parameters (partial: in attention)"
    if config_cls.kind in ("rotary", "bias"):
        return "in attention (eager, sdpa)"
    if config_cls.kind == "absolute":
        return "table slot" if adapter.absolute_table_path is not None else "added to embeddings"
    return "yes"


def support_matrix_markdown() -> str:
    schemes = SCHEME_REGISTRY.names()
    lines = ["| family (model_type) | " + " | ".join(f"`{s}`" for s in schemes) + " |", "|---|" + "---|" * len(schemes)]
    for family in FAMILY_REGISTRY.names():
        lines.append(f"| `{family}` | " + " | ".join(support_cell(family, s) for s in schemes) + " |")
    return "\n".join(lines)
