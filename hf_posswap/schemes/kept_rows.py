"""Bias rows kept across decoding steps, for biases that depend on the relative position (key - query) only.

A decoding step's bias is one row per head: the bias of relative positions first .. first + kv - 1. For ALiBi and
T5 that row is a slice of one row over every relative position, so instead of computing it again every step (a
handful of small tensor ops, each 25-85 µs on a CPU whose caches the KV cache's copy has just flushed) the scheme
keeps the row and hands each step a copy of the slice (:func:`row_copy`): one op.

The row is rebuilt when it is too short, moves device, or when the values it is computed from (ALiBi's slopes, a T5
table: [H] or [buckets, H]) differ from a copy kept with it, compared each time they are asked for. It is made
without gradient: callers take it only where no gradient reaches the bias. Under ``torch.compile`` nothing is kept:
the compiled graph computes the row each call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

#: relative positions a new row covers at least on each side (it doubles when a longer one is needed)
MIN_SPAN = 1024


def kept_row(
    owner: nn.Module,
    name: object,
    source: torch.Tensor | None,
    reach: int,
    build: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device | None = None,
) -> tuple[torch.Tensor, int]:
    """(row, span) with ``row[..., span + v]`` the bias at relative position v for every |v| <= span, span >= reach.

    ``build(relative)`` makes the row from the relative positions -span .. span ([2 span + 1] int64, on ``device``,
    default ``source``'s); the row is kept on ``owner`` under ``name`` (outside its state dict) while ``source``
    holds the values it was built from (``source`` None: a row that depends on the positions only). Under
    ``torch.compile`` the row is built afresh for ``reach``, inside the graph: comparing values is data-dependent,
    which would break the graph at every call.
    """
    device = source.device if device is None else device
    if torch.compiler.is_compiling():
        return build(torch.arange(-reach, reach + 1, device=device)), reach
    rows = owner.__dict__.setdefault("_kept_rows", {})
    kept = rows.get(name)
    if kept is None or kept[2] < reach or kept[3] != device or not same_values(kept[0], source):
        previous = kept[2] if kept is not None else 0
        span = max(MIN_SPAN, reach, 2 * previous if previous < reach else previous)  # doubles only to grow
        # a normal tensor even under inference_mode (an inference tensor could not be saved for a later backward)
        with torch.inference_mode(False), torch.no_grad():
            values = None if source is None else source.detach().clone()
            kept = (values, build(torch.arange(-span, span + 1, device=device)), span, device)
        rows[name] = kept
    return kept[1], kept[2]


def same_values(kept: torch.Tensor | None, source: torch.Tensor | None) -> bool:
    """Whether ``source`` still holds the values ``kept`` copied (something built from it is still valid). Compared
    by value, one small op: version counters miss writes through ``.data`` or numpy and fused optimiser steps (fused
    AdamW, transformers' default optimiser, leaves them alone), and a new tensor may reuse a freed one's address."""
    if source is None or kept is None:
        return source is None and kept is None
    same_layout = kept.dtype == source.dtype and kept.shape == source.shape and kept.device == source.device
    return same_layout and torch.equal(kept, source)  # (equal builds no graph: no detach needed)


def row_slice(row: torch.Tensor, span: int, first: int, count: int) -> torch.Tensor:
    """The entries of relative positions first .. first + count - 1: a view ``row[..., span + first :][:count]``."""
    return row[..., span + first : span + first + count]


def row_copy(row: torch.Tensor, span: int, first: int, count: int) -> torch.Tensor:
    """:func:`row_slice` copied into a contiguous tensor of its own: callers may write to it (masks are merged in
    place), and sdpa reads a contiguous mask faster than the strided slice (measured 168 vs 182 µs, one query,
    2,048 keys, 8 heads)."""
    return row_slice(row, span, first, count).clone(memory_format=torch.contiguous_format)
