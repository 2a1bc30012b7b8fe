"""Position schemes per layer: :class:`LayerMix` gives every layer exactly one scheme (a *part*).

The designs newer models ship: SmolLM3 drops RoPE in every 4th layer (``config.no_rope_layers``), Llama 4's iRoPE
makes every 4th layer NoPE and scales the queries of those layers by an attention temperature (Meta 2025; the
temperature is "Scalable-Softmax"-style tuning, Nakanishi 2025, arXiv:2501.19399), Cohere2 applies RoPE only on
its sliding-window layers. A part is any registered scheme whose kind works inside attention (rotary, bias) or
none; absolute schemes add their vectors once, to the embeddings, so they have no per-layer form.

Which layer has which part: :meth:`LayerMix.layer_schemes` (one config per layer) and :meth:`LayerMix.parts`
(each part with its layers). The module :class:`MixPositions` holds one module per used part; called with a
layer index it returns that layer's module, so peft's ``modules_to_save`` copy is the one used.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import InvalidConfigError
from .base import SCHEME_REGISTRY, ModelSpec, SchemeConfig, register_scheme, require_bool, scheme_config_from_dict
from .head_mix import HeadMix
from .rope import RopeConfig

#: part kinds a layer may carry (absolute schemes act once, on the embeddings)
PART_KINDS = ("rotary", "bias", "none", "head_mix")
#: transformers' Llama 4 defaults (configuration_llama4.py: floor_scale=8192, attn_scale=0.1)
LLAMA4_FLOOR_SCALE = 8192
LLAMA4_ATTN_SCALE = 0.1


def llama4_attn_scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's query temperature on NoPE layers: log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1.

    As transformers computes it (models/llama4/modeling_llama4.py, ``Llama4TextAttention.forward``:
    ``torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0``).
    positions [...] -> scales [...] (float32).
    """
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class QueryTemperature(nn.Module):
    """A NoPE layer's query scale (Llama 4 iRoPE): called with query positions, returns the scales (float32)."""

    def __init__(self, floor_scale: float, attn_scale: float) -> None:
        super().__init__()
        self.floor_scale, self.attn_scale = floor_scale, attn_scale

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return llama4_attn_scales(positions, self.floor_scale, self.attn_scale)

    def extra_repr(self) -> str:
        return f"floor_scale={self.floor_scale}, attn_scale={self.attn_scale}"


class MixPositions(nn.Module):
    """The modules of a layer mix: ``parts[str(i)]`` for each part that has one; ``layer_part[layer]`` = its part.

    ``forward(layer_idx)`` returns the module of that layer's part (None: a NoPE layer without temperature).
    """

    def __init__(self, modules: list[nn.Module | None], layer_part: list[int]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({str(index): module for index, module in enumerate(modules) if module is not None})
        self.layer_part = list(layer_part)

    def forward(self, layer_idx: int) -> nn.Module | None:
        key = str(self.layer_part[layer_idx])
        return self.parts[key] if key in self.parts else None

    def extra_repr(self) -> str:
        return f"layer_part={self.layer_part}"


def _name_of(part: Any) -> str:
    return part.name if isinstance(part, SchemeConfig) else str(part)


def _part_config(value: Any, where: str) -> SchemeConfig:
    """A part given as a registered name, a config, or a config's ``to_dict()``."""
    if isinstance(value, dict) and value.get("scheme") == HeadMix.name:  # not registered: it lives in mixes only
        value = HeadMix.from_options(**{key: item for key, item in value.items() if key != "scheme"})
    elif isinstance(value, dict):
        value = scheme_config_from_dict(value)
    elif value == HeadMix.name:
        value = HeadMix()
    elif isinstance(value, str):
        value = SCHEME_REGISTRY.get(value)()
    if not isinstance(value, SchemeConfig):
        raise InvalidConfigError(
            f"LayerMix {where} must be a registered scheme name or a SchemeConfig such as hf_posswap.AlibiConfig(), "
            f"got {type(value).__name__}: {value!r}."
        )
    if isinstance(value, LayerMix):
        raise InvalidConfigError(
            f"LayerMix {where} is itself a LayerMix: mixes do not nest (every layer gets exactly one scheme). "
            "Write the layers of the inner mix into the outer mix's overrides."
        )
    if value.kind not in PART_KINDS:
        raise InvalidConfigError(
            f"LayerMix {where} is '{value.name}', an {value.kind} scheme: absolute schemes add their vectors once, "
            f"to the token embeddings, so they cannot be given per layer. Swap to it for the whole model "
            f"(hf_posswap.swap(model, '{value.name}')) or give the layers a scheme of kind "
            f"{', '.join(k for k in PART_KINDS if k != 'head_mix')} (rope, alibi, t5, none, ...)."
        )
    return value


def _layer_list(value: Any, where: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InvalidConfigError(f"LayerMix {where} must be a list of layer indices such as [3, 7, 11], got {value!r}.")
    layers = tuple(value)
    bad = [index for index in layers if isinstance(index, bool) or not isinstance(index, int) or index < 0]
    if bad or not layers:
        raise InvalidConfigError(
            f"LayerMix {where} must list layer indices, integers >= 0 (layer 0 is the first), got {list(layers)!r}"
            f"{f'; not valid: {bad!r}' if bad else ' (empty)'}."
        )
    return layers


@register_scheme
@dataclass
class LayerMix(SchemeConfig):
    """A position scheme per layer: ``default`` on every layer, except the layers listed in ``overrides``.

    ``LayerMix(default="rope", overrides={"none": [3, 7, 11]})`` is SmolLM3's layout for 12 layers. Presets for
    the published designs: :mod:`hf_posswap.schemes.presets`.

    Args:
        default: the scheme of every layer not in ``overrides``: a registered name or a SchemeConfig.
        overrides: ``{scheme name: [layer indices]}``, or a list of ``(name or SchemeConfig, [layer indices])``
            pairs (configs are not dict keys). A layer may appear in one override only.
        attn_temperature_tuning: Llama 4's attention temperature on the NoPE layers (``none`` parts): queries are
            scaled by log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1 (transformers' Llama 4 names).
        floor_scale: tokens per temperature step (Llama 4: 8192).
        attn_scale: temperature strength (Llama 4: 0.1).
    """

    name = "layer_mix"
    kind = "mix"
    paper = "SmolLM3 (Hugging Face 2025) no_rope_layers; Llama 4 iRoPE (Meta 2025); Cohere Command A (2025)"

    default: Any = "rope"
    overrides: Any = field(default_factory=dict)
    attn_temperature_tuning: bool = False
    floor_scale: float = LLAMA4_FLOOR_SCALE
    attn_scale: float = LLAMA4_ATTN_SCALE

    def validate(self) -> None:
        self.default = _part_config(self.default, "default")
        pairs = self.overrides.items() if isinstance(self.overrides, dict) else self.overrides
        if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__iter__"):
            raise InvalidConfigError(
                f"LayerMix overrides must be {{scheme: [layers]}} or a list of (scheme, [layers]) pairs, got "
                f"{self.overrides!r}."
            )
        normalized: list[tuple[SchemeConfig, tuple[int, ...]]] = []
        owner: dict[int, str] = {}
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise InvalidConfigError(f"LayerMix overrides entry {pair!r} must be a (scheme, [layers]) pair.")
            if isinstance(pair[0], int) and not isinstance(pair[0], bool) and isinstance(pair[1], (str, SchemeConfig)):
                raise InvalidConfigError(
                    f"LayerMix overrides entry {tuple(pair)!r} is (layer, scheme); overrides go the other way round: "
                    f"{{scheme: [layers]}}, e.g. overrides={{{_name_of(pair[1])!r}: [{pair[0]}]}}."
                )
            part = _part_config(pair[0], f"override {pair[0]!r}")
            layers = _layer_list(pair[1], f"override for '{part.name}'")
            for index in layers:
                if index in owner:
                    raise InvalidConfigError(
                        f"LayerMix lists layer {index} twice (in the overrides for '{owner[index]}' and "
                        f"'{part.name}'); every layer gets exactly one scheme. Keep the layer in one override."
                    )
                owner[index] = part.name
            normalized.append((part, layers))
        self.overrides = normalized
        self._validate_temperature()

    def _validate_temperature(self) -> None:
        require_bool("LayerMix", "attn_temperature_tuning", self.attn_temperature_tuning)
        for name in ("floor_scale", "attn_scale"):
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if not number or not (value > 0 if name == "floor_scale" else value >= 0):  # type first: None > 0 raises
                bound = "> 0" if name == "floor_scale" else ">= 0"
                raise InvalidConfigError(
                    f"LayerMix.{name} must be a finite number {bound}, got {value!r} (Llama 4 uses floor_scale="
                    f"{LLAMA4_FLOOR_SCALE}, attn_scale={LLAMA4_ATTN_SCALE})."
                )
        if self.attn_temperature_tuning and not any(part.kind == "none" for part, _ in self._all_parts()):
            raise InvalidConfigError(
                "LayerMix(attn_temperature_tuning=True) scales the queries of the NoPE layers (Llama 4 iRoPE), and "
                "this mix has no 'none' layer. Give some layers 'none' (overrides={'none': [3, 7]}) or leave "
                "attn_temperature_tuning False."
            )

    def _all_parts(self) -> list[tuple[SchemeConfig, tuple[int, ...] | None]]:
        return [(self.default, None), *self.overrides]

    @property
    def layer_shared(self) -> bool:
        return False

    # --- which layer has which scheme ----------------------------------------------------------------------------
    def check_layers(self, num_layers: int) -> None:
        """Every override index must name a layer of a model with ``num_layers`` layers."""
        for part, layers in self.overrides:
            outside = [index for index in layers if index >= num_layers]
            if outside:
                raise InvalidConfigError(
                    f"LayerMix override for '{part.name}' lists layers {outside}, but the model has {num_layers} "
                    f"layers (indices 0 to {num_layers - 1}). Use indices below {num_layers}."
                )

    def layer_schemes(self, num_layers: int) -> list[SchemeConfig]:
        """The scheme config of each layer 0 .. num_layers - 1."""
        self.check_layers(num_layers)
        schemes = [self.default] * num_layers
        for part, layers in self.overrides:
            for index in layers:
                schemes[index] = part
        return schemes

    def parts(self, num_layers: int) -> list[tuple[SchemeConfig, list[int]]]:
        """Each part that some layer has, with its layers (the default first)."""
        found = [(self.default, [i for i in range(num_layers) if i not in self._overridden()])]
        found += [(part, sorted(layers)) for part, layers in self.overrides]
        return [(part, layers) for part, layers in found if layers]

    def _overridden(self) -> set[int]:
        return {index for _, layers in self.overrides for index in layers}

    def replace_parts(self, change: Any) -> LayerMix:
        """A copy with every part replaced by ``change(part)`` (``extend_context`` scales the RoPE parts)."""
        overrides = [(change(part), list(layers)) for part, layers in self.overrides]
        return dataclasses.replace(self, default=change(self.default), overrides=overrides)

    def rope_parts(self) -> list[RopeConfig]:
        """The RoPE configs of the mix's layers (a head mix's rotary heads included)."""
        parts = [part.rotary if isinstance(part, HeadMix) else part for part, _ in self._all_parts()]
        return [part for part in parts if isinstance(part, RopeConfig)]

    # --- building ------------------------------------------------------------------------------------------------
    def resolve(self, spec: ModelSpec) -> LayerMix:
        self.check_layers(spec.num_layers)
        return self.replace_parts(lambda part: part.resolve(spec))

    def build(self, spec: ModelSpec) -> MixPositions:
        parts = self.parts(spec.num_layers)
        modules: list[nn.Module | None] = []
        layer_part = [0] * spec.num_layers
        for index, (part, layers) in enumerate(parts):
            module = part.build(spec)
            if module is None and part.kind == "none" and self.attn_temperature_tuning:
                module = QueryTemperature(self.floor_scale, self.attn_scale)
            modules.append(module)
            for layer in layers:
                layer_part[layer] = index
        return MixPositions(modules, layer_part)

    def layer_kinds(self, num_layers: int) -> list[str]:
        """The kind of each layer's part at run time ("temperature" for NoPE layers with Llama 4's temperature)."""
        kinds = []
        for part in self.layer_schemes(num_layers):
            tuned = part.kind == "none" and self.attn_temperature_tuning
            kinds.append("temperature" if tuned else part.kind)
        return kinds

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheme": self.name,
            "default": self.default.to_dict(),
            "overrides": [[part.to_dict(), list(layers)] for part, layers in self.overrides],
            "attn_temperature_tuning": self.attn_temperature_tuning,
            "floor_scale": self.floor_scale,
            "attn_scale": self.attn_scale,
        }
