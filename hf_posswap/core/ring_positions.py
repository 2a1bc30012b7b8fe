"""The global positions of one shard under context parallelism (:mod:`.context_parallel`), and the scheme's
per-token part applied from them before the keys travel the ring.

A shard's tokens have a global index (the lengths of the shards before it + their place in it), which orders them
for causality, and scheme positions, which the scheme sees: the ``position_ids`` the ranks passed (gathered for the
whole sequence, once per forward, so a key block's positions are known wherever it travels), else padding-aware
positions where the single-process path counts without padding (Self-Extend, the query temperature), else the index.
Rotary schemes rotate by the scheme positions as one process holding the whole sequence does: its whole length for
length-dependent scalings, and the position at its centre as xPos's reference (Sun et al. 2022, "A
Length-Extrapolatable Transformer", arXiv:2212.10554); Self-Extend groups them (Jin et al. 2024, arXiv:2401.01325).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..schemes.rope import apply_rotary
from .context import PositionContext
from .input_positions import reads_query_positions
from .ring_math import KeyBlock, QueryBlock
from .rotary_cache import angles, rotate, scales_keys
from .self_extend import far_positions


def key_block_positions(context: PositionContext, shard: Any, rank: int, device: torch.device) -> tuple:
    """(index positions [n], scheme positions [n] or [B, n], real-token mask [B, n] or None) of ``rank``'s shard.
    Scheme positions: the position ids the ranks passed, else (Self-Extend, temperature) padding-aware ones in a
    padded batch, else the index."""
    index = shard.index(rank, device)
    if shard.explicit is not None:
        positions = shard.piece(shard.explicit, rank)
    else:
        positions = shard.piece(shard.padded, rank) if _uses_padded(context, shard) else index
    return index, positions, shard.piece(shard.valid, rank)


def _uses_padded(context: PositionContext, shard: Any) -> bool:
    """Self-Extend, the query temperature and a bias that reads the query's absolute position (FIRE) count
    positions without padding (as the single-process paths do)."""
    return shard.padded is not None and (context.two_pass is not None or context.kind == "temperature"
                                         or reads_query_positions(context.positions))


def row_end(shard: Any, device: torch.device) -> torch.Tensor:
    """Each row's last scheme position [1 or B] (Self-Extend's bidirectional rule): of its real tokens."""
    if shard.explicit is not None:
        real = shard.explicit if shard.valid is None else shard.explicit.masked_fill(~shard.valid, -1)
        return real.amax(-1)
    if shard.padded is not None:
        return shard.padded.amax(-1)
    return torch.tensor([shard.total - 1], device=device)


def local_blocks(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context: PositionContext, shard: Any
) -> tuple[QueryBlock, KeyBlock]:
    """This rank's queries and keys with the scheme's per-token part applied (rotations, temperature) from global
    positions."""
    device = query.device
    index, positions, valid = key_block_positions(context, shard, shard.rank, device)
    far_query = far_key = None
    kind = context.kind
    if context.two_pass is not None:
        settings = context.two_pass
        rotary = context.positions
        shift = settings.window - far_positions(settings.window, settings)
        far_query = _apply(query, rotary(far_positions(positions, settings) + shift))
        far_key = _apply(key, rotary(far_positions(positions, settings)))
        query, key = _apply(query, rotary(positions)), _apply(key, rotary(positions))
    elif kind == "rotary":
        query, key = _rotate_global(query, key, context, shard)
    elif kind == "head_mix":
        scheme = context.positions
        rotary = dataclasses.replace(context, positions=scheme.rotary, kind="rotary")
        rotated_query, rotated_key = _rotate_global(query, key, rotary, shard)
        heads, kv_heads = scheme.rotary_heads(device)  # [H], [Hkv]
        query = torch.where(heads[:, None, None], rotated_query, query)
        key = torch.where(kv_heads[:, None, None], rotated_key, key)
    elif kind == "temperature":
        scales = context.positions(positions)  # [q] or [B, q]
        scales = scales[None, None, :, None] if scales.dim() == 1 else scales[:, None, :, None]
        query = (query * scales).to(query.dtype)
    return QueryBlock(query, far_query, index, positions), KeyBlock(key, far_key, value, index, positions, valid)


def _apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return apply_rotary(x, *cos_sin)


def _rotate_global(
    query: torch.Tensor, key: torch.Tensor, context: PositionContext, shard: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k of this shard rotated by global positions, with the whole sequence's length (length-dependent
    scalings) and its centre as xPos's reference, as one process holding the sequence rotates them."""
    if shard.explicit is not None:
        rotated_query = rotate(query, *_explicit_angles(context, shard, False), context)
        return rotated_query, rotate(key, *_explicit_angles(context, shard, True), context)
    start, length, total = shard.starts[shard.rank], query.shape[2], shard.total
    reference = total // 2
    cos, sin = angles(context, start, length, total, query.device, reference)
    rotated_query = rotate(query, cos, sin, context)
    return rotated_query, rotate(key, *angles(context, start, length, total, key.device, reference, True), context)


def _explicit_angles(context: PositionContext, shard: Any, keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, n, r] of this shard's given position ids, once per forward: the whole sequence's length for
    length-dependent scalings, and xPos's factors (``keys`` or queries) counted from each row's position at the
    sequence's centre [B, 1], as one process given the whole position ids rotates them."""
    scheme = context.positions
    scaled = scales_keys(scheme)
    keys = keys and scaled
    memo_key = ("ring-explicit-angles", id(scheme), keys, torch.is_grad_enabled())
    found = context.memo.get(memo_key)
    if found is None:
        rows = shard.piece(shard.explicit, shard.rank)  # [B, n]
        if scaled:
            middle = shard.total // 2
            found = scheme(rows, shard.total, keys=keys, reference=shard.explicit[:, middle : middle + 1])
        else:
            found = scheme(rows, shard.total)
        context.memo[memo_key] = found
    return found
