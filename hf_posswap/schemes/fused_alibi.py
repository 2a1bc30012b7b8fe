"""ALiBi attention without the dense ``[B, H, q, kv]`` bias (the sdpa carrier's fast path).

Causal ALiBi is separable. Along a query row i the bias ``-m_h (i - j)`` is ``m_h j`` plus a constant, and softmax
ignores constants, so ``softmax_j(s q.k - m (i - j)) = softmax_j(s q.k + m (j - c))`` for any reference c. The term
``m (j - c)`` is one more dot-product dimension: the query gets ``m_h / s``, the key gets ``j - c``, the value gets a
zero (sdpa's fused kernels need one head dim for q, k and v). sdpa then runs its fused (flash) kernel with the
head dim 64 -> 65, grouped key-value heads unexpanded (``enable_gqa``), and never builds a ``[q, kv]`` tensor; the
slopes' gradient flows through the extra query column.

Precision: the kernel adds ``m (j - c)`` to ``s q.k`` in the working dtype, so the logits of the keys that matter
(near the query) carry a rounding error of about eps * m * |i - c|. The reference c is the middle of the query
positions (decoding steps take their small exact bias instead); past 16k tokens at slope 1/2 a prefill runs in
blocks of queries with a reference each (slower), so the error stops growing with the length. The float32 error,
measured and tested (``tests/schemes/test_alibi_fused.py``): see :data:`FP32_TOLERANCE`.

Half precision (bfloat16, float16; CPU): one column in the working dtype would round m / s and j - c to 8 (11) bits
(j - c = 1,001 becomes 1,000), so the term takes four columns, two-term splits ``x = hi + lo`` of both
(:func:`position_columns`): the query gets ``(m_hi, m_hi, m_lo, m_lo)``, the key ``(d_hi, d_lo, d_hi, d_lo)``. Every
product of two half-precision numbers is exact in float32 and sdpa's CPU kernel sums the logits in float32, so the
kernel adds ``(m_hi + m_lo)(d_hi + d_lo)``: the slope to ~16 bits and the offset exactly (integers below 2**16;
float16: 2**22), with the float32 form's error. The dense path rounds its whole bias to the model's dtype, so this
form is at least as exact as it (measured in ``tests/schemes/test_fused_bf16.py``). Decoding steps' and encoders' bias
numbers are float32 (the kernel takes a float32 mask with half-precision q, k, v). Where a backward follows, grouped
key-value heads are expanded (:func:`grouped_heads`), and trainable slopes take the float32 form
(:func:`_float32_causal`): both for the gradients' precision. Other devices keep the dense path.

Bidirectional ALiBi ``-m |i - j|`` is not separable, but it depends on j - i only: without a padding mask sdpa gets
it as an overlapping strided view of one row per head (:func:`_toeplitz_attention`), so no ``[q, kv]`` tensor is
built. With a padding mask, long inputs run blocks of queries with a dense bias block each (bounded memory).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .base import FusedCall, pinned_id
from .denormals import sdpa_flushing_denormals
from .kept_rows import kept_row, row_copy
from .precision import HALF_PRECISION, bias_dtype

#: dtypes every fused form runs in on any device; HALF_PRECISION ones run on CPU (module docstring)
FUSED_DTYPES = (torch.float32, torch.float64)
#: float16 offsets |j - c| at or past this take the dense path (their high part would pass float16's 65,504)
HALF_OFFSET_LIMIT = 2**15
#: bound on |fused - exact| (output, float32) with 8 heads of 64 (slopes 1/2 ... 1/256), 2 kv heads, unit-scale
#: random q/k/v: measured 2.2e-5 at 2,048 tokens and 7.9e-5 at 8,192 on the first and last queries (the middle
#: ones: 1.5e-6); the dense float32 path's own error there is 9e-7. It grows with the largest slope x the length.
FP32_TOLERANCE = {2048: 5e-5, 8192: 2e-4}
#: a causal prefill whose largest |slope| x length is above PRECISE_SPAN (16k tokens at slope 1/2, where the one-call
#: error would pass ~1.6e-4) runs in blocks of PRECISE_BLOCK queries, each with its own reference position, so the
#: error stays at the 4k level however long the input. The blocks cost a [block, kv] boolean mask each and lose
#: is_causal's skipping on their diagonal square: measured 1.74x native at 16k vs 1.13x for one call (loaded CPU)
PRECISE_SPAN = 8192.0
PRECISE_BLOCK = 4096
#: calls with at most this many queries (decoding steps) take the small dense bias: no copy of the cache
SMALL_QUERY = 16
#: bidirectional calls with a padding mask: the dense path (its bias shared by every layer) up to this many bias
#: numbers (2**26 float32 = 256 MiB), blocks of queries with at most BIAS_BLOCK_ELEMENTS bias numbers above it
DENSE_BIAS_ELEMENTS = 2**26
BIAS_BLOCK_ELEMENTS = 2**24


def alibi_attention(call: FusedCall, slopes: torch.Tensor, owner: nn.Module | None = None) -> torch.Tensor | None:
    """Attention output [B, q, H, D] of ``call`` with ALiBi ``slopes`` [H], or None to leave it to the dense path.
    ``owner`` (the scheme module) keeps a bias row for decoding steps (:mod:`~hf_posswap.schemes.kept_rows`)."""
    heads, kv_heads = call.query.shape[1], call.key.shape[1]
    if not _takes_dtype(call) or heads % kv_heads or slopes.shape[0] != heads:
        return None
    if not call.causal:
        return bidirectional_alibi_attention(call, slopes)
    if call.query.dtype in HALF_PRECISION and slopes.requires_grad and torch.is_grad_enabled():
        return _float32_causal(call, slopes, owner)
    return causal_alibi_attention(call, slopes, owner)


def _float32_causal(call: FusedCall, slopes: torch.Tensor, owner: nn.Module | None) -> torch.Tensor | None:
    """Causal half-precision attention whose slopes train: the separable form on q, k, v cast to float32, the output
    cast back. In the half-precision kernel the slopes' gradient is a row sum of the kernel's dS times j - c, and
    dS's rows sum to 0 only up to the rounding of the output the kernel's backward reads, an error |i - c| (up to
    half the length) then multiplies (measured, bfloat16, against float64: 11x the dense path's error at 300 tokens,
    3.5x this form's at 1,000; the dense path runs sdpa's math fallback, in float32, because its mask needs a
    gradient). Trainable slopes are the rare case (ALiBi fixes them), so they pay the float32 kernel; it is still
    faster than that fallback."""
    wide = dataclasses.replace(call, query=call.query.float(), key=call.key.float(), value=call.value.float())
    output = causal_alibi_attention(wide, slopes, owner)
    return None if output is None else output.to(call.query.dtype)


def _takes_dtype(call: FusedCall) -> bool:
    """float32/float64 anywhere; half precision on CPU (float16 only while its offsets fit, module docstring)."""
    dtype = call.query.dtype
    if dtype in FUSED_DTYPES:
        return True
    if dtype not in HALF_PRECISION or call.query.device.type != "cpu":
        return False
    if dtype == torch.float16:
        query_pos, key_pos = call.query_pos, call.key_pos
        reach = torch.maximum(key_pos.max() - query_pos.min(), query_pos.max() - key_pos.min())
        return int(reach) < HALF_OFFSET_LIMIT
    return True


# ---------------------------------------------------------------------------------------------------------------
# Causal: the separable form.


@dataclass
class CausalPlan:
    """How one causal call runs: the first ``visible`` keys (the rest are in no query's past), and the mask or
    ``is_causal`` that keeps each query to its past."""

    visible: int
    mask: torch.Tensor | None
    is_causal: bool


def causal_plan(call: FusedCall) -> CausalPlan | None:
    """Which keys each query sees, as the dense path decides it (None: a layout this path does not handle).

    With transformers' mask, the mask decides (as in the dense path). Without one, a key is visible when its
    position is at or before the query's: for token-index positions that is a bottom-right aligned causal mask,
    which is sdpa's top-left ``is_causal`` when the visible keys are as many as the queries, no mask for a single
    query, and an explicit ``[q, kv]`` boolean mask otherwise (a chunk after a cache: small). Explicit per-row
    positions [B, q] (PoSE) must increase along each row; then position order is index order.
    """
    q_len, kv_len = call.query.shape[2], call.key.shape[2]
    query_pos, key_pos = call.query_pos, call.key_pos
    if call.attention_mask is not None:
        return CausalPlan(kv_len, call.attention_mask[..., :kv_len], False)
    if query_pos.dim() == 2:
        if q_len != kv_len or not torch.equal(query_pos, key_pos) or not _increasing(query_pos):
            return None
        return CausalPlan(kv_len, None, q_len > 1)
    lag = -call.first_relative()  # the first query sees keys 0 .. lag
    visible = min(kv_len, q_len + lag)
    if lag < 0 or visible < 1:
        return None
    if q_len == 1:
        return CausalPlan(visible, None, False)
    if lag == 0:
        return CausalPlan(visible, None, True)
    allowed = torch.ones(q_len, visible, dtype=torch.bool, device=call.query.device).tril(lag)
    return CausalPlan(visible, allowed, False)


def memoised_plan(call: FusedCall) -> CausalPlan | None:
    """:func:`causal_plan`, once per forward: every layer of a forward has the same positions and mask."""
    mask_id = pinned_id(call.memo, call.attention_mask)
    key = ("alibi-plan", call.query.shape[2], call.key.shape[2], call.query_pos.dim(), mask_id)
    plan = call.memo.get(key)
    if plan is None:
        plan = call.memo[key] = causal_plan(call)
    return plan


def _centre(query_pos: torch.Tensor) -> torch.Tensor:
    """The reference position c: the middle of the query positions ([] or [B, 1] for per-row positions)."""
    first, last = (query_pos[0], query_pos[-1]) if query_pos.dim() == 1 else (query_pos[:, :1], query_pos[:, -1:])
    return torch.div(first + last, 2, rounding_mode="floor")


def _increasing(positions: torch.Tensor) -> bool:
    return bool((positions[:, 1:] > positions[:, :-1]).all())


def causal_alibi_attention(
    call: FusedCall, slopes: torch.Tensor, owner: nn.Module | None = None
) -> torch.Tensor | None:
    """Causal ALiBi through one fused sdpa call on q, k, v widened by one column (module docstring); a few
    queries after a cache (decoding) get their small ``[q, kv]`` bias instead, which spares copying the cache; a
    long prefill with steep slopes runs in query blocks (:data:`PRECISE_SPAN`)."""
    plan = memoised_plan(call)
    if plan is None:
        return None
    q_len = call.query.shape[2]
    if q_len <= SMALL_QUERY and q_len < plan.visible:
        return _small_query_attention(call, slopes, plan, owner)
    if plan.is_causal and q_len > PRECISE_BLOCK and float(slopes.detach().abs().max()) * q_len > PRECISE_SPAN:
        return _blocked_separable(call, slopes)
    return _separable(call, slopes, slice(None), plan.visible, plan.mask, plan.is_causal)


def _separable(
    call: FusedCall, slopes: torch.Tensor, rows: slice, visible: int, mask: torch.Tensor | None, is_causal: bool
) -> torch.Tensor:
    """The queries ``rows`` against the first ``visible`` keys in the separable form: output [B, rows, H, D]."""
    query, key, value = call.query[:, :, rows], call.key[:, :, :visible], call.value[:, :, :visible]
    batch, heads, q_len, head_dim = query.shape
    offsets = call.key_pos[..., :visible] - _centre(call.query_pos[..., rows])  # [kv] or [B, kv]: j - c
    query_columns, key_columns = position_columns(slopes, call.scaling, offsets, query.dtype)
    width = query_columns.shape[-1]  # query columns [1, H, 1, c], key columns [1 or B, kv, c]
    slope_columns = query_columns.expand(batch, heads, q_len, width)
    key_columns = key_columns[:, None].expand(batch, key.shape[1], visible, width)
    query = torch.cat([query, slope_columns], dim=-1)
    key, value, grouped = grouped_heads(query, torch.cat([key, key_columns], dim=-1), F.pad(value, (0, width)))
    output = sdpa_flushing_denormals(
        query, key, value, attn_mask=mask, dropout_p=call.dropout, is_causal=is_causal, scale=call.scaling,
        enable_gqa=grouped,
    )
    return output[..., :head_dim].transpose(1, 2).contiguous()  # [B, H, q, D + c] -> [B, q, H, D]


def position_columns(
    slopes: torch.Tensor, scaling: float, offsets: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(query columns [1, H, 1, c], key columns [1 or B, kv, c]) in ``dtype`` whose dot product times ``scaling`` is
    the ALiBi logit term ``m_h (j - c)``, from ``offsets`` j - c [kv] or [B, kv]: one column each in float32 /
    float64; in half precision four, from two-term splits of m / s and j - c (module docstring), so the float32 sum
    of their exact products is the float32 product."""
    if dtype not in HALF_PRECISION:
        return (slopes.to(dtype) / scaling).view(1, -1, 1, 1), offsets.to(dtype).view(-1, offsets.shape[-1], 1)
    slope_hi, slope_lo = _split(slopes.float() / scaling, dtype)
    offset_hi, offset_lo = _split(offsets.float(), dtype)
    query_columns = torch.stack([slope_hi, slope_hi, slope_lo, slope_lo], dim=-1)[None, :, None]
    key_columns = torch.stack([offset_hi, offset_lo, offset_hi, offset_lo], dim=-1)
    return query_columns, key_columns.view(-1, offsets.shape[-1], 4)


def _split(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``values`` as ``hi + lo`` in ``dtype`` (hi: values rounded; lo: the remainder rounded). To autograd
    d hi / d values = 1 and d lo / d values = 0, so the slopes' gradient arrives once, through hi's columns."""
    high = values.to(dtype)
    return high, (values - high.float()).to(dtype)


def _blocked_separable(call: FusedCall, slopes: torch.Tensor) -> torch.Tensor:
    """A causal prefill (queries = keys) in blocks of PRECISE_BLOCK queries, each with its own reference position:
    block [a, b) sees keys [0, b) through a bottom-right ``[b - a, b]`` boolean mask (the first block: is_causal)."""
    q_len, outputs = call.query.shape[2], []
    for start in range(0, q_len, PRECISE_BLOCK):
        stop = min(start + PRECISE_BLOCK, q_len)
        mask = None
        if start:
            mask = torch.ones(stop - start, stop, dtype=torch.bool, device=call.query.device).tril(start)
        outputs.append(_separable(call, slopes, slice(start, stop), stop, mask, is_causal=start == 0))
    return torch.cat(outputs, dim=1)


def _small_query_attention(
    call: FusedCall, slopes: torch.Tensor, plan: CausalPlan, owner: nn.Module | None = None
) -> torch.Tensor:
    """A few queries: the exact bias ``-m (i - j)`` [1 or B, H, q, visible] as sdpa's float mask. Grouped heads
    are folded into the query rows ([B, H, q] -> [B, Hkv, groups * q], a view), so the cache is never expanded."""
    query, key, value = call.query, call.key, call.value
    if plan.visible < key.shape[2]:  # a static cache's buffer: keys past the query are never read
        key, value = key[:, :, : plan.visible], value[:, :, : plan.visible]
    (batch, heads, q_len, head_dim), kv_heads = query.shape, key.shape[1]
    bias = _small_query_bias(call, slopes, plan, owner)
    folded = heads // kv_heads * q_len
    # no denormal flushing: a few query rows give few denormals, and setting the flag costs ops every layer
    # (measured, GPT-2 4x512 decoding at 8,192 tokens: 23.1 ms a step with flushing, 22.6 without)
    output = F.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, folded, head_dim),
        key,
        value,
        attn_mask=bias.view(bias.shape[0], kv_heads, folded, plan.visible),
        dropout_p=call.dropout,
        scale=call.scaling,
    )
    return output.view(batch, heads, q_len, head_dim).transpose(1, 2).contiguous()


def _small_query_bias(
    call: FusedCall, slopes: torch.Tensor, plan: CausalPlan, owner: nn.Module | None = None
) -> torch.Tensor:
    """-m (i - j) with the plan's mask merged in: [1 or B, H, q, visible] (float32 for half-precision calls); once
    per forward when no gradient needs it (every layer shares the slopes). A decoding step (one query, index
    positions, no mask) reads it from a bias row kept on ``owner`` across steps: one copy of a slice, no arithmetic."""
    dtype = bias_dtype(call.query.dtype)
    key = ("alibi-small-bias", call.query.shape[2], plan.visible, dtype, pinned_id(call.memo, plan.mask))
    memoise = not (slopes.requires_grad and torch.is_grad_enabled())
    found = call.memo.get(key) if memoise else None
    if found is not None:
        return found
    if memoise and owner is not None and plan.mask is None and call.query_pos.dim() == 1 and call.query.shape[2] == 1:
        found = call.memo[key] = _decode_bias(owner, slopes, call.first_relative(), plan.visible, dtype)
        return found
    distance = (call.key_pos[..., None, : plan.visible] - call.query_pos[..., :, None]).to(dtype)  # j - i
    bias = slopes.to(dtype)[:, None, None] * (distance[:, None] if distance.dim() == 3 else distance[None, None])
    mask, lowest = plan.mask, torch.finfo(dtype).min  # never is_causal here: fewer queries than visible keys
    if mask is not None:
        bias = bias.masked_fill(~mask, lowest) if mask.dtype == torch.bool else (bias + mask).clamp(min=lowest)
    bias = bias.contiguous()
    if memoise:
        call.memo[key] = bias
    return bias


def _decode_bias(owner: nn.Module, slopes: torch.Tensor, first: int, visible: int, dtype: torch.dtype) -> torch.Tensor:
    """m (j - i) for one query and keys at relative positions first .. first + visible - 1 (all <= 0, the query's
    past): [1, H, 1, visible], copied from a row over every relative position kept on ``owner`` while the slopes
    stay the same (the same values as computing it: slope x relative position, in ``dtype``)."""

    def bias_row(relative: torch.Tensor) -> torch.Tensor:  # [2 span + 1] -> [H, 2 span + 1]
        return slopes.to(dtype)[:, None] * relative.to(dtype)[None]

    row, span = kept_row(owner, ("alibi-decode", dtype), slopes, max(-first, first + visible - 1), bias_row)
    return row_copy(row, span, first, visible)[None, :, None, :]


def grouped_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(key, value, enable_gqa) for sdpa: grouped key-value heads [B, Hkv, kv, D] stay unexpanded, except in half
    precision when a backward will follow: sdpa's CPU kernel then sums each group's key and value gradients in the
    half-precision dtype (measured, bfloat16 at 300 tokens, 4 queries per kv head: dk, dv 2-4x the error of the
    expanded heads' backward, which the dense path runs), so they are expanded to [B, H, kv, D] as the dense path
    does. The forward is the same either way."""
    groups = query.shape[1] // key.shape[1]
    if groups == 1:
        return key, value, False
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if query.dtype in HALF_PRECISION and backward:
        return key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1), False
    return key, value, True


# ---------------------------------------------------------------------------------------------------------------
# Bidirectional: the dense bias, one block of queries at a time.


def bidirectional_alibi_attention(call: FusedCall, slopes: torch.Tensor) -> torch.Tensor | None:
    """Encoder ALiBi ``-m |i - j|``: a Toeplitz view of the bias when there is no padding mask, else (when the
    whole bias would be large) sdpa over blocks of queries with a dense bias block each; else None (dense path)."""
    shift = _index_shift(call)
    if call.attention_mask is None and shift is not None:
        return _toeplitz_attention(call, slopes, shift)
    batch, heads, q_len, _ = call.query.shape
    if batch * heads * q_len * call.key.shape[2] <= DENSE_BIAS_ELEMENTS:
        return None
    return _blocked_attention(call, slopes)


def _index_shift(call: FusedCall) -> int | None:
    """s with key_pos[j] - query_pos[i] = j - i + s for every i, j (token-index positions), else None. Explicit
    per-row positions qualify when they are the same consecutive run for queries and keys (an encoder's
    ``position_ids``)."""
    query_pos, key_pos = call.query_pos, call.key_pos
    if query_pos.dim() == 1:
        return call.first_relative()
    if torch.equal(query_pos, key_pos) and bool((query_pos[:, 1:] - query_pos[:, :-1] == 1).all()):
        return 0
    return None


def _toeplitz_attention(call: FusedCall, slopes: torch.Tensor, shift: int) -> torch.Tensor:
    """The bias depends on j - i only, so with the queries in reverse order row i' of it is row i' - 1 moved one
    key along: the whole ``[H, q, kv]`` bias is an overlapping view (strides 1, 1) of one ``[H, q + kv - 1]`` row per
    head. sdpa reads the view as it is: no ``[q, kv]`` tensor exists."""
    query, key, value = call.query, call.key, call.value
    heads, q_len, kv_len = query.shape[1], query.shape[2], key.shape[2]
    distance = torch.arange(q_len + kv_len - 1, device=query.device) - (q_len - 1) + shift  # base[i' + j] is f(j - i)
    dtype = bias_dtype(query.dtype)
    base = -(slopes.to(dtype)[:, None] * distance.abs().to(dtype)[None])  # [H, q + kv - 1]
    bias = base.as_strided((1, heads, q_len, kv_len), (0, base.stride(0), 1, 1))
    key, value, grouped = grouped_heads(query, key, value)
    output = sdpa_flushing_denormals(
        query.flip(2), key, value, attn_mask=bias, dropout_p=call.dropout, scale=call.scaling, enable_gqa=grouped
    )
    return output.flip(2).transpose(1, 2).contiguous()


def _blocked_attention(call: FusedCall, slopes: torch.Tensor) -> torch.Tensor:
    """Padded or per-row-position calls with a large bias: blocks of queries, each with its own dense bias."""
    query, key, value = call.query, call.key, call.value
    batch, heads, q_len, _ = query.shape
    key, value, grouped = grouped_heads(query, key, value)
    block = max(1, min(q_len, BIAS_BLOCK_ELEMENTS // (batch * heads * key.shape[2])))
    outputs = []
    for start in range(0, q_len, block):
        stop = min(start + block, q_len)
        outputs.append(
            sdpa_flushing_denormals(
                query[:, :, start:stop], key, value, attn_mask=_bidirectional_bias(call, slopes, start, stop),
                dropout_p=call.dropout, scale=call.scaling, enable_gqa=grouped,
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _bidirectional_bias(call: FusedCall, slopes: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """-m |i - j| for queries start..stop, merged with transformers' mask: [1 or B, H, stop - start, kv]."""
    dtype = bias_dtype(call.query.dtype)
    distance = (call.key_pos[..., None, :] - call.query_pos[..., start:stop, None]).abs().to(dtype)  # [.., q, kv]
    if distance.dim() == 2:
        distance = distance[None]
    bias = -(slopes.to(dtype)[None, :, None, None] * distance[:, None])
    mask = call.attention_mask
    if mask is None:
        return bias
    mask = mask[..., : call.key.shape[2]] if mask.shape[-2] == 1 else mask[..., start:stop, : call.key.shape[2]]
    lowest = torch.finfo(dtype).min
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, lowest)
    return (bias + mask).clamp(min=lowest)
