"""Two-pass attention (Self-Extend, ReRoPE) as fused attention calls merged by log-sum-exp.

For a causal query at key index t (its position's index among the keys) the keys split into two disjoint sets:

- neighbour keys, 0 <= t - j < W, attended with exactly rotated queries and keys;
- far keys, t - j >= W (only for queries at or past the settings' ``start``), attended with far-rotated ones.

Each set is one fused attention that returns its output and log-sum-exp; softmax over the union is then exact
(Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", arXiv:1805.02867; the merge of flash
attention's split-KV and ring attention)::

    lse = logaddexp(lse_n, lse_f),  out = exp(lse_n - lse) out_n + exp(lse_f - lse) out_f

with ``out = out_n`` on rows without far keys. :mod:`hf_posswap.core.self_extend` rotates the queries and keys and
chooses this path or its query-chunked one. Two kernels, same decomposition:

- CPU (:func:`cpu_two_pass`): ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``, which returns the
  log-sum-exp and takes grouped kv heads unexpanded (as :mod:`hf_posswap.schemes.fused_t5`). The far set is one
  top-left causal call (queries [W, q) against keys [0, q - W) in a prefill). The neighbour band: rows before W
  are a causal call; later rows go in blocks of :data:`BAND_ROWS` queries, each against its ``rows + W - 1`` keys
  with one small shared mask, the key windows overlapping *views* of the keys (no copy). Inference only.
- CUDA (:func:`flex_two_pass`): ``flex_attention`` with one BlockMask per set (blocks outside the band or the far
  triangle skipped), compiled once; differentiable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: queries per band block on CPU: measured fastest (64 vs 16-512) at 8,192 tokens, W 512-1024, 2 threads
BAND_ROWS = 64

#: sdpa's fused CPU kernel: (query, key, value, dropout_p, is_causal, attn_mask=, scale=) -> (out [B, H, q, D],
#: log-sum-exp [B, H, q]); the callers pass dropout_p 0.0 and is_causal by position
_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

TwoPassKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class TwoPassLayout:
    """Where one call's queries sit among its keys. Query a is at key index ``a + delta`` (its own key in a dynamic
    cache; a static cache's later slots are future keys); queries from ``far_from`` on take far keys, those at
    least ``window`` before them."""

    q_len: int
    kv_len: int
    delta: int
    window: int
    far_from: int

    def far_rows(self) -> int:
        """First query with a far key (``q_len``: none)."""
        return min(self.q_len, max(self.far_from, self.window - self.delta, 0))


def fused_two_pass(
    near: tuple[torch.Tensor, torch.Tensor],
    far: tuple[torch.Tensor, torch.Tensor],
    value: torch.Tensor,
    layout: TwoPassLayout,
    scale: float,
) -> torch.Tensor:
    """Output [B, q, H, Dv] from (query [B, H, q, D], key [B, Hkv, kv, D]) rotated exactly (``near``) and by the
    far positions (``far``), value [B, Hkv, kv, Dv]: the CPU kernel on CPU, flex_attention elsewhere."""
    if near[0].device.type == "cpu":
        return cpu_two_pass(near, far, value, layout, scale)
    return flex_two_pass(near, far, value, layout, scale)


# -- merging ------------------------------------------------------------------------------------------------------


def _merge_into(
    out: torch.Tensor, lse: torch.Tensor, rows: slice, part_out: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """Fold one part (output [B, r, H, D], log-sum-exp [B, H, r]) into ``out`` [B, q, H, D] and ``lse`` [B, H, q]
    on query ``rows``, in place."""
    total = torch.logaddexp(lse[:, :, rows], part_lse)
    kept = (lse[:, :, rows] - total).exp().transpose(1, 2)[..., None]  # [B, r, H, 1]
    added = (part_lse - total).exp().transpose(1, 2)[..., None]
    out[:, rows] = out[:, rows] * kept + part_out * added
    lse[:, :, rows] = total


# -- CPU ----------------------------------------------------------------------------------------------------------


def cpu_two_pass(
    near: tuple[torch.Tensor, torch.Tensor],
    far: tuple[torch.Tensor, torch.Tensor],
    value: torch.Tensor,
    layout: TwoPassLayout,
    scale: float,
    band_rows: int | None = None,
) -> torch.Tensor:
    """The merged attention with the CPU fused kernel (no autograd): output [B, q, H, Dv]; ``band_rows`` queries
    per band block (default :data:`BAND_ROWS`)."""
    out, lse = _cpu_neighbours(near[0], near[1], value, layout, scale, band_rows or BAND_ROWS)
    first = layout.far_rows()
    if first < layout.q_len:
        rows = slice(first, layout.q_len)
        _cpu_spans(far[0], far[1], value, rows, layout.delta - layout.window, scale, out, lse, merge=True)
    return out.to(value.dtype)


def _causal_spans(first: int, last: int, shift: int) -> list[tuple[slice, bool]]:
    """Queries [first, last) where query r takes keys [0, r + shift], as (keys, top-left causal) calls: a
    rectangle of the keys every row takes, then a triangle (one call when a single row or no rectangle)."""
    seen = first + shift  # keys [0, seen) are taken by every row
    if last - first == 1:
        return [(slice(0, seen + 1), False)]
    triangle = (slice(seen, last + shift), True)
    return [triangle] if seen == 0 else [(slice(0, seen), False), triangle]


def _cpu_spans(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rows: slice,
    shift: int,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    merge: bool,
) -> None:
    """Queries ``rows`` each against keys [0, r + shift] (:func:`_causal_spans`), written into (``merge``: folded
    into) ``out`` [B, q, H, Dv] and ``lse`` [B, H, q]."""
    for index, (keys, causal) in enumerate(_causal_spans(rows.start, rows.stop, shift)):
        part_out, part_lse = _cpu_flash(query[:, :, rows], key[:, :, keys], value[:, :, keys], 0.0, causal, scale=scale)
        if merge or index:
            _merge_into(out, lse, rows, part_out.transpose(1, 2), part_lse)
        else:
            out[:, rows], lse[:, :, rows] = part_out.transpose(1, 2), part_lse


def _cpu_neighbours(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: TwoPassLayout, scale: float, band_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with exact rotations: output [B, q, H, Dv] (float32 at least) and log-sum-exp [B, H, q]. Queries
    without far keys (key index below W, or before ``far_from``) take every earlier key; later ones their last W
    keys, in band blocks."""
    batch, heads, q_len, _ = query.shape
    dtype = torch.promote_types(value.dtype, torch.float32)
    out = query.new_empty(batch, q_len, heads, value.shape[-1], dtype=dtype)
    lse = query.new_empty(batch, heads, q_len, dtype=dtype)
    head = layout.far_rows()
    if head:
        _cpu_spans(query, key, value, slice(0, head), layout.delta, scale, out, lse, merge=False)
    if head < q_len:
        _cpu_band(query, key, value, layout, scale, band_rows, head, out, lse)
    return out, lse


def _band_mask(rows: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, rows + W - 1] additive mask of a band block: row r sees window columns r .. r + W - 1."""
    relative = torch.arange(rows + window - 1)[None, :] - torch.arange(rows)[:, None]  # column - row
    inside = (relative >= 0) & (relative < window)
    return torch.zeros(inside.shape, dtype=dtype).masked_fill_(~inside, torch.finfo(dtype).min)


def _cpu_band(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: TwoPassLayout,
    scale: float,
    band_rows: int,
    first: int,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Queries [first, q) (key index >= W) in blocks of ``band_rows``; block rows r see keys [t_r - W + 1, t_r],
    written into ``out`` [B, q, H, Dv] and ``lse`` [B, H, q]."""
    batch, heads, q_len, _ = query.shape
    window = layout.window
    rows = min(band_rows, q_len - first)
    blocks = (q_len - first) // rows
    mask = _band_mask(rows, window, query.dtype)
    start = first + layout.delta - window + 1  # first key of block 0's window
    width = rows + window - 1
    stop = first + blocks * rows
    for b in range(batch):  # the key windows are views with the block as batch dim: one batch row at a time
        span = slice(start, start + (blocks - 1) * rows + width)
        key_windows = key[b, :, span].unfold(1, width, rows).permute(1, 0, 3, 2)  # [n, Hkv, width, D]
        value_windows = value[b, :, span].unfold(1, width, rows).permute(1, 0, 3, 2)
        query_blocks = query[b, :, first:stop].unflatten(1, (blocks, rows)).transpose(0, 1)  # [n, H, rows, D]
        block_out, block_lse = _cpu_flash(
            query_blocks, key_windows, value_windows, 0.0, False, attn_mask=mask if rows > 1 else None, scale=scale
        )
        out[b, first:stop] = block_out.transpose(1, 2).reshape(blocks * rows, heads, -1)  # [n, H, r, D] -> [n*r, H, D]
        lse[b, :, first:stop] = block_lse.transpose(0, 1).reshape(heads, blocks * rows)
    tail = q_len - stop
    if tail:
        keys = slice(stop + layout.delta - window + 1, q_len + layout.delta)
        tail_out, tail_lse = _cpu_flash(
            query[:, :, stop:], key[:, :, keys], value[:, :, keys], 0.0, False,
            attn_mask=_band_mask(tail, window, query.dtype) if tail > 1 else None, scale=scale,
        )
        out[:, stop:] = tail_out.transpose(1, 2)
        lse[:, :, stop:] = tail_lse


# -- CUDA: flex_attention -----------------------------------------------------------------------------------------


@functools.cache
def compiled_two_pass_flex() -> TwoPassKernel:
    """``flex_attention`` compiled once per process (its fused kernels exist only compiled)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=4)
def _flex_masks(layout: TwoPassLayout, device: torch.device) -> tuple:
    """BlockMasks of the neighbour set (0 <= t - j < W; every t - j >= 0 before ``far_from``) and the far set
    (t - j >= W, queries from ``far_from``); the last few kept (every layer of a forward, and repeated lengths,
    share them).
    The layout's numbers enter the mask functions as tensors, so a compiled kernel is not specialised on them."""
    from torch.nn.attention.flex_attention import create_block_mask

    delta, window, far_from = (torch.tensor(n, device=device) for n in (layout.delta, layout.window, layout.far_from))

    def neighbour(batch, head, q_idx, kv_idx):  # noqa: ANN001, ANN202 (flex's mask_mod signature)
        distance = q_idx + delta - kv_idx
        return (distance >= 0) & ((distance < window) | (q_idx < far_from))

    def far(batch, head, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return (q_idx + delta - kv_idx >= window) & (q_idx >= far_from)

    sizes = (None, None, layout.q_len, layout.kv_len)
    return create_block_mask(neighbour, *sizes, device=device), create_block_mask(far, *sizes, device=device)


def _flex_call(attend: TwoPassKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> tuple:
    """(output [B, H, q, Dv], natural log-sum-exp [B, H, q]) of one flex_attention call, grouped heads unexpanded."""
    grouped = q.shape[1] != k.shape[1]
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch < 2.9: the older keyword
        return attend(q, k, v, block_mask=mask, scale=scale, enable_gqa=grouped, return_lse=True)
    out, aux = attend(q, k, v, block_mask=mask, scale=scale, enable_gqa=grouped, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def flex_two_pass(
    near: tuple[torch.Tensor, torch.Tensor],
    far: tuple[torch.Tensor, torch.Tensor],
    value: torch.Tensor,
    layout: TwoPassLayout,
    scale: float,
    attend: TwoPassKernel | None = None,
) -> torch.Tensor:
    """The merged attention with ``flex_attention`` (``attend``: default the compiled one; the uncompiled one runs
    on CPU, for tests): output [B, q, H, Dv], differentiable. Far rows without far keys get log-sum-exp -inf and
    output 0 from flex, so they take the neighbour output unchanged."""
    masks = _flex_masks(layout, near[0].device)
    attend = attend or compiled_two_pass_flex()
    near_out, near_lse = _flex_call(attend, near[0], near[1], value, masks[0], scale)
    if layout.far_rows() >= layout.q_len:
        return near_out.transpose(1, 2)
    far_out, far_lse = _flex_call(attend, far[0], far[1], value, masks[1], scale)
    total = torch.logaddexp(near_lse, far_lse)  # [B, H, q]
    out = near_out * (near_lse - total).exp()[..., None] + far_out * (far_lse - total).exp()[..., None]
    return out.transpose(1, 2).to(value.dtype)
