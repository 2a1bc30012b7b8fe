"""Phi-3: LLaMA's layout with fused projections (``qkv_proj``, ``gate_up_proj``) and partial rotary
(``rope_parameters["partial_rotary_factor"]``: Phi-3's ``apply_rotary_pos_emb`` rotates the first ``cos.shape[-1]``
dims of each head and passes the rest through). One rotary module at ``model.rotary_emb``.

Phi-3's config accepts only the ``default`` and ``longrope`` rope types (``Phi3Config`` rejects others), so RoPE
swaps of those types are written natively (``rope_parameters`` + the rotary class rebuilt, reloadable in vanilla
transformers); every other scaling (linear, NTK, YaRN, Llama 3, Self-Extend) runs inside attention.
"""

from __future__ import annotations

from torch import nn

from ..edits import Edit
from ..schemes.rope import RopeConfig
from ..transformers_internals import config_rope_parameters
from .base import FamilyAdapter, native_partial_rope_edits, register_family

#: the rope types ``Phi3Config.validate_rope`` accepts
PHI3_ROPE_TYPES = ("default", "longrope")


@register_family
class Phi3Adapter(FamilyAdapter):
    name = "phi3"
    model_types = ("phi3",)
    native_positions = "partial RoPE (model.rotary_emb, config.rope_parameters)"
    lora_target_modules = ("qkv_proj", "o_proj")
    rotary_module_path = "rotary_emb"
    native_rope_support = "native for default/longrope, partial too (rope_parameters); other scalings in attention"

    def native_rope_edits(self, model: nn.Module, config: RopeConfig) -> list[Edit] | None:
        head_dim = self.spec(model).head_dim
        return native_partial_rope_edits(model, self.base_model(model), config, head_dim, PHI3_ROPE_TYPES)

    def describe_native(self, model: nn.Module) -> str:
        return f"partial RoPE (rotary_emb, rope_parameters={config_rope_parameters(model.config)})"
