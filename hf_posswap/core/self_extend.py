"""Self-Extend attention (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning",
arXiv:2401.01325, Algorithm 1).

Two logits per (query, key): with the exact positions ("neighbour" attention) and with grouped positions
floor(pos / G), the query's shifted by W - floor(W / G) so grouped distances continue where the window ends.
Keys closer than W to the query take the neighbour logit, the others the grouped one. Runs only when the current
length exceeds the original one; shorter inputs take the ordinary path and are unchanged. In causal models only
queries past the original length use grouped distances (see :func:`self_extend_attention`), which keeps cached
decoding equal to a full recompute.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.integrations.sdpa_attention import repeat_kv

from ..schemes.rope import apply_rotary
from .context import PositionContext


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
    """Grouped + neighbour attention for q [B, H, q, D], unrotated k, v [B, Hkv, kv, D]; returns (out, weights).

    Positions may be shared ([q], [kv]) or per row ([B, q], explicit ``position_ids``). In a causal model the
    grouping is decided per query: a query at position p < original length attends exactly as the unextended
    model does (all its keys are within the trained distances), later queries use grouped distances past the
    window. A query's result then depends only on its own position, so a cached decode equals a full recompute.
    A bidirectional model groups every pair farther apart than the window once the row exceeds the original length.
    """
    group, window, original = context.self_extend  # type: ignore[misc]
    rotary = context.positions
    query_pos, key_pos = _positions(context, query.shape[2], key.shape[2], query.device)
    query_rows = query_pos if query_pos.dim() == 2 else query_pos[None]  # [1 or B, q]
    key_rows = key_pos if key_pos.dim() == 2 else key_pos[None]  # [1 or B, kv]
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
    distance = (query_rows[:, :, None] - key_rows[:, None, :])[:, None]  # [1 or B, 1, q, kv]
    causal = bool(getattr(module, "is_causal", True))
    if causal:
        use_grouped = (distance >= window) & (query_rows >= original)[:, None, :, None]
    else:  # a row no longer than the original (a short row padded in a batch with a long one) is not grouped
        longer = (key_rows.amax(-1) >= original)[:, None, None, None]  # [1 or B, 1, 1, 1]
        use_grouped = (distance.abs() >= window) & longer
    scores = torch.where(use_grouped, grouped, neighbour)
    lowest = torch.finfo(scores.dtype).min
    if attention_mask is None:
        if causal:
            scores = scores.masked_fill(distance < 0, lowest)
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., : scores.shape[-1]], lowest)
    else:
        scores = (scores + attention_mask[..., : scores.shape[-1]]).clamp(min=lowest)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # [B, H, q, D] -> [B, q, H, D]
    return output, weights


def _positions(context: PositionContext, q_len: int, kv_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Query and key positions; per row [B, q], [B, kv] in a padded batch whose mask covers exactly the keys (no
    cache, or a dynamic cache: the queries are the last q_len keys), so a padded row groups as it does alone."""
    padded = context.padded_positions
    if padded is not None and padded.shape[-1] == kv_len >= q_len:
        padded = padded.to(device)
        return padded[:, kv_len - q_len :], padded
    return context.query_key_positions(q_len, kv_len, device)
