"""Self-Extend attention (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning",
arXiv:2401.01325, Algorithm 1), and ReRoPE (Su 2023, github.com/bojone/rerope) on the same two passes.

Two logits per (query, key): with the exact positions ("neighbour" attention) and with grouped positions
floor(pos / G), the query's shifted by W - floor(W / G) so grouped distances continue where the window ends.
Keys closer than W to the query take the neighbour logit, the others the grouped one, for every query, as the
authors' code does (github.com/datamllab/LongLM, ``self_extend_patch/Llama_4_40.py``). It runs once the current
length exceeds the settings' ``start`` (:class:`~hf_posswap.schemes.two_pass.TwoPassSettings`): the window, or
the original length with Self-Extend's ``exact_within_original``; shorter inputs take the ordinary path and are
unchanged. A query's logits depend only on its own and its keys' positions, so cached decoding equals a full
recompute.

ReRoPE is the same two passes with an infinite group: far keys unrotated, far queries at position W, so every key
past the window sits at distance W; Leaky ReRoPE divides by k without the floor (distance W + (d - W) / k). It acts
from length W on (:class:`~hf_posswap.schemes.two_pass.TwoPassSettings` ``start``), as the reference does.

Two paths, the same numbers (fp32 to 1e-5; :mod:`hf_posswap.core.paths` records which ran). Merged
(:func:`merged_self_extend`): where the call is causal with index positions and a plain causal mask, no weights
are returned and (on CPU) no gradient is needed, neighbour and far keys are two fused attention calls merged by
log-sum-exp (:mod:`hf_posswap.core.two_pass_fused`), at about the cost of one fused causal call. Chunked, every
other call (padding, per-row positions, bidirectional, weights, CPU training): the queries are processed in chunks,
so no ``[B, H, q, kv]`` tensor exists unless attention weights are returned (the eager carrier, or
``output_attentions=True``): a chunk holds at most :data:`CHUNK_ELEMENTS` logits (64 MiB in fp32) plus a few
tensors of the same size. Within a chunk, keys that every query of the chunk groups get only the grouped logit,
keys past the last query of a causal chunk (unmasked case) are skipped, and chunks that group no pair get only the
neighbour logit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..schemes.base import pinned_id
from ..schemes.rope import apply_rotary
from ..schemes.two_pass import TwoPassSettings
from ..transformers_internals import attention_implementation
from .context import PositionContext
from .paths import SELF_EXTEND_CHUNKED, SELF_EXTEND_MERGED, note_path
from .two_pass_fused import TwoPassLayout, fused_two_pass

#: logits (batch x heads x queries x keys) one query chunk holds at once: 2**24 values, 64 MiB in fp32
CHUNK_ELEMENTS = 1 << 24


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Grouped + neighbour attention for q [B, H, q, D], unrotated k, v [B, Hkv, kv, D]; returns (out, weights).

    Positions may be shared ([q], [kv]) or per row ([B, q], explicit ``position_ids``). In a causal model every
    key at distance >= W from its query takes the grouped logit (Jin et al. 2024; with ``start`` = the original
    length, only for queries at or past it). A query's result depends only on its own and its keys' positions, so
    a cached decode equals a full recompute. A bidirectional model groups every pair at least W apart once the row
    reaches ``start``.

    Weights [B, H, q, kv] are returned where the caller can use them: ``output_attentions=True``, or any carrier
    but sdpa (eager's contract is to return them); the sdpa carrier gets None, as sdpa itself returns, and never
    holds more than one query chunk of logits. Calls without weights take the merged path where it applies
    (:func:`_takes_merged_path`).
    """
    keep = _returns_weights(module, kwargs)
    if not keep and _takes_merged_path(module, query, key, value, attention_mask, context, dropout):
        note_path(SELF_EXTEND_MERGED)
        return merged_self_extend(query, key, value, context, scaling), None
    note_path(SELF_EXTEND_CHUNKED)
    return chunked_self_extend(module, query, key, value, attention_mask, context, scaling, dropout, keep_weights=keep)


#: dtypes the merged path runs in, per device (the CPU fused kernel's, and flex_attention's)
MERGED_DTYPES = {"cpu": (torch.float32, torch.float64, torch.bfloat16), "cuda": (torch.float32, torch.bfloat16,
                                                                               torch.float16)}
#: fewest queries for the merged path, per device. CPU: decoding steps too (one query after 8,192 keys ran in
#: 0.7-0.9x the chunked path's time, 2 threads). CUDA: prefill only (a decoding step after 8,192 keys took
#: 10.1 ms merged, 7.3 ms chunked, bf16 on an H200)
MERGED_MIN_QUERIES = {"cpu": 1, "cuda": 2}
#: flex_attention's smallest head dimension (its CUDA kernels refuse smaller ones)
FLEX_MIN_HEAD_DIM = 16


def _takes_merged_path(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: PositionContext,
    dropout: float,
) -> bool:
    """Whether the call can run as two fused calls (:func:`merged_self_extend`): causal, index positions (no padding,
    no per-row positions), no mask beyond causality, no dropout, a supported device and dtype, no autocast, enough
    queries (:data:`MERGED_MIN_QUERIES`), on CUDA a head dimension flex_attention takes, and on CPU no gradient
    (its fused kernel gives none through the log-sum-exp)."""
    device = query.device.type
    if not getattr(module, "is_causal", True) or device not in MERGED_DTYPES:
        return False
    if query.shape[2] < MERGED_MIN_QUERIES[device] or (device == "cuda" and query.shape[-1] < FLEX_MIN_HEAD_DIM):
        return False
    if (dropout > 0 and module.training) or torch.is_autocast_enabled(device):
        return False
    if query.dtype not in MERGED_DTYPES[device] or not query.dtype == key.dtype == value.dtype:
        return False
    if device == "cpu" and torch.is_grad_enabled():
        tensors = (query, key, value, *context.positions.parameters())  # type: ignore[union-attr]
        if any(t.requires_grad for t in tensors):
            return False
    query_pos, key_pos = _positions(context, query.shape[2], key.shape[2], query.device)
    return query_pos.dim() == 1 and _plain_causal(attention_mask, query_pos, key_pos, context.memo)


def _plain_causal(mask: torch.Tensor | None, query_pos: torch.Tensor, key_pos: torch.Tensor, memo: dict) -> bool:
    """Whether ``mask`` hides exactly the keys after each query: None, or a bool [B or 1, 1, q, kv] mask equal to
    the causal pattern of the positions (static caches and chunked prefill send one). Checked once per mask and
    forward (the layers share it)."""
    if mask is None:
        return True
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:] != (1, len(query_pos), len(key_pos)):
        return False
    memo_key = ("self-extend-plain-mask", pinned_id(memo, mask), len(query_pos), len(key_pos))
    plain = memo.get(memo_key)
    if plain is None:
        plain = memo[memo_key] = bool((mask == (key_pos[None, :] <= query_pos[:, None])).all())
    return plain


def merged_self_extend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context: PositionContext, scaling: float | None
) -> torch.Tensor:
    """Output [B, q, H, Dv] of two-pass attention with index positions as fused calls merged by log-sum-exp
    (:mod:`hf_posswap.core.two_pass_fused`): neighbour keys with exact rotations, far keys with far ones."""
    settings = context.two_pass
    rotary = context.positions
    q_len, kv_len = query.shape[2], key.shape[2]
    query_pos, key_pos = context.query_key_positions(q_len, kv_len, query.device)  # [q], [kv]
    shift = settings.window - far_positions(settings.window, settings)
    near = apply_rotary(query, *rotary(query_pos)), apply_rotary(key, *rotary(key_pos))  # type: ignore[misc]
    far = (
        apply_rotary(query, *rotary(far_positions(query_pos, settings) + shift)),  # type: ignore[misc]
        apply_rotary(key, *rotary(far_positions(key_pos, settings))),  # type: ignore[misc]
    )
    layout = TwoPassLayout(
        q_len=q_len,
        kv_len=kv_len,
        delta=context.query_offset - context.key_start(q_len, kv_len),  # key index of query 0's position
        window=settings.window,
        far_from=max(0, settings.start - context.query_offset),
    )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return fused_two_pass(near, far, value, layout, scale).contiguous()


def _returns_weights(module: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether the caller may read the weights: an explicit ``output_attentions``, else not on an sdpa carrier
    (GPT-2 does not forward ``output_attentions``; a call without a config, e.g. a test, gets them)."""
    requested = kwargs.get("output_attentions")
    if requested is not None:
        return bool(requested)
    implementation = attention_implementation(getattr(module, "config", None))
    return not (isinstance(implementation, str) and implementation.endswith("sdpa"))


def chunk_size(batch: int, heads: int, kv_len: int, budget: int | None = None) -> int:
    """Queries per chunk so that one chunk's logits [batch, heads, chunk, kv_len] stay within ``budget`` values
    (default :data:`CHUNK_ELEMENTS`)."""
    return max(1, (budget or CHUNK_ELEMENTS) // max(batch * heads * kv_len, 1))


@dataclass
class _Call:
    """What every query chunk of one attention call shares (keys rotated once, positions, settings)."""

    module: nn.Module
    query: torch.Tensor  # [B, H, q, D], unrotated
    near_keys: torch.Tensor  # [B, Hkv, kv, D], rotated by exact positions
    far_keys: torch.Tensor  # [B, Hkv, kv, D], rotated by grouped positions
    value: torch.Tensor  # [B, Hkv, kv, Dv]
    attention_mask: torch.Tensor | None
    rotary: nn.Module
    query_pos: torch.Tensor  # [q] or [B, q]
    query_rows: torch.Tensor  # [1 or B, q]
    key_rows: torch.Tensor  # [1 or B, kv]
    settings: TwoPassSettings
    scaling: float
    dropout: float
    causal: bool
    #: PositionContext.index_lag: the order causality follows, whatever the positions
    index_lag: int = 0

    def logits(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """query [B, H, c, D] · keys [B, Hkv, n, D] -> [B, H, c, n], grouped-query heads without repeating keys."""
        batch, heads, rows, dim = query.shape
        kv_heads = keys.shape[1]
        stacked = query.reshape(batch, kv_heads, (heads // kv_heads) * rows, dim)
        return torch.matmul(stacked, keys.transpose(2, 3)).mul_(self.scaling).view(batch, heads, rows, -1)


def chunked_self_extend(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: PositionContext,
    scaling: float | None = None,
    dropout: float = 0.0,
    chunk: int | None = None,
    keep_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Self-Extend attention over query chunks of ``chunk`` rows (default: :func:`chunk_size`); output
    [B, q, H, Dv] and, with ``keep_weights``, the weights [B, H, q, kv] (zeros where a causal chunk skipped keys)."""
    call = _prepare(module, query, key, value, attention_mask, context, scaling, dropout)
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    rows_per_chunk = chunk or chunk_size(batch, heads, kv_len)
    if torch.compiler.is_compiling() and q_len <= rows_per_chunk:
        rows_per_chunk = max(q_len, 1)  # one chunk; compiled, a step over chunks would fix the cache's length in guards
    output = query.new_empty(batch, q_len, heads, value.shape[-1])
    weights = query.new_zeros(batch, heads, q_len, kv_len) if keep_weights else None
    for start in range(0, q_len, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, q_len))
        chunk_output, chunk_weights = _attend(call, rows)
        output[:, rows] = chunk_output.transpose(1, 2)
        if weights is not None:
            weights[:, :, rows, : chunk_weights.shape[-1]] = chunk_weights
    return output, weights


def _prepare(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    context: PositionContext,
    scaling: float | None,
    dropout: float,
) -> _Call:
    """Positions, keys rotated by exact and by grouped positions (once per call), and the call's settings."""
    settings = context.two_pass
    rotary = context.positions
    query_pos, key_pos = _positions(context, query.shape[2], key.shape[2], query.device)
    return _Call(
        module=module,
        query=query,
        near_keys=apply_rotary(key, *rotary(key_pos)),  # type: ignore[misc]
        far_keys=apply_rotary(key, *rotary(far_positions(key_pos, settings))),  # type: ignore[misc]
        value=value,
        attention_mask=attention_mask,
        rotary=rotary,  # type: ignore[arg-type]
        query_pos=query_pos,
        query_rows=query_pos if query_pos.dim() == 2 else query_pos[None],
        key_rows=key_pos if key_pos.dim() == 2 else key_pos[None],
        settings=settings,
        scaling=query.shape[-1] ** -0.5 if scaling is None else scaling,
        dropout=dropout,
        causal=bool(getattr(module, "is_causal", True)),
        index_lag=context.index_lag(query.shape[2], key.shape[2]),
    )


def _attend(call: _Call, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """One query chunk: output [B, H, c, Dv] and weights [B, H, c, end] over the first ``end`` keys."""
    distance = (call.query_rows[:, rows, None] - call.key_rows[:, None, :])[:, None]  # [1 or B, 1, c, kv]
    # token order, for causality: >= 0 where the key is in the query's past (positions may restart: packed rows)
    query_index = torch.arange(rows.start, rows.stop, device=distance.device) + call.index_lag  # [c]
    order = query_index[:, None] - torch.arange(distance.shape[-1], device=distance.device)  # [c, kv]
    end = _visible_end(call, order)
    distance, order = distance[..., :end], order[:, :end]
    use_grouped = _grouped_pairs(call, distance, call.query_rows[:, rows])
    scores = _scores(call, rows, use_grouped)
    scores = _masked(call, scores, order, rows)
    # float32 at least, float64 for a float64 model (float32 reads float64's lowest as -inf: NaN on padded rows)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    weights = weights.to(call.query.dtype)
    del scores
    weights = nn.functional.dropout(weights, p=call.dropout, training=call.module.training)
    batch, heads, count, _ = weights.shape
    kv_heads = call.value.shape[1]
    stacked = weights.reshape(batch, kv_heads, (heads // kv_heads) * count, end)
    output = torch.matmul(stacked, call.value[:, :, :end]).view(batch, heads, count, -1)
    return output, weights


def _visible_end(call: _Call, order: torch.Tensor) -> int:
    """Keys needed by the chunk: in a causal call without a mask, keys after every query of the chunk (in token
    ``order`` [c, kv]) get weight exactly 0, so they are skipped (only when each query sees at least one key, so no
    row's softmax changes)."""
    kv_len = order.shape[-1]
    if not call.causal or call.attention_mask is not None or torch.compiler.is_compiling():
        return kv_len  # compiled: no data-dependent length (a graph break); the causal mask zeroes the same keys
    visible = order >= 0
    if not bool(visible.any(-1).all()):
        return kv_len
    seen = visible.any(0)  # [kv]
    return int(seen.nonzero().max()) + 1


def _grouped_pairs(call: _Call, distance: torch.Tensor, query_rows: torch.Tensor) -> torch.Tensor:
    """Which (query, key) pairs take the grouped logit: [1 or B, 1, c, n] bool."""
    window, start = call.settings.window, call.settings.start
    if call.causal:
        return (distance >= window) & (query_rows >= start)[:, None, :, None]
    # a row no longer than the start (a short row padded in a batch with a long one) is not grouped
    longer = (call.key_rows.amax(-1) >= start)[:, None, None, None]  # [1 or B, 1, 1, 1]
    return (distance.abs() >= window) & longer


def far_positions(positions: torch.Tensor | int, settings: TwoPassSettings) -> torch.Tensor | float:
    """Grouped positions: floor(p / G) for Self-Extend, p / k for Leaky ReRoPE, 0 for ReRoPE (p / inf)."""
    return positions // settings.group if settings.floor else positions / settings.group


def _scores(call: _Call, rows: slice, use_grouped: torch.Tensor) -> torch.Tensor:
    """Logits [B, H, c, n]: grouped where ``use_grouped``, else neighbour. Leading keys that every query of the
    chunk groups get only the grouped logit; a chunk that groups nothing gets only the neighbour one."""
    end = use_grouped.shape[-1]
    query = call.query[:, :, rows]
    query_pos = call.query_pos[..., rows]
    near_query = apply_rotary(query, *call.rotary(query_pos))
    compiling = torch.compiler.is_compiling()  # no shortcut read off the data: each would break the graph
    if not compiling and not bool(use_grouped.any()):
        return call.logits(near_query, call.near_keys[:, :, :end])
    window = call.settings.window
    far_query_pos = far_positions(query_pos, call.settings) + (window - far_positions(window, call.settings))
    far_query = apply_rotary(query, *call.rotary(far_query_pos))
    if compiling:
        far = call.logits(far_query, call.far_keys[:, :, :end])
        return torch.where(use_grouped, far, call.logits(near_query, call.near_keys[:, :, :end]))
    all_grouped = use_grouped.flatten(0, 2).all(0)  # [n]: keys every query of the chunk groups
    split = end if bool(all_grouped.all()) else int(all_grouped.logical_not().int().argmax())
    if split == end:
        return call.logits(far_query, call.far_keys[:, :, :end])
    near = call.logits(near_query, call.near_keys[:, :, split:end])
    far = call.logits(far_query, call.far_keys[:, :, split:end])
    mixed = torch.where(use_grouped[..., split:], far, near)
    if split == 0:
        return mixed
    del near, far
    return torch.cat((call.logits(far_query, call.far_keys[:, :, :split]), mixed), dim=-1)


def _masked(call: _Call, scores: torch.Tensor, order: torch.Tensor, rows: slice) -> torch.Tensor:
    """The attention mask (bool or additive float) of the chunk's rows, or causality from the token ``order``
    [c, kv] (key in the query's past where >= 0)."""
    lowest = torch.finfo(scores.dtype).min
    mask = call.attention_mask
    if mask is None:
        return scores.masked_fill_(order < 0, lowest) if call.causal else scores
    mask = mask[..., : scores.shape[-1]]
    if mask.shape[-2] != 1:
        mask = mask[..., rows, :]
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, lowest)
    scores = scores.add_(mask) if mask.dtype == scores.dtype else scores + mask  # the reference's type promotion
    return scores.clamp_(min=lowest)


def _positions(context: PositionContext, q_len: int, kv_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Query and key positions; per row [B, q], [B, kv] in a padded batch, so a padded row groups as it does alone:
    from the padded mask where it covers exactly the keys (no cache, or a dynamic cache: the queries are the last
    q_len keys), else shifted by the context's ``row_shift`` (a static cache)."""
    padded = context.padded_positions
    if padded is not None and padded.shape[-1] == kv_len >= q_len:
        padded = padded.to(device)
        return padded[:, kv_len - q_len :], padded
    query_pos, key_pos = context.query_key_positions(q_len, kv_len, device)
    if context.row_shift is not None and query_pos.dim() == 1:  # a static cache's slots, shifted per padded row
        shift = context.row_shift.to(device)[:, None]  # [B, 1]
        return (query_pos[None] + shift).clamp(min=0), (key_pos[None] + shift).clamp(min=0)
    return query_pos, key_pos
