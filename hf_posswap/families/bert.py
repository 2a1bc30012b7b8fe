"""BERT: a learned absolute table at ``embeddings.position_embeddings``. BERT passes ``position_ids=None`` into
attention and gathers its ``token_type_ids`` buffer by position, so the position hook supplies explicit position
and token-type ids: inputs longer than ``max_position_embeddings`` then run for schemes without a length limit."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..schemes.base import ModelSpec
from .base import FamilyAdapter, default_position_ids, parameter_dtype_device, register_family


@register_family
class BertAdapter(FamilyAdapter):
    name = "bert"
    model_types = ("bert",)
    native_positions = "learned absolute table (embeddings.position_embeddings)"
    absolute_table_path = "embeddings.position_embeddings"

    def is_self_attention(self, module: nn.Module) -> bool:
        return "CrossAttention" not in type(module).__name__

    def spec(self, model: nn.Module) -> ModelSpec:
        config = model.config
        base = self.base_model(model)
        dtype, device = parameter_dtype_device(base)
        table = getattr(base.embeddings.position_embeddings, "weight", None)
        return ModelSpec(
            model_type=config.model_type,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_attention_heads,
            head_dim=config.hidden_size // config.num_attention_heads,
            is_causal=bool(config.is_decoder),
            max_positions=config.max_position_embeddings,
            initializer_range=config.initializer_range,
            native_rope_theta=None,
            dtype=dtype,
            device=device,
            existing_table=table,
        )

    def prepare_inputs(self, base: nn.Module, kwargs: dict[str, Any], query_offset: int) -> None:
        reference = kwargs.get("input_ids")
        if reference is None:
            reference = kwargs.get("inputs_embeds")
        if reference is None:
            return
        batch_size, length = reference.shape[0], reference.shape[1]
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = default_position_ids(batch_size, length, query_offset, reference.device)
        if kwargs.get("token_type_ids") is None:
            kwargs["token_type_ids"] = torch.zeros(batch_size, length, dtype=torch.long, device=reference.device)

    def describe_native(self, model: nn.Module) -> str:
        return (
            "learned absolute table (embeddings.position_embeddings, "
            f"{model.config.max_position_embeddings} positions)"
        )
