"""LLaMA and decoders with LLaMA's layout (Mistral, Qwen2, Qwen3, OLMo 2): no absolute table; one rotary module at
``model.rotary_emb`` whose (cos, sin) every layer applies to q and k before the KV-cache update.

RoPE swaps are written into ``config.rope_parameters`` and the model's own rotary class is rebuilt from it, which
is exactly what transformers builds from that config: such checkpoints load in vanilla transformers. Other
schemes replace the rotary module by :class:`~hf_posswap.families.base.IdentityRotary` (cos = 1, sin = 0,
an exact no-op).
"""

from __future__ import annotations

from torch import nn

from ..edits import Edit
from ..schemes.rope import RopeConfig
from ..schemes.two_pass import TwoPassScaling
from ..transformers_internals import config_rope_parameters
from .base import FamilyAdapter, rebuild_rotary_edits, register_family


@register_family
class LlamaAdapter(FamilyAdapter):
    name = "llama"
    model_types = ("llama", "mistral", "qwen2", "qwen3", "olmo2")
    native_positions = "RoPE (model.rotary_emb, config.rope_parameters)"
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj")
    rotary_module_path = "rotary_emb"

    def native_rope_edits(self, model: nn.Module, config: RopeConfig) -> list[Edit] | None:
        if not config.rotates_full_head:
            return None  # LLaMA's apply_rotary_pos_emb rotates whole heads; partial RoPE goes in attention
        if isinstance(config.scaling, TwoPassScaling):
            return None  # grouped positions need unrotated cached keys: RoPE goes in attention
        rope_parameters = config.rope_parameters(self.spec(model).head_dim)
        return rebuild_rotary_edits(model, self.base_model(model), rope_parameters)

    def describe_native(self, model: nn.Module) -> str:
        return f"RoPE (rotary_emb, rope_parameters={config_rope_parameters(model.config)})"
