"""T5 relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified
Text-to-Text Transformer", §2.1): a learned scalar per (head, bucket of relative distance), added to the logits."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import InvalidConfigError
from .base import (
    BiasPositions,
    FlexBias,
    FlexSpec,
    FusedCall,
    ModelSpec,
    SchemeConfig,
    pinned_id,
    register_scheme,
    require_bool,
    require_int_at_least,
    spread,
)
from .fused_t5 import fused_t5_attention
from .fused_t5_plan import Plan, plan_attention, saturation_distance
from .kept_rows import kept_row, row_copy, row_slice
from .precision import HALF_PRECISION, bias_dtype


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Map relative positions (key - query) to bucket ids as T5 does (Raffel et al. 2020, §2.1).

    Half the buckets (per direction when bidirectional) hold exact distances; the rest cover distances up to
    ``max_distance`` in logarithmically growing ranges; farther distances share the last bucket.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # only keys at or before the query
    exact = num_buckets // 2
    is_small = distance < exact
    # log-spaced buckets between `exact` and `max_distance`
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = exact + (log_ratio * (num_buckets - exact)).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class _GatherBuckets(torch.autograd.Function):
    """weight [H, nb] gathered at bucket ids [q, kv] -> [H, q, kv].

    Same values as ``weight[:, buckets]``; the backward sums gradients per bucket with ``index_add_``, which on CPU
    is about 4x faster than the generic indexing backward for the few-buckets, many-positions case here.
    """

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(buckets)
        ctx.num_buckets = weight.shape[1]
        return weight[:, buckets]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (buckets,) = ctx.saved_tensors
        grad_weight = grad.new_zeros(grad.shape[0], ctx.num_buckets)
        grad_weight.index_add_(1, buckets.flatten(), grad.reshape(grad.shape[0], -1))
        return grad_weight, None


class T5RelativeBias(BiasPositions):
    """Learned bias tables ``[num_buckets, num_heads]``: one shared by all layers, or one per layer."""

    fused_min_queries = 2  # a decoding step's dense bias is one row per head, shared by every layer
    fused_path = "fused-t5"

    def __init__(
        self, num_heads: int, num_layers: int, num_buckets: int, max_distance: int, shared_across_layers: bool
    ) -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        count = 1 if shared_across_layers else num_layers
        self.tables = nn.ModuleList(nn.Embedding(num_buckets, num_heads) for _ in range(count))
        for table in self.tables:
            nn.init.zeros_(table.weight)

    def forward(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, layer_idx: int, causal: bool, memo: dict | None = None
    ) -> torch.Tensor:
        # query_pos [q], key_pos [kv] -> [1, H, q, kv]  (or [B, q], [B, kv] -> [B, H, q, kv])
        table = self.tables[0] if len(self.tables) == 1 else self.tables[layer_idx]
        needs_grad = table.weight.requires_grad and torch.is_grad_enabled()
        if torch.compiler.is_compiling():  # kept rows and memo keys read the positions' values: computed in-graph
            return _bias_from(table, self._computed_buckets(query_pos, key_pos, causal))
        index_positions = query_pos.dim() == 1 and memo is not None  # the library's: ranges (see BiasPositions)
        if index_positions and query_pos.shape[0] == 1 and not needs_grad:
            first = int(key_pos[0]) - int(query_pos[0])
            if first + key_pos.shape[0] - 1 <= 0:  # a decoding step, every key at or before the query
                return self._decode_bias(table, first, key_pos.shape[0], causal)
        first_query, first_key = int(query_pos.flatten()[0]), int(key_pos.flatten()[0])
        memo_key = (  # index positions are ranges (shape + start say it all); row positions live for the forward
            "t5-buckets",
            causal,
            tuple(query_pos.shape),
            tuple(key_pos.shape),
            first_query,
            first_key,
            pinned_id(memo, query_pos) if query_pos.dim() > 1 else None,
        )
        buckets = memo.get(memo_key) if memo is not None else None
        if buckets is None and index_positions:  # a view of the kept bucket row
            buckets = self._index_buckets(first_query, query_pos.shape[0], first_key, key_pos.shape[0], causal)
        elif buckets is None:
            buckets = self._computed_buckets(query_pos, key_pos, causal)
        if memo is not None:
            memo[memo_key] = buckets
        return _bias_from(table, buckets)

    def _computed_buckets(self, query_pos: torch.Tensor, key_pos: torch.Tensor, causal: bool) -> torch.Tensor:
        """Bucket ids [q, kv] (or [B, q, kv]) computed from the positions."""
        relative = key_pos[..., None, :] - query_pos[..., :, None]  # [B, q, kv], memory - context as in T5
        return relative_position_bucket(relative, not causal, self.num_buckets, self.max_distance)

    def _index_buckets(self, first_query: int, q_len: int, first_key: int, kv_len: int, causal: bool) -> torch.Tensor:
        """Bucket ids [q, kv] of queries at first_query + r and keys at first_key + j (relative position
        first_key - first_query + j - r), read from a kept row of the buckets of every relative position: a view
        for one query (a decoding step), one copy of the ids otherwise; no bucket arithmetic either way."""
        lowest, highest = first_key - first_query - (q_len - 1), first_key - first_query + kv_len - 1
        row, span = self._bucket_row(max(-lowest, highest), causal)  # row[span + v]: bucket of relative position v
        windows = row.unfold(0, kv_len, 1)  # [2 span + 2 - kv, kv]: window w holds relative w - span .. + kv - 1
        first = span + first_key - first_query  # the window of query 0
        if q_len == 1:
            return windows[first : first + 1]
        return windows[first - q_len + 1 : first + 1].flip(0)  # query r starts one relative position lower

    def _bucket_row(self, reach: int, causal: bool) -> tuple[torch.Tensor, int]:
        """(row [2 span + 1], span): the bucket ids of relative positions -span .. span, span >= reach."""
        bucket_of = functools.partial(
            relative_position_bucket,
            bidirectional=not causal,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        return kept_row(self, ("t5-buckets", causal), None, reach, bucket_of, self.tables[0].weight.device)

    def _decode_bias(self, table: nn.Embedding, first: int, kv_len: int, causal: bool) -> torch.Tensor:
        """The bias [1, H, 1, kv] of one query and keys at relative positions first .. first + kv - 1: copied from
        a kept row of the table's bias at every relative position (rebuilt when the table changes)."""

        def bias_row(relative: torch.Tensor) -> torch.Tensor:  # relative -span .. span -> [H, 2 span + 1]
            buckets, span = self._bucket_row(int(relative[-1]), causal)
            return table.weight.to(torch.float32).t()[:, row_slice(buckets, span, int(relative[0]), relative.shape[0])]

        reach = max(-first, first + kv_len - 1)
        row, span = kept_row(self, ("t5-bias", causal, id(table)), table.weight, reach, bias_row)
        return row_copy(row, span, first, kv_len)[None, :, None, :]

    def flex_bias(self, spec: FlexSpec) -> FlexBias:
        """The table's bias gathered at the relative position, elementwise: exact, since every relative position
        at or past ``max_distance`` (either side) falls in its direction's last bucket (the log-spaced buckets stop
        there), so relative positions clamped to [-max_distance, max_distance] give the same buckets.

        The captured row ``[H, 2 M + 1, lanes]`` (``row[h, M + v]``: head h's bias at relative position v, M =
        max_distance) is gathered from the table with autograd, so the table's gradient flows through it."""
        table = self.tables[0] if len(self.tables) == 1 else self.tables[spec.layer_idx]
        limit = self.max_distance
        buckets = row_slice(*self._bucket_row(limit, spec.causal), -limit, 2 * limit + 1)  # [2 M + 1]
        row = table.weight.to(torch.float32).t()[:, buckets.to(table.weight.device)]  # [H, 2 M + 1]
        lanes = min(spec.lanes, 128)  # the adds of one relative position already spread along a diagonal
        row = spread(row, lanes)  # [H, 2 M + 1, lanes]

        def bias(head: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                 lane: torch.Tensor) -> torch.Tensor:
            return row[head, (key_pos - query_pos).clamp(-limit, limit) + limit, lane % lanes]

        return bias

    def fused_attention(self, call: FusedCall) -> torch.Tensor | None:
        """Exact attention with this bias split into far parts (one constant per head past the saturation distance)
        and a near band (see :mod:`hf_posswap.schemes.fused_t5`): output [B, q, H, D], or None (dense path).

        Runs on CPU in float32, float64, bfloat16 and float16 (the table and the band in float32 for the last two),
        for causal models with or without a cache (prefill, chunks after a
        cache, static caches) and for encoders without a cache, with grouped kv heads unexpanded and shared or
        per-layer tables. Declines (returns None): a single query (a decoding step: its dense bias is one row per
        head, shared by every layer, and one sdpa call beats the split), padding masks (anything but the plain
        causal pattern), per-row positions that differ, dropout in training, other dtypes and devices.
        """
        plan = self._fused_plan(call) if call.query.shape[2] > 1 else None
        if plan is None:
            return None
        table = self.tables[0] if len(self.tables) == 1 else self.tables[call.layer_idx]
        # [H, num_buckets] in the working dtype: float32 as the dense path's bias, float64 for float64 q
        weight = table.weight.to(torch.float32).t().to(bias_dtype(call.query.dtype))
        return fused_t5_attention(call.query, call.key, call.value, weight, plan).transpose(1, 2).contiguous()

    def _fused_plan(self, call: FusedCall) -> Plan | None:
        """How ``call`` splits into far parts and a band, or None when the fused form does not apply."""
        query, key = call.query, call.key
        if torch.compiler.is_compiling():  # planned from the positions' values: the compiled graph takes the dense bias
            return None
        dtypes = (torch.float32, torch.float64, *HALF_PRECISION)
        if query.device.type != "cpu" or query.dtype not in dtypes or key.dtype != query.dtype or call.dropout > 0:
            return None
        if not _consecutive_positions(call) or not _plain_mask(call):
            return None
        q_len, kv_len = query.shape[2], key.shape[2]
        # key j sits at query 0's position + delta + j
        delta = int(call.key_pos.flatten()[0]) - int(call.query_pos.flatten()[0])
        if not call.causal and (q_len != kv_len or delta != 0):
            return None
        memo_key = ("t5-fused-plan", call.causal, q_len, kv_len, delta, call.scaling)
        plan = call.memo.get(memo_key)
        if plan is None:
            bucket_of = functools.partial(
                relative_position_bucket,
                bidirectional=not call.causal,
                num_buckets=self.num_buckets,
                max_distance=self.max_distance,
            )
            before = saturation_distance(bucket_of, self.max_distance, -1)
            after = 1 if call.causal else saturation_distance(bucket_of, self.max_distance, 1)
            far = (int(bucket_of(torch.tensor(-before))), None if call.causal else int(bucket_of(torch.tensor(after))))
            plan = plan_attention(q_len, kv_len, delta, (1 - before, after - 1), far, bucket_of, call.scaling)
            call.memo[memo_key] = plan
        return plan

    def extra_repr(self) -> str:
        return f"num_buckets={self.num_buckets}, max_distance={self.max_distance}, tables={len(self.tables)}"


def _bias_from(table: nn.Embedding, buckets: torch.Tensor) -> torch.Tensor:
    """The table's bias at the bucket ids: buckets [q, kv] or [B, q, kv] -> [B or 1, H, q, kv] (float32)."""
    weight = table.weight.to(torch.float32).t()  # [num_buckets, H] -> [H, num_buckets]
    bias = _GatherBuckets.apply(weight, buckets)  # [H, ..., q, kv]
    return bias.movedim(0, -3) if bias.dim() == 4 else bias.unsqueeze(0)


def _consecutive_positions(call: FusedCall) -> bool:
    """Whether positions are consecutive: index positions [q], [kv] always are; explicit per-row positions [B, q]
    (encoders always pass them) qualify when every row is the same run of consecutive integers."""
    if call.query_pos.dim() == 1:
        return True
    memo_key = ("t5-fused-rows", pinned_id(call.memo, call.query_pos), pinned_id(call.memo, call.key_pos))
    plain = call.memo.get(memo_key)
    if plain is None:
        rows = call.query_pos
        steps = rows[:, 1:] - rows[:, :-1]
        plain = call.key_pos is rows and bool((rows == rows[:1]).all()) and bool((steps == 1).all())
        call.memo[memo_key] = plain
    return plain


def _plain_mask(call: FusedCall) -> bool:
    """Whether the call's mask hides nothing beyond causality (None, or a bool mask equal to the causal pattern
    of the call's positions: static caches and chunked prefill send one); encoders: no mask at all."""
    mask = call.attention_mask
    if mask is None:
        return True
    if not call.causal or mask.dtype != torch.bool:
        return False
    memo_key = ("t5-fused-mask", pinned_id(call.memo, mask), call.query.shape[2], call.key.shape[2])
    plain = call.memo.get(memo_key)
    if plain is None:
        query_pos = call.query_pos.flatten()[: call.query.shape[2]]  # rows are equal (checked before)
        key_pos = call.key_pos.flatten()[: call.key.shape[2]]
        allowed = key_pos[None, :] <= query_pos[:, None]  # [q, kv]
        plain = bool((mask[..., : call.key.shape[2]] == allowed).all())
        call.memo[memo_key] = plain
    return plain


@register_scheme
@dataclass
class T5BiasConfig(SchemeConfig):
    """T5's bucketed relative position bias: bidirectional buckets for encoders, causal buckets for decoders.

    Initialisation: the tables start at zero, so right after the swap the bias is exactly 0 and the model sees no
    position signal from it; attention logits keep their pretrained scale. This disturbs a pretrained model least
    (random tables would add noise of their own on top of removing the old positions); fine-tuning then learns
    the bias.

    Args:
        num_buckets: buckets per table (T5: 32).
        max_distance: distances at or past this share the last bucket (T5: 128).
        shared_across_layers: one table for all layers, as T5 does (default), or one per layer.
    """

    name = "t5"
    kind = "bias"
    paper = "Raffel et al. 2020, T5 (arXiv:1910.10683)"

    num_buckets: int = 32
    max_distance: int = 128
    shared_across_layers: bool = True

    def validate(self) -> None:
        require_int_at_least("T5BiasConfig", "num_buckets", self.num_buckets, 2)
        require_int_at_least("T5BiasConfig", "max_distance", self.max_distance, 1)
        require_bool("T5BiasConfig", "shared_across_layers", self.shared_across_layers)

    @property
    def layer_shared(self) -> bool:
        return self.shared_across_layers

    def resolve(self, spec: ModelSpec) -> T5BiasConfig:
        # With bidirectional buckets each direction gets num_buckets // 2; its exact half must be >= 1.
        per_direction = self.num_buckets if spec.is_causal else self.num_buckets // 2
        if per_direction // 2 < 1:
            raise InvalidConfigError(
                f"T5BiasConfig.num_buckets={self.num_buckets} leaves no exact bucket for a bidirectional model; "
                "use num_buckets >= 4."
            )
        if self.max_distance <= per_direction // 2:
            raise InvalidConfigError(
                f"T5BiasConfig.max_distance={self.max_distance} must exceed the {per_direction // 2} exact buckets "
                f"(num_buckets={self.num_buckets}); raise max_distance or lower num_buckets."
            )
        return super().resolve(spec)  # type: ignore[return-value]

    def build(self, spec: ModelSpec) -> T5RelativeBias:
        module = T5RelativeBias(
            spec.num_heads, spec.num_layers, self.num_buckets, self.max_distance, self.shared_across_layers
        )
        return module.to(device=spec.device, dtype=spec.dtype)
