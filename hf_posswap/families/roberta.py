"""RoBERTa: BERT's layout (learned table at ``embeddings.position_embeddings``, ``token_type_ids`` buffer gathered by
position), with RoBERTa's position numbering: a token's position id is ``padding_idx + 1 +`` its index among the
non-padding tokens of its row (built from ``input_ids``, so padding is skipped; ``padding_idx = pad_token_id``), and
the table has ``padding_idx + 1`` more rows than the model's context (514 for 512 tokens).

The position wrapper leaves ``position_ids`` to RoBERTa's own embeddings, so the table slot (the kept learned table or
a new absolute scheme) sees RoBERTa's numbering, exactly as the native model does; explicit ``position_ids`` are table
indices, as in transformers. In-attention schemes use token indices and the mask, or explicit ids in that numbering
counted from 0 (``first_position_id``: FIRE's normaliser reads the query's own position).
``token_type_ids`` are supplied as zeros (what the buffer holds), so inputs past the table run for schemes without
a length limit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import register_family
from .bert import BertAdapter


@register_family
class RobertaAdapter(BertAdapter):
    name = "roberta"
    model_types = ("roberta",)

    def prepare_inputs(self, base: nn.Module, kwargs: dict[str, Any], query_offset: int) -> None:
        reference = kwargs.get("input_ids")
        if reference is None:
            reference = kwargs.get("inputs_embeds")
        if reference is None or kwargs.get("token_type_ids") is not None:
            return
        shape = (reference.shape[0], reference.shape[1])
        kwargs["token_type_ids"] = torch.zeros(shape, dtype=torch.long, device=reference.device)

    def absolute_position_ids(self, base: nn.Module, kwargs: dict[str, Any], query_offset: int) -> torch.Tensor | None:
        """RoBERTa's numbering for vectors the position wrapper adds (``combine="concat"``), as ``RobertaEmbeddings``
        builds it: from input ids, ``padding_idx + 1 + (index among the row's non-padding tokens)``, padding at
        ``padding_idx``; from embeddings alone, ``padding_idx + 1 ..``."""
        padding_idx = base.config.pad_token_id
        input_ids = kwargs.get("input_ids")
        if input_ids is not None:
            real = input_ids.ne(padding_idx).long()  # [B, L]
            return (real.cumsum(dim=1) + query_offset) * real + padding_idx
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            return None
        start = padding_idx + 1 + query_offset
        return torch.arange(start, start + embeds.shape[1], device=embeds.device).unsqueeze(0)

    def first_position_id(self, base: nn.Module) -> int:
        return base.config.pad_token_id + 1

    def describe_native(self, model: nn.Module) -> str:
        first = model.config.pad_token_id + 1
        return (
            f"learned absolute table (embeddings.position_embeddings, {model.config.max_position_embeddings} rows; "
            f"positions start at padding_idx + 1 = {first})"
        )
