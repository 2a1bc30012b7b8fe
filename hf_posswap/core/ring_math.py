"""The per-block algebra of ring attention, with no communication (so one process can test it).

A rank's queries attend to every key shard in turn; each (query shard, key shard) pair gives a partial output and
the log-sum-exp of its logits, and the partials merge exactly:

    lse = logsumexp_b(lse_b),  out = sum_b exp(lse_b - lse) * out_b

(Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", arXiv:1805.02867; Liu et al. 2023, "Ring
Attention with Blockwise Transformers", arXiv:2310.01889). The same merge joins the two passes of the fused
Self-Extend path (:mod:`hf_posswap.core.two_pass_fused`) and the fused T5 path.

The logits of one block carry the position scheme from GLOBAL positions (the position ids the ranks passed, else the
global index; :mod:`.ring_positions`): rotary schemes rotate by them (done once per shard, before the keys travel),
bias schemes add ``BiasPositions.forward(query_pos, key_pos, ...)`` of the block's positions, Self-Extend picks the
neighbour or grouped logit by the distance of those positions, and causality compares global indices (token order,
never position values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..schemes.two_pass import TwoPassSettings


@dataclass
class KeyBlock:
    """One shard's keys as they travel the ring: keys rotated by exact positions, keys rotated by grouped positions
    (Self-Extend only), values, each [B, Hkv, n, D]; the shard's global index positions [n], its positions for the
    scheme ([n], or per row [B, n]: given position ids, or a padded Self-Extend batch) and which keys are real tokens
    ([B, n] or None)."""

    keys: torch.Tensor
    far_keys: torch.Tensor | None
    values: torch.Tensor
    index: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None


@dataclass
class QueryBlock:
    """This rank's queries [B, H, q, D] (rotated by exact positions) and, for Self-Extend, by grouped positions; their
    global index positions [q] and their scheme positions ([q] or [B, q])."""

    queries: torch.Tensor
    far_queries: torch.Tensor | None
    index: torch.Tensor
    positions: torch.Tensor

    def rows(self, rows: slice) -> QueryBlock:
        """The queries of ``rows`` (a chunk of the shard)."""
        far = None if self.far_queries is None else self.far_queries[:, :, rows]
        return QueryBlock(self.queries[:, :, rows], far, self.index[rows], self.positions[..., rows])


def grouped_logits(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [B, H, q, D] · k [B, Hkv, n, D] -> logits [B, H, q, n] (grouped-query heads without repeating keys)."""
    batch, heads, rows, dim = query.shape
    kv_heads = keys.shape[1]
    stacked = query.reshape(batch, kv_heads, (heads // kv_heads) * rows, dim)
    return torch.matmul(stacked, keys.transpose(2, 3)).mul(scaling).view(batch, heads, rows, -1)


def two_pass_choice(
    settings: TwoPassSettings, query_pos: torch.Tensor, key_pos: torch.Tensor, causal: bool, row_end: torch.Tensor
) -> torch.Tensor:
    """Which (query, key) pairs take Self-Extend's grouped logit, [1 or B, 1, q, n] bool, from scheme positions
    ([q] / [n] or per row): the rule of :func:`hf_posswap.core.self_extend._grouped_pairs`. ``row_end``: each row's
    last position ([1 or B]), for the bidirectional rule (a row no longer than ``start`` groups nothing)."""
    query_rows = query_pos if query_pos.dim() == 2 else query_pos[None]  # [1 or B, q]
    key_rows = key_pos if key_pos.dim() == 2 else key_pos[None]  # [1 or B, n]
    distance = (query_rows[:, :, None] - key_rows[:, None, :])[:, None]  # [1 or B, 1, q, n]
    if causal:
        return (distance >= settings.window) & (query_rows >= settings.start)[:, None, :, None]
    return (distance.abs() >= settings.window) & (row_end >= settings.start)[:, None, None, None]


def block_mask(query_index: torch.Tensor, block: KeyBlock, causal: bool) -> torch.Tensor | None:
    """Keys each query may see, [1 or B, 1, q, n] bool: at or before it (causal, by global index) and not padding;
    None when every key is visible."""
    allowed = None
    if causal:
        allowed = (block.index[None, :] <= query_index[:, None])[None, None]  # [1, 1, q, n]
    if block.valid is not None:
        valid = block.valid[:, None, None, :]  # [B, 1, 1, n]
        allowed = valid if allowed is None else allowed & valid
    return allowed


def block_partial(logits: torch.Tensor, allowed: torch.Tensor | None, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One block's partial attention: (output [B, H, q, Dv], lse [B, H, q]), both float32, from logits [B, H, q, n].

    Hidden keys get float32's lowest finite value, as the dense path's merged mask does, so a row that sees nothing
    in this block gets an lse far below any visible row's and weight 0 in :func:`merge_partials`, and a row that sees
    nothing anywhere averages its values uniformly, as a softmax over an all-lowest row does."""
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, torch.finfo(torch.float32).min)
    lse = torch.logsumexp(logits, dim=-1)  # [B, H, q]
    probs = torch.exp(logits - lse[..., None])
    batch, heads, rows, keys = probs.shape
    kv_heads = values.shape[1]
    stacked = probs.reshape(batch, kv_heads, (heads // kv_heads) * rows, keys)
    output = torch.matmul(stacked, values.float()).view(batch, heads, rows, -1)  # [B, H, q, Dv]
    return output, lse


def merge_partials(partials: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Exact merge of block partials (output [B, H, q, Dv], lse [B, H, q]) -> output [B, H, q, Dv] float32."""
    lses = torch.stack([lse for _, lse in partials])  # [blocks, B, H, q]
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total)[..., None]  # [blocks, B, H, q, 1]
    return sum(weight * output for weight, (output, _) in zip(weights, partials, strict=True))


def block_logits(
    query: QueryBlock,
    block: KeyBlock,
    scaling: float,
    bias: torch.Tensor | None,
    settings: TwoPassSettings | None,
    causal: bool,
    row_end: torch.Tensor | None,
) -> torch.Tensor:
    """Logits [B, H, q, n] of one (query shard, key shard) pair: exact (and, with Self-Extend ``settings``, grouped
    where :func:`two_pass_choice` says) plus the block's ``bias`` [1 or B, H, q, n] of a bias scheme."""
    logits = grouped_logits(query.queries, block.keys, scaling)
    if settings is not None:
        choice = two_pass_choice(settings, query.positions, block.positions, causal, row_end)
        if bool(choice.any()):
            far = grouped_logits(query.far_queries, block.far_keys, scaling)
            logits = torch.where(choice, far, logits)
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    return logits
