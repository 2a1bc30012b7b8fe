"""GPT-2: a learned absolute table at ``transformer.wpe``; q/k are projected and cached inside attention with no
hook in between, so rotary schemes rotate inside the attention function."""

from __future__ import annotations

from torch import nn

from .base import FamilyAdapter, register_family


@register_family
class GPT2Adapter(FamilyAdapter):
    name = "gpt2"
    model_types = ("gpt2",)
    native_positions = "learned absolute table (transformer.wpe)"
    lora_target_modules = ("c_attn", "c_proj")
    absolute_table_path = "wpe"

    def describe_native(self, model: nn.Module) -> str:
        return f"learned absolute table (transformer.wpe, {model.config.max_position_embeddings} positions)"
