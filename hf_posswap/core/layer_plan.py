"""Runtime glue of a layer mix (:class:`~hf_posswap.schemes.mix.LayerMix`): the per-layer plan the position wrapper
hands to attention, the ``swap(model, scheme, layers=[...])`` shorthand, and the RoPE parts ``extend_context``
scales.

Every layer of a mixed model goes through hf_posswap's attention carriers; the family's own position mechanism
is removed (LLaMA's ``rotary_emb`` becomes an exact no-op and its RoPE layers rotate inside attention), so one
machinery places every part. The per-layer context (:meth:`PositionContext.for_layer`) gives each layer its
part's module, kind and a memo shared by the layers of that part, so the rotary, bias, fused and Self-Extend
paths run per layer unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import InvalidConfigError
from ..families.base import FamilyAdapter
from ..schemes.base import ModelSpec, SchemeConfig
from ..schemes.head_mix import HeadMix
from ..schemes.mix import LayerMix
from ..schemes.rope import RopeConfig
from ..schemes.rope_scaling import SCALING_REGISTRY, RopeScaling
from ..schemes.two_pass import TwoPassSettings
from ..transformers_internals import config_rope_parameters


@dataclass(frozen=True)
class LayerPlan:
    """What a layer mix fixes at swap time, per layer: the kind of its part (``temperature``: a NoPE layer with
    Llama 4's query temperature), the part's index (layers of one part share a memo), whether the part shares its
    positions across its layers, and its two-pass settings (Self-Extend, ReRoPE)."""

    kinds: tuple[str, ...]
    parts: tuple[int, ...]
    shared: tuple[bool, ...]
    two_pass: tuple[TwoPassSettings | None, ...]  # per layer: the part's two-pass settings, or None

    @property
    def needs_padded_positions(self) -> bool:
        """Self-Extend and the query temperature depend on absolute positions (padding must not count)."""
        return "temperature" in self.kinds or any(settings is not None for settings in self.two_pass)


#: transformers rope types that hf_posswap's scalings express with the same fields
NATIVE_SCALINGS = ("linear", "dynamic", "yarn", "longrope", "llama3")


def layer_plan(
    config: LayerMix, spec: ModelSpec, two_pass: Callable[[SchemeConfig], TwoPassSettings | None]
) -> LayerPlan:
    """The per-layer facts of a (resolved) mix: kind, part index, shared positions, two-pass settings."""
    parts = config.parts(spec.num_layers)
    part_of = [0] * spec.num_layers
    for index, (_, layers) in enumerate(parts):
        for layer in layers:
            part_of[layer] = index
    schemes = config.layer_schemes(spec.num_layers)
    return LayerPlan(
        kinds=tuple(config.layer_kinds(spec.num_layers)),
        parts=tuple(part_of),
        shared=tuple(scheme.layer_shared for scheme in schemes),
        two_pass=tuple(two_pass(scheme) for scheme in schemes),
    )


def native_part(model: nn.Module, adapter: FamilyAdapter, rope_parameters: dict | None = None) -> SchemeConfig:
    """The scheme the model's own layers have, as a part of a mix (``swap(model, scheme, layers=...)`` keeps it on
    the other layers): LLaMA-like models' RoPE from ``config.rope_parameters`` (or the ``rope_parameters`` of one
    layer type, given)."""
    if adapter.rotary_module_path is None:
        raise InvalidConfigError(
            f"swap(model, ..., layers=[...]) keeps the model's own positions on the other layers, and "
            f"{type(model).__name__}'s are {adapter.native_positions}: absolute vectors added once to the embeddings, "
            "not a per-layer mechanism. Say what the other layers get: hf_posswap.swap(model, "
            "hf_posswap.LayerMix(default='rope', overrides={'none': [...]}))."
        )
    rope = dict(rope_parameters or config_rope_parameters(model.config))
    rope_type = rope.get("rope_type", "default")
    if rope.get("partial_rotary_factor", 1.0) != 1.0 or rope_type not in ("default", *NATIVE_SCALINGS):
        raise InvalidConfigError(
            f"swap(model, ..., layers=[...]) keeps the model's own RoPE on the other layers, and this model's "
            f"rope_parameters {rope} cannot be rebuilt per layer (partial rotary, or rope_type '{rope_type}'; "
            f"kept: default, {', '.join(NATIVE_SCALINGS)}). Give the default explicitly: "
            "hf_posswap.LayerMix(default=hf_posswap.RopeConfig(...), overrides=...)."
        )
    return RopeConfig(rope_theta=rope.get("rope_theta"), scaling=native_scaling(rope))


def native_scaling(rope: dict) -> RopeScaling | None:
    """The scaling of transformers' ``rope_parameters`` ``rope`` as hf_posswap's (the same fields), or None for
    ``default`` and for rope types that are not a scaling hf_posswap has (:data:`NATIVE_SCALINGS`)."""
    rope_type = rope.get("rope_type", "default")
    if rope_type not in NATIVE_SCALINGS:
        return None
    known = {field.name for field in dataclasses.fields(SCALING_REGISTRY.get(rope_type))}
    return SCALING_REGISTRY.get(rope_type).from_options(**{k: v for k, v in rope.items() if k in known})


def with_own_scaling(model: nn.Module, adapter: FamilyAdapter, config: SchemeConfig) -> SchemeConfig:
    """``swap(model, "rope")`` keeps the model's own RoPE, scaling included: a plain RoPE config that names no
    scaling gets the one in the model's ``rope_parameters`` (Llama 3.1's ``llama3``, a YaRN checkpoint's ``yarn``),
    as ``rope_theta=None`` keeps its base; dropping it would change every logit past the scaled frequencies. Models
    with one RoPE per layer type (Gemma 3) and RoPE variants (xPos, p-RoPE) are left as they are."""
    if type(config) is not RopeConfig or config.scaling is not None or adapter.rotary_module_path is None:
        return config
    if per_type_rope(model):
        return config
    scaling = native_scaling(config_rope_parameters(model.config))
    return config if scaling is None else dataclasses.replace(config, scaling=scaling)


def as_layer_mix(config: SchemeConfig) -> SchemeConfig:
    """A head mix alone acts on every layer: ``LayerMix(default=head_mix)``; other configs are returned as they are."""
    return LayerMix(default=config) if isinstance(config, HeadMix) else config


def mix_on_layers(model: nn.Module, adapter: FamilyAdapter, config: SchemeConfig, layers: Sequence[int]) -> LayerMix:
    """``swap(model, config, layers=layers)``: ``config`` on those layers, the model's own positions elsewhere."""
    if isinstance(config, LayerMix):
        raise InvalidConfigError(
            "swap(model, LayerMix(...), layers=[...]) nests a mix in a mix; a LayerMix already says which layers "
            "get which scheme. Leave out layers=."
        )
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise InvalidConfigError(f"layers= must be a list of layer indices such as [3, 7, 11], got {layers!r}.")
    layers = list(layers)
    types = per_type_rope(model)
    if not types:
        return LayerMix(default=native_part(model, adapter), overrides=[(config, layers)])
    # Gemma 3: one RoPE per layer type (local theta 1e4, global 1e6); each kept layer keeps its type's
    parts = [(native_part(model, adapter, rope), [i for i in kept if i not in layers]) for rope, kept in types]
    kept_parts = [(part, kept) for part, kept in parts[1:] if kept]
    return LayerMix(default=parts[0][0], overrides=[*kept_parts, (config, layers)])


def per_type_rope(model: nn.Module) -> list[tuple[dict, list[int]]]:
    """``[(rope_parameters, layers)]`` per layer type when ``config.rope_parameters`` is nested by
    ``config.layer_types`` (Gemma 3); empty for one RoPE on every layer."""
    rope = config_rope_parameters(model.config)
    layer_types = list(getattr(model.config, "layer_types", None) or [])
    if not layer_types or not all(isinstance(rope.get(kind), dict) for kind in layer_types):
        return []
    return [(rope[kind], [i for i, t in enumerate(layer_types) if t == kind]) for kind in dict.fromkeys(layer_types)]


def own_theta_per_layer_type(model: nn.Module, config: LayerMix) -> LayerMix:
    """On a model with one RoPE per layer type (Gemma 3: local θ 1e4, global 1e6), a RoPE part that keeps "the
    model's own base" (``rope_theta=None``) gets, on each layer, the base of that layer's type; other parts and
    models with one RoPE stay as they are."""
    types = per_type_rope(model)
    if not types:
        return config
    num_layers = len(getattr(model.config, "layer_types", None) or [])
    pairs: list[tuple[SchemeConfig, list[int]]] = []
    for part, layers in config.parts(num_layers):
        if not (isinstance(part, RopeConfig) and part.rope_theta is None):
            pairs.append((part, layers))
            continue
        for parameters, type_layers in types:
            chosen = sorted(set(layers) & set(type_layers))
            if chosen:
                pairs.append((dataclasses.replace(part, rope_theta=parameters.get("rope_theta")), chosen))
    if all(not (isinstance(part, RopeConfig) and part.rope_theta is None) for part, _ in config.parts(num_layers)):
        return config
    return dataclasses.replace(config, default=pairs[0][0], overrides=pairs[1:])


def scale_rope_parts(config: LayerMix, change: Callable[[RopeConfig], RopeConfig]) -> LayerMix:
    """The mix with ``change`` applied to its RoPE parts only (``extend_context``); other parts stay."""

    def scaled(part: SchemeConfig) -> SchemeConfig:
        if isinstance(part, HeadMix):
            return part.with_rotary(lambda rotary: change(rotary) if isinstance(rotary, RopeConfig) else rotary)
        return change(part) if isinstance(part, RopeConfig) else part

    return config.replace_parts(scaled)


def describe_layers(config: Any, num_layers: int) -> dict[str, list[int]] | None:
    """``{"rope(rope_theta=10000.0)": [0, 1, 2], "none": [3]}`` for a mix; None for one scheme."""
    if not isinstance(config, LayerMix):
        return None
    described: dict[str, list[int]] = {}
    for part, layers in config.parts(num_layers):
        settings = {key: value for key, value in part.to_dict().items() if key != "scheme" and value is not None}
        label = part.name + (f"({', '.join(f'{k}={v!r}' for k, v in settings.items())})" if settings else "")
        if part.kind == "none" and config.attn_temperature_tuning:
            label += f" + attention temperature (floor_scale={config.floor_scale}, attn_scale={config.attn_scale})"
        described.setdefault(label, []).extend(layers)
    return described
