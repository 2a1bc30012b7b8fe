"""Attention functions that carry rotary-in-attention and bias schemes.

Registered through transformers' own extension points (``AttentionInterface`` and ``AttentionMaskInterface``) as
``posswap_eager`` and ``posswap_sdpa``; ``swap`` selects one with ``model.set_attn_implementation``. Both read the
:class:`~hf_posswap.context.PositionContext` passed down by the position hook, then:

- rotary schemes rotate q and k by their positions (cached keys stay unrotated and are rotated by index);
- bias schemes add a ``[1, H, q, kv]`` bias to the logits (sdpa through transformers' ``position_bias``).

Cross-attention and calls without a context run unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from .context import CONTEXT_KWARG, PositionContext
from .schemes.base import BiasPositions, RotaryPositions
from .schemes.rope import apply_rotary

EAGER = "posswap_eager"
SDPA = "posswap_sdpa"
#: attention implementation the user had -> the one that carries in-attention schemes
CARRIERS = {"eager": EAGER, "sdpa": SDPA, EAGER: EAGER, SDPA: SDPA}


def eager_attention_with_bias(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with an additive position bias; returns (output [B, q, H, D], weights [B, H, q, kv]).

    The returned weights include the bias, as ``output_attentions=True`` users expect. The merged mask is clamped
    to the dtype's finite range so fp16 rows that are fully masked do not turn into NaN.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [B, Hkv, kv, D] -> [B, H, kv, D]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, H, q, kv]
    if position_bias is not None:
        scores = scores + position_bias
    lowest = torch.finfo(scores.dtype).min
    q_len, kv_len = scores.shape[-2], scores.shape[-1]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask[..., :kv_len], lowest)
        else:
            scores = (scores + attention_mask[..., :kv_len]).clamp(min=lowest)
    elif getattr(module, "is_causal", False) and q_len > 1:
        # bottom-right aligned causal mask: query i sees keys j <= i + (kv - q)
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=scores.device).tril(kv_len - q_len)
        scores = scores.masked_fill(~allowed, lowest)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # [B, H, q, D] -> [B, q, H, D]
    return output, weights


def apply_position_scheme(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, context: PositionContext | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Apply the context's scheme to q [B, H, q, D] and k [B, Hkv, kv, D]; return (q, k, bias or None)."""
    if context is None or context.positions is None or not context.is_self_attention(module):
        return query, key, None
    scheme = context.positions
    query_pos, key_pos = context.query_key_positions(query.shape[2], key.shape[2], query.device)
    if isinstance(scheme, RotaryPositions):
        query = apply_rotary(query, *scheme.cos_sin(query_pos))
        key = apply_rotary(key, *scheme.cos_sin(key_pos))
        return query, key, None
    if isinstance(scheme, BiasPositions):
        layer_idx = getattr(module, "layer_idx", 0) or 0
        causal = bool(getattr(module, "is_causal", True))
        bias = scheme.bias(query_pos, key_pos, layer_idx, causal)  # [1, H, q, kv]
        return query, key, bias.to(query.dtype)
    return query, key, None


def _carrier(inner: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]) -> Callable[..., Any]:
    def posswap_attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        context = kwargs.pop(CONTEXT_KWARG, None)
        query, key, bias = apply_position_scheme(module, query, key, context)
        if bias is not None:
            kwargs["position_bias"] = bias
        return inner(module, query, key, value, attention_mask, **kwargs)

    return posswap_attention


def register_attention_functions() -> None:
    """Register ``posswap_eager`` / ``posswap_sdpa`` and their mask builders (idempotent)."""
    AttentionInterface.register(EAGER, _carrier(eager_attention_with_bias))
    AttentionInterface.register(SDPA, _carrier(sdpa_attention_forward))
    AttentionMaskInterface.register(EAGER, eager_mask)
    AttentionMaskInterface.register(SDPA, sdpa_mask)


register_attention_functions()
