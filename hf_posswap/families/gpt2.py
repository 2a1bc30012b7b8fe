"""GPT-2: a learned absolute table at ``transformer.wpe``; q/k are projected and cached inside attention with no
hook in between, so rotary schemes rotate inside the attention function."""

from __future__ import annotations

from torch import nn

from ..schemes.base import ModelSpec
from .base import FamilyAdapter, parameter_dtype_device, register_family


@register_family
class GPT2Adapter(FamilyAdapter):
    name = "gpt2"
    model_types = ("gpt2",)
    native_positions = "learned absolute table (transformer.wpe)"
    absolute_table_path = "wpe"

    def spec(self, model: nn.Module) -> ModelSpec:
        config = model.config
        base = self.base_model(model)
        dtype, device = parameter_dtype_device(base)
        table = getattr(base.wpe, "weight", None)
        return ModelSpec(
            model_type=config.model_type,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_attention_heads,
            head_dim=config.hidden_size // config.num_attention_heads,
            is_causal=True,
            max_positions=config.max_position_embeddings,
            initializer_range=config.initializer_range,
            native_rope_theta=None,
            dtype=dtype,
            device=device,
            existing_table=table,
        )

    def describe_native(self, model: nn.Module) -> str:
        return f"learned absolute table (transformer.wpe, {model.config.max_position_embeddings} positions)"
