"""How T5-bias attention splits into far parts and a near band (:mod:`hf_posswap.schemes.fused_t5` runs them).

Past the saturation distance S every key takes T5's last bucket, one bias constant per head: those keys form far
parts (half-open query x key ranges, causal or flipped) that a fused kernel runs without a bias. Keys within S of
the query form the near band, covered by blocks of ``Bq`` queries against windows of ``Bq + span - 1`` keys that
share one ``[block, width]`` table of bucket ids. Only index arithmetic here: no attention is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: queries per band block (the band costs ``(Bq + span - 1) / span`` of its useful work; smaller blocks cost calls)
BAND_BLOCK = 64

BucketFn = Callable[[torch.Tensor], torch.Tensor]


def saturation_distance(bucket_of: BucketFn, max_distance: int, sign: int) -> int:
    """The first distance d >= 0 whose relative position ``sign * d`` falls in the bucket every farther distance
    shares (``sign`` -1: keys before the query, +1: after). T5's buckets never decrease with distance."""
    distances = torch.arange(max_distance + 2)
    buckets = bucket_of(sign * distances)
    return int((buckets == buckets[-1]).nonzero()[0])


@dataclass(frozen=True)
class FarPart:
    """Queries ``rows`` against keys ``keys`` (half-open index ranges) with one bias constant per head (table
    column ``bucket``). ``causal``: query ``r0 + x`` sees key ``k0 + y`` iff ``y <= x`` (sdpa's top-left causal);
    ``flipped``: both ranges run backwards (query ``r1 - 1 - x`` sees key ``k1 - 1 - y`` iff ``y <= x``)."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    causal: bool
    bucket: int
    flipped: bool = False


@dataclass(frozen=True)
class Band:
    """The near band: ``blocks`` blocks of ``block`` queries; block m's window holds keys ``first + m * block``
    to ``first + m * block + width - 1``. ``bucket_ids``/``inside`` [block, width]: each window entry's bucket and
    whether it is near (not masked). ``edges``: (block, columns outside ``[0, kv)``) for blocks that touch them."""

    block: int
    blocks: int
    width: int
    first: int
    bucket_ids: torch.Tensor
    inside: torch.Tensor
    edges: tuple[tuple[int, torch.Tensor], ...]


@dataclass(frozen=True)
class Plan:
    """How one call splits: the band, the far parts, the kv length and the softmax scale."""

    band: Band
    parts: tuple[FarPart, ...]
    kv_len: int
    scale: float


def plan_attention(
    q_len: int,
    kv_len: int,
    delta: int,
    near: tuple[int, int],
    far_buckets: tuple[int, int | None],
    bucket_of: BucketFn,
    scale: float,
    block: int = BAND_BLOCK,
) -> Plan:
    """Split a call whose query i sits at position ``p + i`` and key j at ``p + delta + j``.

    ``near`` = (lo, hi): relative positions (key - query) in [lo, hi] are the band (causal: hi = 0); farther ones
    before the query take bucket ``far_buckets[0]``, after it ``far_buckets[1]`` (None: causal, none after).
    """
    lo, hi = near
    block = max(1, min(block, q_len))
    blocks = -(-q_len // block)
    width = block + hi - lo
    first = lo - delta  # key index of window column 0 in block 0 (relative = j - i + delta)
    cols = torch.arange(width)
    rel = cols[None, :] - torch.arange(block)[:, None] + lo  # [block, width] relative position of each entry
    inside = (rel >= lo) & (rel <= hi)
    edges = []
    for m in range(blocks):
        keys = first + m * block + cols
        outside = (keys < 0) | (keys >= kv_len)
        if bool(outside.any()):
            edges.append((m, outside))
    band = Band(block, blocks, width, first, bucket_of(rel), inside, tuple(edges))
    parts = _far_before(q_len, kv_len, lo - 1 - delta, far_buckets[0])
    if far_buckets[1] is not None and q_len - hi - 1 > 0:  # bidirectional (delta == 0, q_len == kv_len)
        rows = q_len - hi - 1
        parts.append(FarPart((0, rows), (hi + 1, kv_len), True, far_buckets[1], flipped=True))
    return Plan(band, tuple(parts), kv_len, scale)


def _far_before(q_len: int, kv_len: int, shift: int, bucket: int) -> list[FarPart]:
    """Parts for keys j <= i + shift (at or past the saturation distance before the query)."""
    first_row = max(0, -shift)
    if first_row >= q_len:
        return []
    seen = first_row + shift  # keys [0, seen] are far for the first row
    n_keys = min(kv_len, q_len + shift)
    rows = (first_row, q_len)
    if q_len - first_row == 1:
        return [FarPart(rows, (0, n_keys), False, bucket)]
    if seen == 0:
        return [FarPart(rows, (0, n_keys), True, bucket)]
    return [FarPart(rows, (0, seen), False, bucket), FarPart(rows, (seen, n_keys), True, bucket)]
