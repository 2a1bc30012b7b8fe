"""Attention functions that carry rotary-in-attention and bias schemes.

Registered through transformers' own extension points (``AttentionInterface`` and ``AttentionMaskInterface``) as
``posswap_eager`` and ``posswap_sdpa``; ``swap`` selects one with ``model.set_attn_implementation``. Both read the
:class:`~hf_posswap.core.context.PositionContext` passed down by the position wrapper, then:

- rotary schemes rotate q and k by their positions; keys held by a KV cache are rotated once, where they enter it
  (:mod:`~hf_posswap.core.rotary_cache`), so a decode step rotates only the new tokens;
- bias schemes merge a ``[1, H, q, kv]`` logit bias into the attention mask, which both eager and sdpa add to the
  logits.

Cross-attention and calls without a context run unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..schemes.base import FusedCall, pinned_id
from ..transformers_internals import (
    KNOWN_CACHE_KWARGS,
    check_interfaces,
    drift_error,
    register_attention,
    repeat_kv,
    sdpa_attention,
    warn_if_untested,
)
from .context import CONTEXT_KWARG, PositionContext
from .flex_bias import flex_applies, flex_bias_output, flex_spec
from .paths import DENSE, FLEX, note_path
from .rotary_cache import rotary_inputs
from .self_extend import self_extend_attention

EAGER = "posswap_eager"
SDPA = "posswap_sdpa"
#: attention implementation the user had -> the one that carries in-attention schemes
CARRIERS = {"eager": EAGER, "sdpa": SDPA, EAGER: EAGER, SDPA: SDPA}


def eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention; returns (output [B, q, H, D], weights [B, H, q, kv]).

    ``attention_mask`` may carry a position bias merged in (see :func:`merge_bias_and_mask`), so the returned
    weights include the scheme's effect, as ``output_attentions=True`` users expect. The masked logits are clamped
    to the dtype's finite range and the softmax runs in that dtype or float32, whichever is wider, so rows that are
    fully masked (padding) do not turn into NaN, in fp16 or in float64.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [B, Hkv, kv, D] -> [B, H, kv, D]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, H, q, kv]
    q_len, kv_len = scores.shape[-2], scores.shape[-1]
    if attention_mask is not None:
        scores = merge_bias_and_mask(scores, attention_mask, None, scores.dtype)
    elif getattr(module, "is_causal", False) and q_len > 1:  # bottom-right aligned: query i sees j <= i + kv - q
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=scores.device).tril(kv_len - q_len)
        scores = merge_bias_and_mask(scores, None, allowed, scores.dtype)
    # at least float32 (half-precision logits), and float64 for a float64 model: its masked logits hold float64's
    # lowest value, which a float32 softmax reads as -inf (a fully masked padding row would then be NaN)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    weights = weights.to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # [B, H, q, D] -> [B, q, H, D]
    return output, weights


def merge_bias_and_mask(
    bias: torch.Tensor, attention_mask: torch.Tensor | None, causal_allowed: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """One additive float mask from a logit bias [.., q, kv] and transformers' mask (None, bool or float); the eager
    attention function passes its logits as ``bias`` (the same sum: masked logits).

    transformers may skip the mask of a causal model (sdpa then relies on ``is_causal``); ``causal_allowed``
    [q, kv] (True where a key is at or before the query) then stands in for it. Masked entries get the dtype's
    lowest finite value; sums are clamped to it (fp16 safety).
    """
    lowest = torch.finfo(dtype).min
    kv_len = bias.shape[-1]
    bias = bias.to(dtype)  # a model cast after the swap (float64, say) may hold a bias of another dtype
    if attention_mask is None:
        if causal_allowed is not None:  # in place: the bias is a fresh tensor and no backward reads it
            bias = bias.masked_fill_(~causal_allowed, lowest)
        return bias
    attention_mask = attention_mask[..., :kv_len]
    if attention_mask.dtype == torch.bool:
        return bias.masked_fill(~attention_mask, lowest)
    return (bias + attention_mask).clamp(min=lowest).to(dtype)


def scheme_inputs(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: PositionContext | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Apply the context's scheme to q [B, H, q, D], k [B, Hkv, kv, D] and the mask; return (q, k, mask).

    By the context's kind: rotary schemes rotate q and k (cached keys once, in the cache); temperature scales the
    queries; head mixes split the heads; bias schemes merge their bias into the mask (:func:`dense_bias_mask`);
    the others (none, absolute: positions already in the embeddings) leave all three as they are.
    """
    if context is None or context.positions is None or not context.is_self_attention(module):
        return query, key, attention_mask
    if context.kind == "rotary":  # keys held by a KV cache are rotated once, in the cache (see rotary_cache)
        query, key = rotary_inputs(module, query, key, context)  # new tensors: q, k may be projection outputs
        return query, key, attention_mask
    if context.kind == "temperature":
        return temperature_queries(query, context), key, attention_mask
    if context.kind == "head_mix":
        return head_mix_inputs(module, query, key, attention_mask, context)
    if context.kind != "bias":
        return query, key, attention_mask
    return query, key, dense_bias_mask(module, query, key, attention_mask, context)


def dense_bias_mask(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
    context: PositionContext,
) -> torch.Tensor:
    """The bias scheme's [1 or B, H, q, kv] bias merged with the padding and causal masks, as one float mask for
    plain attention. Memoised for the forward when it needs no gradient (fixed ALiBi slopes, any scheme under
    ``no_grad``), shared by every layer that shares the bias."""
    scheme = context.positions
    note_path(DENSE)
    query_pos, key_pos = context.bias_positions(query.shape[2], key.shape[2], query.device)
    layer_idx = getattr(module, "layer_idx", 0) or 0
    causal = bool(getattr(module, "is_causal", True))
    memo_key = (
        "mask",
        0 if context.layer_shared else layer_idx,
        query.shape[2],
        key.shape[2],
        causal,
        query.dtype,
        pinned_id(context.memo, attention_mask),
        # reentrant gradient checkpointing runs the forward under no_grad, then recomputes it with grad enabled
        # in backward (same context): a mask memoised without grad must not stand in for the recomputed one
        torch.is_grad_enabled(),
    )
    merged = context.memo.get(memo_key)
    if merged is None:
        bias = scheme(query_pos, key_pos, layer_idx, causal, context.memo)  # [1 or B, H, q, kv]
        allowed = None
        if causal and not _every_key_visible(context, query.shape[2], key.shape[2]):
            # by token order, not by the positions: ids that restart (sequences packed in a row without a mask
            # between them) would otherwise let a query see the later tokens whose ids are smaller
            query_index, key_index = context.token_indices(query.shape[2], key.shape[2], query.device)
            allowed = key_index[None, :] <= query_index[:, None]  # [q, kv]
        merged = merge_bias_and_mask(bias, attention_mask, allowed, query.dtype)
        if not merged.requires_grad:
            context.memo[memo_key] = merged
    return merged


def _every_key_visible(context: PositionContext, q_len: int, kv_len: int) -> bool:
    """Whether every key is at or before every query in token order, known without looking at a tensor: the last
    key is no later than the first query (a decoding step after a dynamic cache: its causal mask is all True, and
    building it costs two ops a step). Under ``torch.compile`` the mask is always built: in the graph it costs
    nothing, and the answer would be a guard on the cache's length (a static cache's last slot flips it:
    one more compile)."""
    if torch.compiler.is_compiling():
        return False
    return context.key_start(q_len, kv_len) + kv_len - 1 <= context.query_offset


def head_mix_inputs(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: PositionContext,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A head mix (:mod:`hf_posswap.schemes.head_mix`): rotary heads of q [B, H, q, D] and k [B, Hkv, kv, D] rotated
    (every key, out of place: the cache keeps keys unrotated, since only some heads rotate), the bias of the bias
    heads (zero on the others) merged into the mask."""
    query, key = head_mix_rotation(module, query, key, context)
    bias = dataclasses.replace(context, positions=context.positions.bias, kind="bias")
    return scheme_inputs(module, query, key, attention_mask, bias)


def head_mix_rotation(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, context: PositionContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, q, D] and k [B, Hkv, kv, D] with a head mix's rotary heads rotated, the bias heads as they were."""
    scheme = context.positions
    rotary = dataclasses.replace(context, positions=scheme.rotary, kind="rotary", cache=None)
    rotated_query, rotated_key = rotary_inputs(module, query, key, rotary)
    rotary_heads, rotary_kv_heads = scheme.rotary_heads(query.device)  # [H], [Hkv]
    query = torch.where(rotary_heads[:, None, None], rotated_query, query)
    key = torch.where(rotary_kv_heads[:, None, None], rotated_key, key)
    return query, key


def temperature_queries(query: torch.Tensor, context: PositionContext) -> torch.Tensor:
    """q [B, H, q, D] scaled per query position by a NoPE layer's temperature (Llama 4 iRoPE, see
    :func:`hf_posswap.schemes.mix.llama4_attn_scales`). Positions are the tokens' own (padding does not count)."""
    positions = context.query_positions(query.shape[2], query.device)  # [q] or [B, q]
    scales = context.positions(positions)  # float32, same shape
    scales = scales[None, None, :, None] if scales.dim() == 1 else scales[:, None, :, None]  # [1 or B, 1, q, 1]
    return (query * scales).to(query.dtype)


def bias_call(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: PositionContext,
    scaling: float | None,
    dropout: float,
) -> FusedCall:
    """One self-attention call of a bias scheme as its fused and flex forms see it (positions from the context)."""
    query_pos, key_pos = context.bias_positions(query.shape[2], key.shape[2], query.device)
    starts = (context.query_offset, context.key_start(query.shape[2], key.shape[2])) if query_pos.dim() == 1 else None
    return FusedCall(
        query=query,
        key=key,
        value=value,
        attention_mask=attention_mask,
        query_pos=query_pos,
        key_pos=key_pos,
        layer_idx=getattr(module, "layer_idx", 0) or 0,
        causal=bool(getattr(module, "is_causal", True)),
        scaling=query.shape[-1] ** -0.5 if scaling is None else scaling,
        dropout=dropout if module.training else 0.0,
        memo=context.memo,
        starts=starts,
        index_lag=context.index_lag(query.shape[2], key.shape[2]),
    )


def flex_bias_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: PositionContext | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Output [B, q, H, D] through ``flex_attention`` with the bias scheme's elementwise bias
    (:mod:`~hf_posswap.core.flex_bias`), or None when the call does not take flex (then the fused or dense paths
    run). Bias schemes and the bias part of head mixes (their rotary heads rotated first) qualify."""
    if context is None or context.positions is None or context.kind not in ("bias", "head_mix"):
        return None
    effective_dropout = dropout if module.training else 0.0
    if not context.is_self_attention(module) or not flex_applies(query, key, value, attention_mask, effective_dropout):
        return None
    scheme = context.positions.bias if context.kind == "head_mix" else context.positions
    if getattr(scheme, "flex_bias", None) is None:
        return None
    call = bias_call(module, query, key, value, attention_mask, context, scaling, dropout)
    spec = flex_spec(call)
    bias = scheme.flex_bias(spec)
    if bias is None:
        return None
    if context.kind == "head_mix":
        call.query, call.key = head_mix_rotation(module, query, key, context)
    output = flex_bias_output(call, bias, spec)
    note_path(FLEX)
    return output


def fused_bias_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: PositionContext | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Output [B, q, H, D] from the bias scheme's fused form (no dense ``[B, H, q, kv]`` bias), or None when the
    scheme has none or declines this call (then the dense path runs)."""
    if context is None or context.kind != "bias" or context.positions is None:
        return None
    minimum = getattr(context.positions, "fused_min_queries", None)
    if minimum is None or query.shape[2] < minimum or not context.is_self_attention(module):
        return None
    autocast = torch.is_autocast_enabled(query.device.type)
    if autocast and query.device.type != "cpu":  # only CPU autocast's rule is mirrored: the dense path elsewhere
        return None
    if autocast:  # the fused form gets q, k, v as sdpa would under autocast, then runs with autocast off
        query, key, value = autocast_inputs(query, key, value)
    if not query.dtype == key.dtype == value.dtype:
        return None
    call = bias_call(module, query, key, value, attention_mask, context, scaling, dropout)
    with torch.autocast(query.device.type, enabled=False) if autocast else contextlib.nullcontext():
        output = context.positions.fused_attention(call)
    if output is not None:
        note_path(context.positions.fused_path)
    return output


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` as ``scaled_dot_product_attention`` receives them under CPU autocast: it is one of autocast's
    lower-precision ops there (aten/src/ATen/autocast_mode.cpp), which cast every floating tensor but float64 to the
    autocast dtype (checked in tests/schemes/test_fused_bf16.py)."""
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


def _needs_self_extend(module: nn.Module, query: torch.Tensor, context: PositionContext | None) -> bool:
    """Two-pass attention (Self-Extend, ReRoPE) runs only past its settings' ``start`` (shorter inputs group no
    pair), and only in self-attention."""
    if context is None or context.two_pass is None or not context.is_self_attention(module):
        return False
    return context.query_offset + query.shape[2] > context.two_pass.start


def _carrier(inner: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], fused: bool) -> Callable[..., Any]:
    """The attention function that reads the position context, then runs ``inner`` (eager or sdpa); with ``fused``,
    flex attention (:mod:`~hf_posswap.core.flex_bias`) or a bias scheme's fused form runs instead where one takes the
    call (sdpa returns no weights, so nothing is lost)."""

    def posswap_attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        context = kwargs.pop(CONTEXT_KWARG, None)
        if context is not None:
            context.reached_attention = True
            _refuse_unseen_cache(module, query, key, context)
            context = context.for_layer(module)  # a layer mix: this layer's part
        if context is not None and context.ring is not None and context.is_self_attention(module):
            return context.ring.attention(module, query, key, value, context, **kwargs)  # context parallelism
        if _needs_self_extend(module, query, context):
            return self_extend_attention(module, query, key, value, attention_mask, context, **kwargs)
        if fused:  # flex first (CUDA, any bias scheme), then a scheme's own fused CPU form
            output = flex_bias_attention(module, query, key, value, attention_mask, context, **kwargs)
            if output is None:
                output = fused_bias_attention(module, query, key, value, attention_mask, context, **kwargs)
            if output is not None:
                return output, None
        query, key, attention_mask = scheme_inputs(module, query, key, attention_mask, context)
        return inner(module, query, key, value, attention_mask, **kwargs)

    return posswap_attention


def _refuse_unseen_cache(module: nn.Module, query: torch.Tensor, key: torch.Tensor, context: PositionContext) -> None:
    """More keys [B, Hkv, kv, D] than queries in a self-attention call of a forward that saw no KV cache: the
    model keeps a cache the position wrapper could not find, so every distance would be measured from position 0."""
    if context.cache is None and key.shape[2] > query.shape[2] and context.is_self_attention(module):
        raise drift_error(
            f"an attention layer received {key.shape[2]} keys for {query.shape[2]} queries, so the model used a KV "
            f"cache that hf_posswap did not find among its arguments (it looks for {' or '.join(KNOWN_CACHE_KWARGS)})."
        )


def register_attention_functions() -> None:
    """Register ``posswap_eager`` / ``posswap_sdpa`` and their mask builders (idempotent)."""
    check_interfaces()
    warn_if_untested()
    register_attention(EAGER, _carrier(eager_attention, fused=False), mask="eager")
    register_attention(SDPA, _carrier(sdpa_attention(), fused=True), mask="sdpa")
