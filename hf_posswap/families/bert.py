"""BERT: a learned absolute table at ``embeddings.position_embeddings``. BERT passes ``position_ids=None`` into
attention and gathers its ``token_type_ids`` buffer by position, so the position wrapper supplies explicit position
and token-type ids: inputs longer than ``max_position_embeddings`` then run for schemes without a length limit."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..edits import Edit, SetAttribute
from .base import FamilyAdapter, default_position_ids, register_family


@register_family
class BertAdapter(FamilyAdapter):
    name = "bert"
    model_types = ("bert",)
    native_positions = "learned absolute table (embeddings.position_embeddings)"
    lora_target_modules = ("query", "key", "value")
    absolute_table_path = "embeddings.position_embeddings"

    def is_self_attention(self, module: nn.Module) -> bool:
        return "CrossAttention" not in type(module).__name__

    def is_causal(self, config: Any) -> bool:
        return bool(config.is_decoder)

    def prepare_inputs(self, base: nn.Module, kwargs: dict[str, Any], query_offset: int) -> None:
        reference = kwargs.get("input_ids")
        if reference is None:
            reference = kwargs.get("inputs_embeds")
        if reference is None:
            return
        batch_size, length = reference.shape[0], reference.shape[1]
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = default_position_ids(length, query_offset, reference.device)
        if kwargs.get("token_type_ids") is None:
            kwargs["token_type_ids"] = torch.zeros(batch_size, length, dtype=torch.long, device=reference.device)

    def length_edits(self, model: nn.Module, max_positions: int) -> list[Edit]:
        embeddings = self.base_model(model).embeddings
        device = embeddings.position_ids.device
        return [
            *super().length_edits(model, max_positions),
            SetAttribute(
                embeddings,
                "position_ids",
                lambda: torch.arange(max_positions, device=device).expand((1, -1)),
                where=f"embeddings.position_ids buffer grown to {max_positions}",
            ),
            SetAttribute(
                embeddings,
                "token_type_ids",
                lambda: torch.zeros((1, max_positions), dtype=torch.long, device=device),
                where=f"embeddings.token_type_ids buffer grown to {max_positions}",
            ),
        ]

    def describe_native(self, model: nn.Module) -> str:
        return (
            f"learned absolute table (embeddings.position_embeddings, {model.config.max_position_embeddings} positions)"
        )
