"""What the caller's inputs say about positions: the ``position_ids`` a caller passed (used by attention for a whole
unpadded sequence, as position-skipping training such as PoSE needs), and the positions of a padded batch's real
tokens, and whether a position module reads absolute query positions at all. Read by the base model's
``forward`` wrapper (:mod:`.context`) before each forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import InvalidConfigError


def explicit_positions(kwargs: dict[str, Any], query_offset: int, cache: Any) -> torch.Tensor | None:
    """Position ids the caller passed for a whole unpadded sequence (no cache): attention then uses them instead
    of token indices, so position-skipping training (PoSE) reaches every scheme. With padding or a cache, index
    distances are used (they equal position distances there; ids that skip positions are refused)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        return None
    if query_offset != 0 or cache is not None:
        _refuse_skips_beside_a_cache(position_ids, kwargs.get("attention_mask"))
        return None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        _check_index_distances(position_ids, mask)
        return None
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2) and _are_the_index(position_ids):
        return None  # a mask of the caller's own (4-D) over plain ids: the index is the same, and keeps every path
    reference = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    batch = reference.shape[0] if reference is not None else position_ids.shape[0]
    return position_ids.expand(batch, -1)


def counted_from_zero(position_ids: torch.Tensor, first_id: int, family: str) -> torch.Tensor:
    """Explicit ids [B, q] of a family that numbers a sequence's first token ``first_id`` (RoBERTa: padding_idx + 1,
    its table's first row for a token; padding at padding_idx), counted from 0 as attention reads them (padding at
    0). Ids below padding_idx are not of that numbering (0-based ids): refused, since the family's own table would
    read them as other rows too."""
    if not first_id:
        return position_ids
    if not torch.compiler.is_compiling() and bool((position_ids < first_id - 1).any()):
        raise InvalidConfigError(
            f"position_ids start at {int(position_ids.min())}, and {family} numbers a sequence's first token "
            f"{first_id} (padding_idx + 1: its position table's rows for tokens start there). Pass position_ids "
            f"+ {first_id}, or leave them out."
        )
    return (position_ids - first_id).clamp(min=0)


def _are_the_index(position_ids: Any) -> bool:
    """Whether every row of ``position_ids`` [B or 1, q] is 0, 1, ..., q - 1. Ids that are not (sequences packed
    into one row beside a block-diagonal 4-D mask, each counting from 0) are the positions a scheme that reads
    absolute ones (FIRE's normaliser, the query temperature, Self-Extend's groups) needs; distances within a
    segment are the same either way. Under ``torch.compile`` (no sync to tell): False, so the ids are used."""
    if not isinstance(position_ids, torch.Tensor):
        return True
    if torch.compiler.is_compiling():
        return False
    index = torch.arange(position_ids.shape[-1], device=position_ids.device)
    return bool((position_ids == index).all())


def _refuse_skips_beside_a_cache(position_ids: Any, mask: Any) -> None:
    """With a KV cache, tokens are placed by their index in it (the cached keys keep no positions of their own):
    ids that skip ahead within the forward would be ignored, so they are refused. With a 2-D mask over the tokens so
    far, only the real tokens are compared with the mask's count of them (``generate``'s ids of a mask with a hole
    are that count); without one, an id may not step past the next, nor back to an id above 1 (padding's ids, 0 or
    1, are the only ones that step back: a left-padded row's first real token, the pads of a right-padded row)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] < 2 or torch.compiler.is_compiling():
        return
    ids = position_ids.reshape(-1, position_ids.shape[-1])  # [B or 1, q]
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] >= ids.shape[-1]:
        real = mask[:, -ids.shape[-1]:].bool()  # [B, q]
        counted = (mask.long().cumsum(-1) - 1)[:, -ids.shape[-1]:]  # [B, q]: the real tokens' order
        offsets = torch.where(real, ids - counted, 0)
        low = torch.where(real, offsets, offsets.new_tensor(torch.iinfo(torch.long).max)).amin(-1)
        skips = (torch.where(real, offsets, low[:, None]) != low[:, None]) & real  # [B, q]
        skips = skips[:, 1:]
    else:  # where the next id skips ahead, or goes back to one that is no padding id (a tree of drafts' ids)
        steps = ids.diff(dim=-1)  # [B or 1, q - 1]
        skips = (steps > 1) | ((steps < 0) & (ids[:, 1:] > 1))
    if not bool(skips.any()):
        return
    row, column = skips.nonzero()[0].tolist()
    raise InvalidConfigError(
        f"position_ids jump from {int(ids[row, column])} to {int(ids[row, column + 1])} (row {row}) in a forward with "
        "a KV cache: with a cache, hf_posswap places tokens by their index in it, so ids that skip or repeat "
        "positions would be ignored. Run the forward without a cache (use_cache=False and no past_key_values) to use "
        "them, or pass consecutive ids."
    )


def _check_index_distances(position_ids: torch.Tensor, mask: torch.Tensor) -> None:
    """A padded batch is placed by index distances (between real tokens, the padding skipped): refuse position ids
    whose distances differ from those (ids that jump, as PoSE's do) instead of silently not using them."""
    real = mask.bool()  # [B, T]
    if position_ids.shape[-1] != real.shape[-1]:
        return
    offsets = position_ids.expand_as(real) - (real.long().cumsum(-1) - 1)  # constant along a row when they agree
    low = torch.where(real, offsets, offsets.new_tensor(torch.iinfo(torch.long).max)).amin(-1)
    high = torch.where(real, offsets, offsets.new_tensor(torch.iinfo(torch.long).min)).amax(-1)
    rows = ((high > low) & real.any(-1)).nonzero().flatten().tolist()
    if rows:
        raise InvalidConfigError(
            f"position_ids of the padded rows {rows[:5]} skip positions (their distances differ from the distances "
            "between the row's real tokens); a padded batch is placed by token distances. Pass position ids that "
            "count the real tokens (attention_mask.cumsum(-1) - 1), or such rows without padding."
        )


def row_shifts(kwargs: dict[str, Any], query_offset: int) -> torch.Tensor | None:
    """Per-row offsets [B] of the tokens' positions from their indices, for a bias that reads the query's absolute
    position (FIRE): minus the row's leading padding, from a 2-D attention mask over the tokens so far; else, from
    position ids [B, q] given with another mask (``generate`` passes them beside the 4-D mask it builds for a static
    cache), the last query's id minus its index, for rows whose ids are exactly their index so shifted (a
    left-padded row, its pads at 0 or 1); other rows (right padding, packed sequences) keep their index. None when
    no row is shifted (or nothing tells)."""
    reference = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if reference is None:
        return None
    q_len = reference.shape[1]
    mask = kwargs.get("attention_mask")
    position_ids = kwargs.get("position_ids")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] == query_offset + q_len:
        shift = -(mask.long().cumsum(-1) == 0).sum(-1)  # [B]: minus the pads before the row's first real token
    elif isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[-1] == q_len:
        ids = position_ids.long()
        shift = ids[:, -1] - (query_offset + q_len - 1)  # [B or 1]
        expected = torch.arange(query_offset, query_offset + q_len, device=ids.device) + shift[:, None]  # [B, q]
        # a row whose ids are not its index shifted (right padding, packed sequences) keeps the index: shift 0
        fits = torch.where(expected >= 0, ids == expected, (ids == 0) | (ids == 1)).all(-1)  # [B]
        shift = torch.where(fits, shift, 0)
    else:
        return None
    if torch.compiler.is_compiling():  # zeros shift nothing; telling them apart would read the tensor (a graph break)
        return shift
    return shift if bool(shift.any()) else None


def padded_positions(mask: Any) -> torch.Tensor | None:
    """Positions [B, T] that skip padding (0 on pads), from a 2D attention mask with padding; else None. Compiled,
    a mask without padding gives its positions too (the token indices, per row): telling it apart would read the
    tensor (a graph break)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    if not torch.compiler.is_compiling() and bool(mask.all()):
        return None
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def check_position_ids(kwargs: dict[str, Any]) -> None:
    """position_ids must have one entry per input token: [B or 1, L]."""
    position_ids = kwargs.get("position_ids")
    reference = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if position_ids is None or reference is None or not isinstance(position_ids, torch.Tensor):
        return
    length = reference.shape[1]
    if position_ids.dim() not in (1, 2) or position_ids.shape[-1] != length:
        raise InvalidConfigError(
            f"position_ids has shape {tuple(position_ids.shape)} but the input has {length} tokens per row; pass "
            f"position_ids of shape [batch, {length}] (or [1, {length}]), or leave them out."
        )


def check_attention_mask(kwargs: dict[str, Any]) -> None:
    """A 4-D attention mask the caller built is bool (True: attend) or float (added to the logits): an integer one
    of 0s and 1s would be added as it is (1 for every visible key, 0 for the hidden ones) and hide nothing."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise InvalidConfigError(
            f"attention_mask is a 4-D {mask.dtype} tensor; a 4-D mask is used as it is given, so it must be bool "
            "(True where a query may attend) or float (0 there, a large negative number elsewhere). Pass "
            "attention_mask.bool() for a mask of 1s and 0s."
        )


#: where :func:`reads_query_positions` keeps its answer on a position module
_READS_QUERY_POSITIONS = "_posswap_reads_query_positions"


def reads_query_positions(positions: nn.Module | None) -> bool:
    """Whether a position module (a scheme, or a mix holding one) has a bias that reads the query's absolute
    position (``BiasPositions.reads_query_positions``: FIRE)."""
    if positions is None:
        return False
    found = positions.__dict__.get(_READS_QUERY_POSITIONS)
    if found is None:  # looked up once per module: the modules a swap installs do not change
        found = any(getattr(module, "reads_query_positions", False) for module in positions.modules())
        positions.__dict__[_READS_QUERY_POSITIONS] = found
    return found
