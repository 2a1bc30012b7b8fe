"""Bias rows kept across decoding steps, for biases that depend on the relative position (key - query) only.

A decoding step's bias is one row per head: the bias of relative positions first .. first + kv - 1. For ALiBi and
T5 that row is a slice of one row over every relative position, so instead of computing it again every step (a
handful of small tensor ops, each 25-85 µs on a CPU whose caches the KV cache's copy has just flushed) the scheme
keeps the row and hands each step a copy of the slice (:func:`row_copy`): one op.

The row is rebuilt when it is too short, or when the tensor it is computed from changes: replaced, or changed in
place (an optimiser step bumps its version counter); a source made under ``torch.inference_mode`` has no version
counter, so its row is built each time instead. It is made without gradient: callers take it only where no
gradient reaches the bias.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

#: relative positions a new row covers at least on each side (it doubles when a longer one is needed)
MIN_SPAN = 1024


def _stamp(source: torch.Tensor | None, device: torch.device) -> tuple:
    """What identifies ``source``'s current values (the tensor, its storage, its version, its dtype) and the device."""
    if source is None:
        return (device,)
    return id(source), source.data_ptr(), source._version, source.dtype, device


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
    stays the same tensor with the same values (``source`` None: a row that depends on the positions only).
    """
    device = source.device if device is None else device
    if source is not None and source.is_inference():  # no version counter to tell a change by: not kept
        span = max(MIN_SPAN, reach)
        with torch.no_grad():
            return build(torch.arange(-span, span + 1, device=device)), span
    rows = owner.__dict__.setdefault("_kept_rows", {})
    stamp = _stamp(source, device)
    kept = rows.get(name)
    if kept is None or kept[0] != stamp or kept[2] < reach:
        span = max(MIN_SPAN, reach, 2 * kept[2] if kept is not None and kept[0] == stamp else 0)
        relative = torch.arange(-span, span + 1, device=device)
        with torch.no_grad():
            kept = (stamp, build(relative), span)
        rows[name] = kept
    return kept[1], kept[2]


def row_slice(row: torch.Tensor, span: int, first: int, count: int) -> torch.Tensor:
    """The entries of relative positions first .. first + count - 1: a view ``row[..., span + first :][:count]``."""
    return row[..., span + first : span + first + count]


def row_copy(row: torch.Tensor, span: int, first: int, count: int) -> torch.Tensor:
    """:func:`row_slice` copied into a contiguous tensor of its own: callers may write to it (masks are merged in
    place), and sdpa reads a contiguous mask faster than the strided slice (measured 168 vs 182 µs, one query,
    2,048 keys, 8 heads)."""
    return row_slice(row, span, first, count).clone(memory_format=torch.contiguous_format)
