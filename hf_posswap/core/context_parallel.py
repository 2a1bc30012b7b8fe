"""Context parallelism: one sequence split into contiguous shards across the ranks of a process group, attention
run as a ring (Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889) with the swapped
position scheme applied from global positions.

>>> with hf_posswap.context_parallel(model, group):
...     logits = model(input_ids=my_shard, attention_mask=my_mask_shard).logits  # rank r holds tokens of shard r

Rank r passes its shard (ranks in order hold consecutive pieces of the sequence; shards may differ in length). The
position hook gives the shard its global positions (offset = the lengths of the shards before it), and every
self-attention call runs :func:`ring_attention`: each rank keeps its queries, keys/values travel around the ring,
each (query shard, key shard) pair is attended with the scheme from global positions (:mod:`.ring_math`), blocks
wholly in a causal future are skipped, and the partial outputs merge by log-sum-exp. The sum over ranks of each
rank's loss equals the single-process loss, and its gradients too (all-reduce them as data parallelism does).

Why a ring of its own: ``torch.distributed.tensor.experimental.context_parallel`` shards
``scaled_dot_product_attention`` itself, for calls with no mask beyond ``is_causal`` and no additive bias; a bias
scheme (ALiBi, T5, KERPLE, FIRE, Sandwich) needs the bias of each (query block, key block) pair, computed from that
pair's global positions, and Self-Extend needs two logits per pair, neither of which its sdpa dispatch can express.

Backward (:mod:`.ring_function`): one autograd function per attention call keeps its inputs, output and
log-sum-exp; its backward sends the keys/values round the ring again with their gradients, recomputing each block's
logits (and, under autograd, its bias, for the scheme's parameters), so a rank holds one key block's logits per query
chunk at a time in either pass. Every rank must run every forward and backward (the sends pair up across ranks).
Attention dropout, attention weights and KV caches are refused under context parallelism.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import InvalidConfigError
from ..schemes.rope import apply_rotary
from ..schemes.two_pass import TwoPassSettings
from .context import PositionContext, PositionForward, PositionHook
from .paths import note_path
from .ring_function import RingAttention, RingPlan, fused_applies
from .ring_math import KeyBlock, QueryBlock
from .rotary_cache import angles, rotate
from .self_extend import CHUNK_ELEMENTS, chunk_size, far_positions

#: the paths :mod:`hf_posswap.core.paths` records for a ring attention call: blocks as matmuls, or through the CPU
#: flash kernel (:func:`~hf_posswap.core.ring_function.fused_applies`)
RING = "ring"
RING_FUSED = "ring-fused"
#: scheme kinds the ring applies (others are refused by name)
RING_KINDS = ("rotary", "bias", "head_mix", "temperature", "none", "absolute")


@dataclass
class RingShard:
    """This rank's place in the split sequence, made once per forward by :class:`RingGroup`."""

    group: Any
    rank: int
    world: int
    starts: tuple[int, ...]  # global index of each rank's first token
    lengths: tuple[int, ...]
    #: real tokens of the whole sequence, [B, total] bool (None: no padding)
    valid: torch.Tensor | None
    #: padding-aware positions of the whole sequence, [B, total] (None: no padding)
    padded: torch.Tensor | None

    @property
    def total(self) -> int:
        return self.starts[-1] + self.lengths[-1]

    def index(self, rank: int, device: torch.device) -> torch.Tensor:
        """Global index positions [n] of ``rank``'s shard."""
        return torch.arange(self.starts[rank], self.starts[rank] + self.lengths[rank], device=device)

    def piece(self, whole: torch.Tensor | None, rank: int) -> torch.Tensor | None:
        """``rank``'s columns of a [B, total] tensor."""
        return None if whole is None else whole[:, self.starts[rank] : self.starts[rank] + self.lengths[rank]]

    def attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  context: PositionContext, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        """The carrier's entry point (the carrier holds no import of this module)."""
        if kwargs.get("output_attentions"):
            raise InvalidConfigError("context_parallel returns no attention weights: leave output_attentions off.")
        return ring_attention(module, query, key, value, context, self, scaling, dropout), None


class RingGroup:
    """Set on the position hook by :func:`context_parallel`: turns each forward's local inputs into a
    :class:`RingShard` (one all-gather of the shard lengths, and of the 2-D padding mask when there is one)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group if group is not None else dist.group.WORLD

    def prepare(self, kwargs: dict[str, Any], cache: Any) -> RingShard:
        if cache is not None or kwargs.get("use_cache"):
            raise InvalidConfigError(
                "context_parallel runs without a KV cache: pass use_cache=False (each rank holds one shard of the "
                "sequence; decoding continues on one rank)."
            )
        reference = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        batch, length = reference.shape[:2]
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        lengths = _all_gather_object(length, world, self.group)
        starts = tuple(sum(lengths[:r]) for r in range(world))
        valid = padded = None
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            if mask.dim() != 2:
                raise InvalidConfigError("context_parallel takes a 2-D attention_mask [batch, shard length].")
            pieces = _all_gather_object(mask.detach().cpu(), world, self.group)
            whole = torch.cat(pieces, dim=1).to(reference.device).bool()  # [B, total]
            if not bool(whole.all()):
                valid, padded = whole, (whole.long().cumsum(-1) - 1).clamp(min=0)
        return RingShard(self.group, rank, world, starts, tuple(lengths), valid, padded)


def _all_gather_object(item: Any, world: int, group: Any) -> list[Any]:
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, item, group=group)
    return gathered


@contextlib.contextmanager
def context_parallel(model: nn.Module, group: Any = None) -> Iterator[nn.Module]:
    """Within the block, forwards of ``model`` (swapped by hf_posswap, sdpa or eager carrier) take this rank's shard
    of a sequence split across ``group`` (default: the world) and run attention as a ring over the group."""
    hooks = _position_hooks(model)
    if not hooks:
        raise InvalidConfigError(
            f"{type(model).__name__} has no hf_posswap position hook: it is not swapped, or its swap is native "
            "transformers (RoPE on a LLaMA-like model), whose sdpa attention "
            "torch.distributed.tensor.experimental.context_parallel shards directly."
        )
    ring = RingGroup(group)
    for hook in hooks:
        hook.ring = ring
    try:
        yield model
    finally:
        for hook in hooks:
            hook.ring = None


def _position_hooks(model: nn.Module) -> list[PositionHook]:
    """The position hooks of the swapped base models inside ``model`` (through other libraries' wrappers)."""
    found = []
    for module in model.modules():
        forward = module.__dict__.get("forward")
        while forward is not None and not isinstance(forward, PositionForward):
            forward = getattr(forward, "__wrapped__", None)
        if forward is not None:
            found.append(forward.hook)
    return found


def ring_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context: PositionContext,
    shard: RingShard,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Output [B, q, H, Dv] of self-attention over the whole split sequence for this rank's q [B, H, q, D] and
    k, v [B, Hkv, q, D] (the same shard)."""
    if context.kind not in RING_KINDS:
        raise InvalidConfigError(
            f"context_parallel does not handle position schemes of kind '{context.kind}' (handled: "
            f"{', '.join(RING_KINDS)})."
        )
    if dropout > 0 and module.training:
        raise InvalidConfigError("context_parallel runs attention without dropout: set the attention dropout to 0.")
    causal = bool(getattr(module, "is_causal", True))
    queries, own = _local_blocks(query, key, value, context, shard)
    settings = TwoPassSettings(*context.self_extend) if context.self_extend is not None else None
    scheme = _bias_scheme(context)
    parameters = tuple(p for p in scheme.parameters() if p.requires_grad) if scheme is not None else ()
    plan = RingPlan(
        shard=shard,
        block_positions=lambda rank: _key_block_positions(context, shard, rank, query.device),
        bias_of=lambda rows, block: _block_bias(module, scheme, rows, block, causal),
        bias_parameters=parameters,
        scale=query.shape[-1] ** -0.5 if scaling is None else scaling,
        settings=settings,
        causal=causal,
        row_end=_row_end(shard, query.device) if settings is not None and not causal else None,
        key_dim=key.shape[-1],
        chunk=chunk_size(query.shape[0], query.shape[1], max(shard.lengths), CHUNK_ELEMENTS),
        index=queries.index,
        positions=queries.positions,
        has_bias=scheme is not None,
        fused=fused_applies(query, settings, parameters),
    )
    note_path(RING_FUSED if plan.fused else RING)
    output = RingAttention.apply(queries.queries, queries.far_queries, _pack(own), plan, *plan.bias_parameters)
    return output.to(query.dtype).transpose(1, 2).contiguous()  # [B, H, q, Dv] -> [B, q, H, Dv]


def _key_block_positions(context: PositionContext, shard: RingShard, rank: int, device: torch.device) -> tuple:
    """(index positions [n], scheme positions [n] or [B, n], real-token mask [B, n] or None) of ``rank``'s shard."""
    index = shard.index(rank, device)
    positions = shard.piece(shard.padded, rank) if _uses_padded(context, shard) else index
    return index, positions, shard.piece(shard.valid, rank)


def _uses_padded(context: PositionContext, shard: RingShard) -> bool:
    """Self-Extend and the query temperature count positions without padding (as the single-process paths do)."""
    return shard.padded is not None and (context.self_extend is not None or context.kind == "temperature")


def _row_end(shard: RingShard, device: torch.device) -> torch.Tensor:
    """Each row's last scheme position [1 or B] (Self-Extend's bidirectional rule)."""
    if shard.padded is not None:
        return shard.padded.amax(-1)
    return torch.tensor([shard.total - 1], device=device)


def _local_blocks(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context: PositionContext, shard: RingShard
) -> tuple[QueryBlock, KeyBlock]:
    """This rank's queries and keys with the scheme's per-token part applied (rotations, temperature) from global
    positions."""
    device = query.device
    index, positions, valid = _key_block_positions(context, shard, shard.rank, device)
    far_query = far_key = None
    kind = context.kind
    if context.self_extend is not None:
        settings = TwoPassSettings(*context.self_extend)
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
    query: torch.Tensor, key: torch.Tensor, context: PositionContext, shard: RingShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k of this shard rotated by global positions, with the whole sequence's length (length-dependent
    scalings) and its centre as xPos's reference, as one process holding the sequence rotates them."""
    start, length, total = shard.starts[shard.rank], query.shape[2], shard.total
    reference = total // 2
    cos, sin = angles(context, start, length, total, query.device, reference)
    rotated_query = rotate(query, cos, sin, context)
    return rotated_query, rotate(key, *angles(context, start, length, total, key.device, reference, True), context)


def _bias_scheme(context: PositionContext) -> nn.Module | None:
    """The bias module of a bias scheme, or of a head mix's bias heads; None for other kinds."""
    if context.kind == "bias":
        return context.positions
    if context.kind == "head_mix":
        return context.positions.bias
    return None


def _block_bias(
    module: nn.Module, scheme: nn.Module | None, queries: QueryBlock, block: KeyBlock, causal: bool
) -> torch.Tensor | None:
    """The scheme's bias [1, H, q, n] for the block's global index positions (None without a bias scheme)."""
    if scheme is None:
        return None
    return scheme(queries.index, block.index, getattr(module, "layer_idx", 0) or 0, causal, None)


def _pack(block: KeyBlock) -> torch.Tensor:
    """One tensor [B, Hkv, n, D + (D) + Dv] for the ring (one shift per step keeps every rank's backward in step)."""
    parts = [block.keys] + ([block.far_keys] if block.far_keys is not None else []) + [block.values]
    return torch.cat(parts, dim=-1)
