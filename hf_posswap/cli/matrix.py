"""The family x scheme support matrix, generated from the registries (README and tests use the same source)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from types import SimpleNamespace

from ..families.base import FAMILY_REGISTRY
from ..schemes.base import SCHEME_REGISTRY
from ..schemes.rope import RopeConfig

#: what a cell of the support matrix means
LEGEND = {
    "native": "transformers' own `config.rope_parameters` where the family's rotary class expresses the settings "
    "(the checkpoint then loads without hf_posswap; see the family notes), otherwise inside attention",
    "attention": "inside attention (the `posswap_eager` / `posswap_sdpa` carriers)",
    "table slot": "replaces the family's learned table (`combine='concat'`: added to the embeddings, projected)",
    "embeddings": "added to the token embeddings (the family has no table)",
    "per layer": "each layer (or head) gets one of the other schemes (`LayerMix`, `HeadMix`, presets)",
    "encoders refused": "causal only: a bidirectional model is refused (BERT with is_decoder=True is accepted)",
}


def support_cell(family: str, scheme: str) -> str:
    """How ``scheme`` is carried in ``family`` (a key of :data:`LEGEND`, or "yes")."""
    adapter = FAMILY_REGISTRY.get(family)
    config_cls = SCHEME_REGISTRY.get(scheme)
    if getattr(config_cls, "causal_only", False) and not adapter.is_causal(SimpleNamespace(is_decoder=False)):
        return "encoders refused"
    if config_cls.kind == "rotary" and issubclass(config_cls, RopeConfig) and adapter.rotary_module_path is not None:
        return "native"
    if config_cls.kind in ("rotary", "bias"):
        return "attention"
    if config_cls.kind == "absolute":
        return "table slot" if adapter.absolute_table_path is not None else "embeddings"
    if config_cls.kind == "none":
        return "yes"
    return "per layer"


def support_matrix_markdown() -> str:
    """The matrix (families as rows), its legend, and each rotary family's note on native RoPE."""
    schemes = SCHEME_REGISTRY.names()
    lines = ["| family (model_type) | " + " | ".join(f"`{s}`" for s in schemes) + " |", "|---|" + "---|" * len(schemes)]
    for family in FAMILY_REGISTRY.names():
        lines.append(f"| `{family}` | " + " | ".join(support_cell(family, s) for s in schemes) + " |")
    lines.append("")
    lines += [f"- **{cell}**: {meaning}" for cell, meaning in LEGEND.items()]
    notes: dict[str, list[str]] = {}
    for family in FAMILY_REGISTRY.names():
        adapter = FAMILY_REGISTRY.get(family)
        if adapter.rotary_module_path is not None:
            notes.setdefault(adapter.native_rope_support, []).append(f"`{family}`")
    lines += [f"- native RoPE in {', '.join(families)}: {note}" for note, families in notes.items()]
    return "\n".join(lines)


def _documented_args(config_cls: type) -> dict[str, str]:
    """``name: text`` entries of the ``Args:`` section of a config class's docstring (continuation lines joined)."""
    doc = inspect.getdoc(config_cls) or ""
    section = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    entries: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        match = re.match(r"^    (\w+):\s*(.*)$", line)
        if match:
            name = match.group(1)
            entries[name] = match.group(2)
        elif name and line.startswith("        "):
            entries[name] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break  # the next section
    return entries


def scheme_options_text() -> str:
    """Every scheme with its options (``--option KEY=VALUE``), their defaults and what they do."""
    lines = ["Scheme options (pass with --option KEY=VALUE):"]
    for name in SCHEME_REGISTRY.names():
        config_cls = SCHEME_REGISTRY.get(name)
        summary = " ".join((inspect.getdoc(config_cls) or "").split("\n\n", 1)[0].split())  # first paragraph
        lines.append(f"  {name} ({config_cls.kind}): {summary}")
        documented = _documented_args(config_cls)
        fields = [field for field in dataclasses.fields(config_cls) if field.init]
        if not fields:
            lines.append("      no options")
        for field in fields:
            default = field.default if field.default is not dataclasses.MISSING else "required"
            if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = field.default_factory()  # type: ignore[misc]
            text = documented.get(field.name, "")
            lines.append(f"      {field.name}={default!r}" + (f"  {text}" if text else ""))
    return "\n".join(lines)
