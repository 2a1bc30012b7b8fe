"""Bias schemes through ``torch.nn.attention.flex_attention``: the scheme's bias as a ``score_mod``, causality and
transformers' mask as a ``BlockMask``, so no ``[B, H, q, kv]`` bias is ever built (the dense path's bias is 64 GiB
per layer call at 32k tokens and 32 heads in bf16).

Each bias scheme gives its bias as an elementwise function of (head, query position, key position)
(:meth:`~hf_posswap.schemes.base.BiasPositions.flex_bias`); this module wraps it into a ``score_mod`` that reads the
positions (index positions: first position + index; explicit per-row positions [B, q]: gathered by batch row), and
builds the ``BlockMask`` from token order (keys at or before the query, for causal attention without a mask; the
positions a bias reads may restart, as packed sequences' ids do), or from transformers' bool mask (padding, sliding
windows), or none (bidirectional attention without a mask).

The block mask is made from block summaries, never from a ``[q, kv]`` evaluation of the mask function: for
token order, the least and greatest index of each block of 128 queries and keys say whether a block is fully
visible (its latest key at or before its earliest query), partly visible, or hidden; for a mask tensor, ``any`` and
``all`` over each block. It is made once per forward (``memo``) and shared by every layer.

On CUDA the module-level compiled ``flex_attention`` runs (forward and backward, gradients reaching the scheme's
parameters through the tensors the ``score_mod`` captures, each spread over :data:`FLEX_LANES` copies so the
backward's atomic adds do not pile onto one address per head); it is compiled with ``fullgraph=True`` and a failure
of the compiled forward raises :class:`~hf_posswap.errors.FlexAttentionError` instead of running another
implementation. On CPU (tests only: add ``"cpu"`` to :data:`FLEX_DEVICES`) the uncompiled ``flex_attention`` runs,
forward only: it materialises the scores but is exact.

What flex expresses, and what it declines
-----------------------------------------
Expressed exactly: ALiBi (``m_h (j - i)``; ``-m_h |j - i|`` bidirectional), T5 (the table's bias gathered at the
relative position, clamped to ``max_distance`` where every bucket saturates), KERPLE (log and power), Sandwich
(a kept distance table gathered at ``|i - j|``), FIRE (the normalised log distance from tables over relative and
query positions, and the 1 -> W -> H ReLU MLP as the piecewise-linear function it is: W comparisons and two
gathers per score), head mixes (the bias part, zero on rotary heads; rotary heads are rotated before the call) and
layer mixes (each bias part per layer).

Measured on an H200 (torch 2.11, ``scripts/benchmarks/bench_flex.py``: 2 LLaMA layers of 16 heads of 128, bf16, 8,192
tokens, forward + backward with trainable KERPLE): flex 106 ms and 1.8 GiB peak against the dense path's 120 ms
and 31.8 GiB; without the lanes (every gradient add of a head at one address) flex took 2,304 ms.

Declined (the fused or dense paths run, unchanged): devices outside :data:`FLEX_DEVICES`; calls with fewer than
:data:`FLEX_MIN_QUERIES` queries (decoding steps: their dense bias is a few rows); float64 (flex's score_mod runs
in float32 here); dropout in training (flex has none); float additive masks (they may carry values other than
0 / -inf, which a mask function cannot express; transformers' sdpa mask builder hands bool masks); masks with a
head dimension; CPU calls that need a gradient (uncompiled flex has no backward); eager attention (it must return
the attention weights, which flex does not form).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..errors import FlexAttentionError
from ..schemes.base import FlexBias, FlexSpec, FusedCall, pinned_id

#: device types the flex path runs on; CPU only in tests (uncompiled flex materialises the scores, forward only)
FLEX_DEVICES: set[str] = {"cuda"}
#: device types where flex runs compiled (with a backward); elsewhere it runs uncompiled, forward only, and calls that
#: may need a gradient keep the other paths
FLEX_COMPILED_DEVICES: set[str] = {"cuda"}
#: the torch.compile backend of compiled flex (tests on CPU use "aot_eager": flex's own reference backward, which
#: computes the gradients of captured tensors as the CUDA kernel does)
FLEX_BACKEND = "inductor"
#: the fewest queries a call needs for flex: below it (decoding steps, short chunks) the dense bias is at most 15 rows
#: per head (15 x kv x H numbers: 30 MiB at 32k keys, 32 heads, bf16), cheaper than a block mask and a kernel launch,
#: and such calls would make compiled flex specialise on yet another shape
FLEX_MIN_QUERIES = 16
#: dtypes flex takes (the bias is float32 in the kernel; float64 keeps the dense path, which computes it in float64)
FLEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: flex's default sparse block size, used for the block summaries
FLEX_BLOCK = 128
#: copies of each captured parameter when a gradient is needed (see ``BiasPositions.flex_bias``): a score's lane is
#: (query index % 8) * 128 + key index % 128, so the atomic adds of one block of 128 x 128 scores into a parameter's
#: gradient go to 1,024 addresses (16 each) instead of one
FLEX_LANES = 1024
#: compiled flex specialises per (score_mod, mask_mod, dtype, grad mode, shape kind): room for every scheme and layout
#: of a process before compiling refuses (fullgraph raises at the limit; the default limit is 8)
FLEX_RECOMPILE_LIMIT = 64


@functools.cache
def flex_module() -> Any:
    """``torch.nn.attention.flex_attention`` (the module), or None where this torch has none."""
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError:
        return None
    has_all = all(hasattr(module, name) for name in ("flex_attention", "BlockMask"))
    return module if has_all else None


@functools.cache
def compiled_flex(backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """The one compiled ``flex_attention`` of the process per backend, made on first use."""
    return torch.compile(flex_module().flex_attention, backend=backend, fullgraph=True)


def flex_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype | None:
    """The dtype flex runs q, k and v in: autocast's when it is on (q, k, v may then differ), else theirs when they
    agree; None when that dtype is not one flex takes."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    elif query.dtype == key.dtype == value.dtype:
        dtype = query.dtype
    else:
        return None
    return dtype if dtype in FLEX_DTYPES else None


def flex_applies(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float
) -> bool:
    """Whether a self-attention call (q [B, H, q, D], k/v [B, Hkv, kv, D]) takes the flex path (module docstring)."""
    device_type = query.device.type
    if device_type not in FLEX_DEVICES or flex_module() is None or dropout > 0:
        return False
    if query.shape[2] < FLEX_MIN_QUERIES or query.shape[1] % key.shape[1] or flex_dtype(query, key, value) is None:
        return False
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.shape[1] != 1):
        return False
    return device_type in FLEX_COMPILED_DEVICES or not torch.is_grad_enabled()


def position_ranges_of(call: FusedCall) -> tuple[int, tuple[int, int]]:
    """(reach, (least, greatest) query position) of the call: reach is the largest |key position - query position|
    over every (query, key) pair. Index positions: from the starts, no sync; explicit per-row positions: one sync,
    memoised per forward."""
    q_len, kv_len = call.query.shape[2], call.key.shape[2]
    if call.starts is not None:
        first_query, first_key = call.starts
        reach = max(abs(first_key + kv_len - 1 - first_query), abs(first_query + q_len - 1 - first_key))
        return reach, (first_query, first_query + q_len - 1)
    memo_key = ("flex-ranges", pinned_id(call.memo, call.query_pos), pinned_id(call.memo, call.key_pos))
    found = call.memo.get(memo_key)
    if found is None:
        query_pos, key_pos = call.query_pos, call.key_pos
        ends = torch.stack((query_pos.min(), query_pos.max(), key_pos.min(), key_pos.max())).tolist()
        reach = max(abs(ends[3] - ends[0]), abs(ends[1] - ends[2]))
        found = call.memo[memo_key] = reach, (ends[0], ends[1])
    return found


def flex_spec(call: FusedCall) -> FlexSpec:
    """What the scheme's ``flex_bias`` is told about the call (lanes only when a gradient may be needed)."""
    reach, query_range = position_ranges_of(call)
    lanes = FLEX_LANES if torch.is_grad_enabled() else 1
    return FlexSpec(call.layer_idx, call.causal, reach, query_range, call.query.device, lanes)


PositionReader = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def position_readers(call: FusedCall) -> tuple[PositionReader, PositionReader]:
    """(query position of (batch row b, query index), key position of (b, key index)) as kernel functions: index
    positions are first position + index (the first is a captured 0-d view, no copy), explicit per-row positions
    [B, q] / [B, kv] are gathered at row b."""
    if call.query_pos.dim() == 1:
        first_query, first_key = call.query_pos[0], call.key_pos[0]  # 0-d views

        def query_at(batch: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            return index + first_query

        def key_at(batch: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            return index + first_key

        return query_at, key_at
    batch = call.query.shape[0]
    query_rows, key_rows = call.query_pos.expand(batch, -1), call.key_pos.expand(batch, -1)  # [B, q], [B, kv]

    def query_row_at(batch: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return query_rows[batch, index]

    def key_row_at(batch: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return key_rows[batch, index]

    return query_row_at, key_row_at


def score_mod_of(bias: FlexBias, call: FusedCall, lanes: int) -> Callable[..., torch.Tensor]:
    """flex's ``score_mod``: the (scaled) score plus the scheme's bias at the pair's positions and lane."""
    query_at, key_at = position_readers(call)
    rows = max(lanes // FLEX_BLOCK, 1)

    def score_mod(score: torch.Tensor, batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor,
                  kv_idx: torch.Tensor) -> torch.Tensor:
        lane = (q_idx % rows) * FLEX_BLOCK + kv_idx % FLEX_BLOCK if lanes > 1 else kv_idx % 1
        return score + bias(head, query_at(batch, q_idx), key_at(batch, kv_idx), lane)

    return score_mod


# ---------------------------------------------------------------------------------------------------------------
# Block masks from block summaries.


def _blocks(count: int) -> int:
    return -(-count // FLEX_BLOCK)


def position_ranges(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(least, greatest) position of each block of FLEX_BLOCK entries: positions [P, n] -> [P, blocks] each (the
    last block is padded with its last position, which changes neither)."""
    pad = _blocks(positions.shape[-1]) * FLEX_BLOCK - positions.shape[-1]
    if pad:
        positions = torch.cat((positions, positions[:, -1:].expand(-1, pad)), dim=-1)
    blocks = positions.view(positions.shape[0], -1, FLEX_BLOCK)  # [P, blocks, FLEX_BLOCK]
    return blocks.amin(-1), blocks.amax(-1)


def causal_block_summary(query_pos: torch.Tensor, key_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(any visible, all visible) per (query block, key block) for "key position <= query position": positions
    [q] / [kv] or [B, q] / [B, kv] -> [P, q blocks, kv blocks] bool each (P = 1 or B). Exact for any positions,
    increasing or not: a block pair has a visible pair iff its least key position <= its greatest query position,
    and all pairs visible iff its greatest key position <= its least query position."""
    query_low, query_high = position_ranges(query_pos.reshape(-1, query_pos.shape[-1]))  # [P, q blocks]
    key_low, key_high = position_ranges(key_pos.reshape(-1, key_pos.shape[-1]))  # [P, kv blocks]
    any_visible = key_low[:, None, :] <= query_high[:, :, None]  # [P, q blocks, kv blocks]
    all_visible = key_high[:, None, :] <= query_low[:, :, None]
    return any_visible, all_visible


def mask_block_summary(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(any True, all True) per block of a bool mask [M, q, kv] -> [M, q blocks, kv blocks] each. Entries past the
    ends count as hidden for ``any`` and as visible for ``all`` (flex never reads them)."""
    count, q_len, kv_len = mask.shape
    q_blocks, kv_blocks = _blocks(q_len), _blocks(kv_len)
    summaries = []
    for fill, reduce in ((False, torch.any), (True, torch.all)):
        padded = mask.new_full((count, q_blocks * FLEX_BLOCK, kv_blocks * FLEX_BLOCK), fill)
        padded[:, :q_len, :kv_len] = mask
        tiles = padded.view(count, q_blocks, FLEX_BLOCK, kv_blocks, FLEX_BLOCK)
        summaries.append(reduce(reduce(tiles, dim=-1), dim=2))
    return summaries[0], summaries[1]


def _kv_block_lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """flex's (kv_num_blocks [P, 1, q blocks], kv_indices [P, 1, q blocks, kv blocks]) of selected blocks
    [P, q blocks, kv blocks]: per query block, how many, and their indices first (ascending), the rest after."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]


def block_mask_of(
    any_visible: torch.Tensor, all_visible: torch.Tensor, mask_mod: Callable[..., torch.Tensor], q_len: int,
    kv_len: int
) -> Any:
    """A BlockMask: fully visible blocks skip ``mask_mod``, partly visible ones apply it, the rest are skipped."""
    partial = any_visible & ~all_visible
    kv_num_blocks, kv_indices = _kv_block_lists(partial)
    full_num_blocks, full_indices = _kv_block_lists(all_visible)
    return flex_module().BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_num_blocks, full_indices, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )


def flex_block_mask(call: FusedCall) -> Any:
    """The call's BlockMask (None: every key visible), made once per forward and shared by every layer."""
    q_len, kv_len = call.query.shape[2], call.key.shape[2]
    mask = call.attention_mask
    memo_key = ("flex-block-mask", q_len, kv_len, call.causal, pinned_id(call.memo, mask),
                call.query_pos.dim(), call.query.device)
    if memo_key in call.memo:  # (a BlockMask, or None: every key visible)
        return call.memo.get(memo_key)
    block_mask = call.memo[memo_key] = _make_block_mask(call, q_len, kv_len)
    return block_mask


def _make_block_mask(call: FusedCall, q_len: int, kv_len: int) -> Any:
    if call.attention_mask is not None:  # transformers' mask decides, as in the dense path
        mask = call.attention_mask[:, 0, :, :kv_len]  # [M, q, kv] bool
        rows = mask.expand(call.query.shape[0], -1, -1)  # [B, q, kv], a view: mask_mod reads row b

        def tensor_mask(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor,
                        kv_idx: torch.Tensor) -> torch.Tensor:
            return rows[batch, q_idx, kv_idx]

        any_visible, all_visible = mask_block_summary(mask)
        return block_mask_of(any_visible, all_visible, tensor_mask, q_len, kv_len)
    if not call.causal:
        return None
    # causality by token order, not by the positions the bias reads (ids that restart, as packed sequences' do,
    # would let a query see later tokens): key j is in query i's past when j <= i + lag
    lag = call.causal_lag()

    def causal_mask(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor,
                    kv_idx: torch.Tensor) -> torch.Tensor:
        return kv_idx <= q_idx + lag

    device = call.query.device
    query_index = torch.arange(q_len, device=device) + lag  # [q], in key index units
    any_visible, all_visible = causal_block_summary(query_index, torch.arange(kv_len, device=device))
    return block_mask_of(any_visible, all_visible, causal_mask, q_len, kv_len)


# ---------------------------------------------------------------------------------------------------------------
# Running flex.


def flex_bias_output(call: FusedCall, bias: FlexBias, spec: FlexSpec) -> torch.Tensor:
    """Attention output [B, q, H, D] of ``call`` with the elementwise ``bias`` made for ``spec`` (q, k, v cast to
    one dtype first under autocast; the call then runs with autocast off, in that dtype)."""
    dtype = flex_dtype(call.query, call.key, call.value)
    query, key, value = (tensor.to(dtype) for tensor in (call.query, call.key, call.value))
    block_mask = flex_block_mask(call)
    score_mod = score_mod_of(bias, call, spec.lanes)
    gqa = query.shape[1] != key.shape[1]
    with torch.autocast(query.device.type, enabled=False):
        output = run_flex(query, key, value, score_mod, block_mask, call.scaling, gqa)  # [B, H, q, D]
    return output.transpose(1, 2).contiguous()  # [B, q, H, D]


def _recompile_limit() -> Any:
    """A context raising dynamo's recompile limit to FLEX_RECOMPILE_LIMIT (named cache_size_limit before torch 2.7)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), FLEX_RECOMPILE_LIMIT)})


def run_flex(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable[..., torch.Tensor],
    block_mask: Any, scale: float, gqa: bool
) -> torch.Tensor:
    """flex_attention(q [B, H, q, D], k/v [B, Hkv, kv, D]) -> [B, H, q, D]: compiled on FLEX_COMPILED_DEVICES
    (errors of the forward's compilation re-raised as FlexAttentionError; the backward compiles at the first
    ``backward()`` and raises torch's own error there), uncompiled elsewhere (forward only)."""
    arguments = {"score_mod": score_mod, "block_mask": block_mask, "scale": scale, "enable_gqa": gqa}
    if query.device.type not in FLEX_COMPILED_DEVICES:
        with warnings.catch_warnings(), _recompile_limit():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_module().flex_attention(query, key, value, **arguments)
    try:
        with _recompile_limit():
            return compiled_flex(FLEX_BACKEND)(query, key, value, **arguments)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        raise FlexAttentionError(
            f"compiled flex_attention failed for a bias scheme's attention (q {tuple(query.shape)}, k "
            f"{tuple(key.shape)}, {query.dtype}): {type(error).__name__}: {error}. hf_posswap does not fall back "
            f"silently; to run this model on the dense path instead, remove {query.device.type!r} from "
            "hf_posswap.core.flex_bias.FLEX_DEVICES."
        ) from error
