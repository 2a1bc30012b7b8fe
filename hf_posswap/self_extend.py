"""Self-Extend attention (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning",
arXiv:2401.01325, Algorithm 1).

Two logits per (query, key): with the exact positions ("neighbour" attention) and with grouped positions
floor(pos / G), the query's shifted by W - floor(W / G) so grouped distances continue where the window ends.
Keys closer than W to the query take the neighbour logit, the others the grouped one. Runs only when the current
length exceeds the original one; shorter inputs take the ordinary path and are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv

from .context import PositionContext
from .schemes.rope import apply_rotary


def self_extend_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: PositionContext,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped + neighbour attention for q [B, H, q, D], unrotated k, v [B, Hkv, kv, D]; returns (out, weights)."""
    group, window, _ = context.self_extend  # type: ignore[misc]
    rotary = context.positions
    query_pos, key_pos = context.query_key_positions(query.shape[2], key.shape[2], query.device)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [B, Hkv, kv, D] -> [B, H, kv, D]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5

    def logits(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        q = apply_rotary(query, *rotary(q_pos))  # type: ignore[misc]
        k = apply_rotary(key, *rotary(k_pos))  # type: ignore[misc]
        return torch.matmul(q, k.transpose(2, 3)) * scaling  # [B, H, q, kv]

    neighbour = logits(query_pos, key_pos)
    grouped = logits(query_pos // group + (window - window // group), key_pos // group)
    distance = query_pos[:, None] - key_pos[None, :]  # [q, kv]
    scores = torch.where(distance < window, neighbour, grouped)
    lowest = torch.finfo(scores.dtype).min
    if attention_mask is None:
        scores = scores.masked_fill(distance < 0, lowest)  # causal
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., : scores.shape[-1]], lowest)
    else:
        scores = (scores + attention_mask[..., : scores.shape[-1]]).clamp(min=lowest)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # [B, H, q, D] -> [B, q, H, D]
    return output, weights
