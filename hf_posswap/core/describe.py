"""``describe(model)``: which position scheme a model carries, with which settings, where, and what is new."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..families.base import FAMILY_REGISTRY
from ..transformers_internals import attention_implementation
from .layer_plan import describe_layers
from .native import check_loaded, unwrap_peft
from .state import swap_state


@dataclass
class PositionDescription:
    """Structured answer of :func:`describe`; ``str()`` renders it for people."""

    model_class: str
    family: str | None
    scheme: str
    settings: dict[str, Any] = field(default_factory=dict)
    native: bool = True
    attn_implementation: str | None = None
    where: list[str] = field(default_factory=list)
    new_parameters: list[tuple[str, tuple[int, ...], bool]] = field(default_factory=list)
    context: dict[str, Any] | None = None
    #: a layer mix: each part (name and settings) -> its layers
    layers: dict[str, list[int]] | None = None

    def __str__(self) -> str:
        lines = [f"{self.model_class} (family: {self.family or 'unsupported'})", f"  scheme: {self.scheme}"]
        if self.settings:
            settings = ", ".join(f"{key}={value!r}" for key, value in self.settings.items())
            lines.append(f"  settings: {settings}")
        if self.layers:
            lines.append("  layers:")
            lines += [f"    - {part}: {', '.join(map(str, layers))}" for part, layers in self.layers.items()]
        lines.append(f"  expressed natively by transformers: {'yes' if self.native else 'no'}")
        if self.context:
            lines.append(
                f"  context: extended from {self.context['original_max_position_embeddings']} to "
                f"{self.context['max_position_embeddings']} tokens with '{self.context['method']}'"
            )
            if self.context.get("cache_note"):
                lines.append(f"    cache: {self.context['cache_note']}")
        if self.attn_implementation:
            lines.append(f"  attention implementation: {self.attn_implementation}")
        if self.where:
            lines.append("  changes:")
            lines += [f"    - {item}" for item in self.where]
        if self.new_parameters:
            lines.append("  new parameters:")
            lines += [
                f"    - {name} {list(shape)}{'' if trainable else ' (frozen)'}"
                for name, shape, trainable in self.new_parameters
            ]
        elif self.scheme != "native":
            lines.append("  new parameters: none")
        return "\n".join(lines)


def describe(model: nn.Module) -> PositionDescription:
    """Describe the position mechanism of ``model`` (swapped or not; peft wrappers are looked through).

    Raises InvalidConfigError for a model loaded as the plain architecture from a swapped checkpoint
    (``hf_posswap.core.native.check_loaded``): calling it "native" would be wrong.
    """
    model = unwrap_peft(model)
    check_loaded(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "posswap_base_model_type", None) or getattr(config, "model_type", None)
    adapter = FAMILY_REGISTRY.get(model_type) if model_type in FAMILY_REGISTRY else None
    attn = attention_implementation(config)
    state = swap_state(model)
    if state is None:
        native = adapter.describe_native(model) if adapter is not None else "unknown (unsupported family)"
        return PositionDescription(
            type(model).__name__,
            adapter.name if adapter else None,
            "native",
            {"mechanism": native},
            True,
            attn,
        )
    settings = {key: value for key, value in state.config.to_dict().items() if key != "scheme"}
    layers = describe_layers(state.config, model.config.num_hidden_layers)
    if layers is not None:  # a layer mix: its parts are listed per layer; its own settings are the temperature's
        tuned = settings.get("attn_temperature_tuning")
        settings = {key: value for key, value in settings.items() if tuned and key not in ("default", "overrides")}
    return PositionDescription(
        model_class=type(model).__name__,
        family=state.family,
        scheme=state.config.name,
        settings=settings,
        native=state.native,
        attn_implementation=attn,
        where=[edit.where for edit in state.edits if edit.where],
        new_parameters=list(state.new_parameters),
        context=_context(state),
        layers=layers,
    )


def _context(state: Any) -> dict[str, Any] | None:
    if not state.extension:
        return None
    context = dict(state.extension)
    scaling = getattr(state.config, "scaling", None)
    if scaling is not None and scaling.length_dependent:
        context["cache_note"] = _cache_note(scaling.method, state.native)
    return context


def _cache_note(method: str, native: bool) -> str:
    """What happens with the KV cache for a length-dependent method (tested in tests/core/test_extend.py)."""
    if method == "self_extend":
        return (
            "a query's grouped distances depend only on its own and its keys' positions, not on the current "
            "length, so generation with the KV cache equals a full recompute."
        )
    if native:
        return (
            "the frequencies depend on the current length. Natively (LLaMA-like), keys already in the KV cache keep "
            "the frequencies they were rotated with, so once a generation crosses the original length its cached "
            "keys differ from a full recompute."
        )
    return (
        "the frequencies depend on the current length. Rotated inside attention: cached keys are re-rotated each "
        "step, so generation with the KV cache equals a full recompute."
    )
