"""Gemma 3 (text): LLaMA's layout plus q/k RMSNorm (applied before RoPE, so nothing here depends on it),
sliding-window layers and one RoPE per layer type. ``config.layer_types`` names each layer ``sliding_attention``
(local) or ``full_attention`` (global); ``config.rope_parameters`` is nested by layer type (local θ = 10^4, global
θ = 10^6, with linear ×8 on the 128K checkpoints; Gemma Team 2025, "Gemma 3 Technical Report", §2.3), and the one
rotary module ``model.rotary_emb(x, position_ids, layer_type)`` returns each type's (cos, sin).

A RoPE swap sets the RoPE of the **global** layers; local layers keep their own. That is Gemma 3's own design:
local layers never attend past ``sliding_window`` tokens, so they need no scaling, and the report scales only the
global layers' RoPE (factor 8) to reach 128K. ``extend_context`` with YaRN therefore scales the global layers and
leaves the local θ = 10^4 unscaled. ``rope_theta=None`` keeps the global layers' own base. Such swaps are written
natively (nested ``rope_parameters`` + the rotary class rebuilt) and reload in vanilla transformers. Partial rotary
and Self-Extend run inside attention, with one RoPE for every layer. Other schemes replace the rotary module by
:class:`~hf_posswap.families.base.IdentityRotary` for all layer types.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..edits import Edit
from ..schemes.base import ModelSpec
from ..schemes.rope import RopeConfig
from ..schemes.two_pass import TwoPassScaling
from ..transformers_internals import config_rope_parameters
from .base import FamilyAdapter, rebuild_rotary_edits, register_family

GLOBAL_LAYER_TYPE = "full_attention"


@register_family
class Gemma3Adapter(FamilyAdapter):
    name = "gemma3_text"
    model_types = ("gemma3_text",)
    native_positions = "RoPE per layer type (model.rotary_emb, config.rope_parameters by layer_types)"
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj")
    rotary_module_path = "rotary_emb"
    native_rope_support = "native: the global layers' rope_parameters, local layers kept (partial: in attention)"

    def spec(self, model: nn.Module) -> ModelSpec:
        """The global layers' θ is the model's own base (the one ``RopeConfig(rope_theta=None)`` keeps)."""
        theta = _global_parameters(model.config)["rope_theta"]
        return dataclasses.replace(super().spec(model), native_rope_theta=theta)

    def native_rope_edits(self, model: nn.Module, config: RopeConfig) -> list[Edit] | None:
        if config.partial_rotary_factor != 1.0 or isinstance(config.scaling, TwoPassScaling):
            return None  # Gemma 3's rotary class rotates whole heads; Self-Extend needs unrotated cached keys
        current = config_rope_parameters(model.config)
        new = config.rope_parameters(self.spec(model).head_dim)
        scaled = _scaled_layer_types(model.config)
        rope_parameters = {kind: dict(new) if kind in scaled else dict(current[kind]) for kind in current}
        return rebuild_rotary_edits(model, self.base_model(model), rope_parameters)

    def describe_native(self, model: nn.Module) -> str:
        return f"RoPE per layer type (rotary_emb, rope_parameters={config_rope_parameters(model.config)})"


def _scaled_layer_types(config: Any) -> set[str]:
    """Layer types a RoPE swap sets: the global ones, or every type when the model has no global layer."""
    types = set(config.layer_types)
    return {GLOBAL_LAYER_TYPE} if GLOBAL_LAYER_TYPE in types else types


def _global_parameters(config: Any) -> dict[str, Any]:
    """rope_parameters of the global layers (of the first scaled type when there are none)."""
    return config_rope_parameters(config)[sorted(_scaled_layer_types(config))[0]]
