"""Context parallelism: one sequence split into contiguous shards across the ranks of a process group, attention
run as a ring (Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889) with the swapped
position scheme applied from global positions.

>>> with hf_posswap.context_parallel(model, group):
...     logits = model(input_ids=my_shard, attention_mask=my_mask_shard).logits  # rank r holds tokens of shard r

Rank r passes its shard (ranks in order hold consecutive pieces of the sequence; shards may differ in length). The
position wrapper gives the shard its global positions: the ``position_ids`` of its shard when the ranks pass them (the
slice of the whole sequence's position ids, e.g. PoSE's gapped ones; every rank or none), else offset (the lengths of
the shards before it) + index. Every self-attention call runs :func:`ring_attention`: each rank keeps its queries,
keys/values travel around the ring, each (query shard, key shard) pair is attended with the scheme from the global
positions of both (:mod:`.ring_math`; a key shard's positions are gathered with the shard lengths, once per forward),
and the partial outputs merge by log-sum-exp. Causality goes by token order (global index), never by position value:
blocks wholly in a causal future are skipped, and the causal mask inside a block compares indices. The sum over
ranks of each rank's loss equals the single-process loss, and its gradients too (all-reduce them as data parallelism
does).

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
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import InvalidConfigError
from .context import PositionContext, PositionForward, PositionInputs
from .paths import RING, RING_FUSED, note_path
from .ring_function import RingAttention, RingPlan, fused_applies
from .ring_math import KeyBlock, QueryBlock
from .ring_positions import key_block_positions, local_blocks, row_end
from .self_extend import CHUNK_ELEMENTS, chunk_size
from .state import swap_state

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
    #: the position ids the ranks passed, of the whole sequence, [B, total] (None: none passed)
    explicit: torch.Tensor | None = None
    #: position ids that step by other than 1 with no attention_mask on any rank: a causal transformers model reads
    #: them as packed sequences (:func:`_refuse_packed`)
    packed: bool = False

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
    """Set on the position wrapper by :func:`context_parallel`: turns each forward's local inputs into a
    :class:`RingShard` (one all-gather of the shard lengths, and of the 2-D padding mask when there is one)."""

    def __init__(self, group: Any = None, signature: str = "") -> None:
        self.group = group if group is not None else dist.group.WORLD
        #: this rank's swap (:func:`swap_signature`), compared with every other rank's on each forward
        self.signature = signature

    def prepare(self, kwargs: dict[str, Any], cache: Any) -> RingShard:
        if cache is not None or kwargs.get("use_cache"):
            raise InvalidConfigError(
                "context_parallel runs without a KV cache: pass use_cache=False (each rank holds one shard of the "
                "sequence; decoding continues on one rank)."
            )
        reference = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        batch, length = reference.shape[:2]
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        mask = _local_mask(kwargs.get("attention_mask"))
        position_ids = _local_position_ids(kwargs.get("position_ids"), batch, length)
        gathered = _all_gather_object((length, mask, position_ids, batch, self.signature), world,
                                      self.group)  # one a forward
        lengths = [item[0] for item in gathered]
        _refuse_other_swaps([item[4] for item in gathered])
        _refuse_uneven_shards(lengths, [item[3] for item in gathered])
        starts = tuple(sum(lengths[:r]) for r in range(world))
        valid = padded = None
        if any(item[1] is not None for item in gathered):  # a rank without a mask: all its tokens are real
            pieces = [item[1] if item[1] is not None else torch.ones(batch, item[0], dtype=torch.bool)
                      for item in gathered]
            whole = torch.cat(pieces, dim=1).to(reference.device)  # [B, total]
            if not bool(whole.all()):
                valid, padded = whole, (whole.long().cumsum(-1) - 1).clamp(min=0)
        explicit = _whole_position_ids([item[2] for item in gathered], reference.device)
        masked = any(item[1] is not None for item in gathered)
        packed = explicit is not None and not masked and bool((explicit.diff(dim=-1) != 1).any())
        return RingShard(self.group, rank, world, starts, tuple(lengths), valid, padded, explicit, packed)


def _refuse_uneven_shards(lengths: list[int], batches: list[int]) -> None:
    """Every rank holds its shard of the same rows, at least one token of them (raised alike on every rank, which
    all read the same gathered values, rather than one rank failing inside the model and the others on a lost
    connection)."""
    if len(set(batches)) > 1:
        raise InvalidConfigError(
            f"The ranks of the context-parallel group hold batches of {batches} rows: each rank holds its shard of "
            "the same rows, so pass every rank the same batch."
        )
    if min(lengths) == 0:
        raise InvalidConfigError(
            f"A rank of the context-parallel group holds no token (shard lengths {lengths}): every rank needs at "
            f"least one, so split a sequence of {sum(lengths)} tokens over at most that many ranks."
        )


def swap_signature(model: nn.Module) -> str:
    """What the swaps inside ``model`` are, as one JSON string that ranks can compare: each swapped module's family,
    scheme config and context extension (their trained parameters are the data-parallel checks' business)."""
    swaps = [
        {"module": name, "family": state.family, "scheme": state.config.to_dict(), "extension": state.extension}
        for name, module in model.named_modules()
        if (state := swap_state(module)) is not None
    ]
    return json.dumps(swaps, sort_keys=True, default=str)


def _refuse_other_swaps(signatures: list[str]) -> None:
    """Every rank attends with the same scheme: a rank swapped otherwise would compute its shard's attention with
    other positions than the rest of the ring and give no error (raised alike on every rank)."""
    if len(set(signatures)) <= 1:
        return
    described = "; ".join(f"rank {rank}: {_described_swap(signature)}" for rank, signature in enumerate(signatures))
    raise InvalidConfigError(
        f"The ranks of the context-parallel group hold models swapped differently ({described}): every rank attends "
        "with the same position scheme, so swap (or load) the same model on each rank."
    )


def _described_swap(signature: str) -> str:
    """``alibi (trainable_slopes=False), extended by 'lift' to 4096`` for each swap of a signature."""
    swaps = json.loads(signature) if signature else []
    if not swaps:
        return "no swap"
    described = []
    for swap in swaps:
        options = {key: value for key, value in swap["scheme"].items() if key != "scheme"}
        text = swap["scheme"]["scheme"] + (f" ({', '.join(f'{k}={v!r}' for k, v in options.items())})" if options
                                           else "")
        extension = swap["extension"]
        if extension:
            text += f", extended by {extension.get('method')!r} to {extension.get('max_position_embeddings')}"
        described.append(text)
    return ", ".join(described)


def _local_mask(mask: Any) -> torch.Tensor | None:
    """This rank's 2-D padding mask as bool on the CPU (for the gather), or None."""
    if not isinstance(mask, torch.Tensor):
        return None
    if mask.dim() != 2:
        raise InvalidConfigError("context_parallel takes a 2-D attention_mask [batch, shard length].")
    return mask.detach().cpu().bool()


def _local_position_ids(position_ids: Any, batch: int, length: int) -> torch.Tensor | None:
    """This rank's position ids [B, shard length] on the CPU (for the gather), or None."""
    if position_ids is None:
        return None
    if position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch):
        raise InvalidConfigError(
            f"position_ids has {position_ids.shape[0]} rows for a batch of {batch}: pass [{batch}, {length}] or "
            f"[1, {length}] (this shard's slice of the whole sequence's position ids)."
        )
    return position_ids.detach().expand(batch, length).cpu()


def _whole_position_ids(pieces: list[torch.Tensor | None], device: torch.device) -> torch.Tensor | None:
    """The whole sequence's position ids [B, total] from every rank's shard of them; None when no rank passed any."""
    missing = [rank for rank, piece in enumerate(pieces) if piece is None]
    if len(missing) == len(pieces):
        return None
    if missing:
        given = [rank for rank, piece in enumerate(pieces) if piece is not None]
        raise InvalidConfigError(
            f"position_ids were passed on ranks {given} but not on ranks {missing} of the context-parallel group: "
            "pass every rank the position_ids of its own shard (its slice of the whole sequence's), or none."
        )
    return torch.cat(pieces, dim=1).to(device)  # [B, total]


def _all_gather_object(item: Any, world: int, group: Any) -> list[Any]:
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, item, group=group)
    return gathered


@contextlib.contextmanager
def context_parallel(model: nn.Module, group: Any = None) -> Iterator[nn.Module]:
    """Within the block, forwards of ``model`` (swapped by hf_posswap, sdpa or eager carrier) take this rank's shard
    of a sequence split across ``group`` (default: the world) and run attention as a ring over the group."""
    position_inputs = _position_inputs(model)
    if not position_inputs:
        raise InvalidConfigError(
            f"{type(model).__name__} has no hf_posswap position wrapper: it is not swapped, or its swap is native "
            "transformers (RoPE on a LLaMA-like model), whose sdpa attention "
            "torch.distributed.tensor.experimental.context_parallel shards directly."
        )
    _refuse_attention_left_to_transformers(position_inputs)
    ring = RingGroup(group, swap_signature(model))
    for inputs in position_inputs:
        inputs.ring = ring
    try:
        yield model
    finally:
        for inputs in position_inputs:
            inputs.ring = None


def _refuse_attention_left_to_transformers(position_inputs: list[PositionInputs]) -> None:
    """A scheme with nothing inside attention (absolute vectors, NoPE) leaves attention to transformers' own
    implementation, which no ring replaces: each rank would attend within its own shard only."""
    for inputs in position_inputs:
        if not inputs.feeds_attention:
            raise InvalidConfigError(
                f"context_parallel runs attention as a ring through hf_posswap's attention function, and this model's "
                f"scheme (kind '{inputs.kind}') leaves attention to transformers' own, so each rank would attend "
                "within its own shard only. Use torch.distributed.tensor.experimental.context_parallel for its sdpa "
                "attention (pass every rank the position_ids of its shard), or swap a scheme that works inside "
                "attention."
            )


def _position_inputs(model: nn.Module) -> list[PositionInputs]:
    """The PositionInputs of the swapped base models inside ``model`` (found through other libraries' wrappers)."""
    found = []
    for module in model.modules():
        forward = module.__dict__.get("forward")
        while forward is not None and not isinstance(forward, PositionForward):
            forward = getattr(forward, "__wrapped__", None)
        if forward is not None:
            found.append(forward.inputs)
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
    queries, own, plan = ring_plan(module, query, key, value, context, shard, scaling)
    note_path(RING_FUSED if plan.fused else RING)
    output = RingAttention.apply(queries.queries, queries.far_queries, _pack(own), plan, *plan.bias_parameters)
    return output.to(query.dtype).transpose(1, 2).contiguous()  # [B, H, q, Dv] -> [B, q, H, Dv]


def ring_plan(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context: PositionContext,
    shard: RingShard,
    scaling: float | None,
) -> tuple[QueryBlock, KeyBlock, RingPlan]:
    """This rank's query block, its own key block (before it travels) and the plan of the ring, for q [B, H, q, D]
    and k, v [B, Hkv, q, D] of its shard (no communication)."""
    causal = bool(getattr(module, "is_causal", True))
    _refuse_packed(shard, causal)
    if context.two_pass is not None and shard.total <= context.two_pass.start:
        context = dataclasses.replace(context, two_pass=None)  # too short to group: plain, as in one process
    queries, own = local_blocks(query, key, value, context, shard)
    settings = context.two_pass
    scheme = _bias_scheme(context)
    parameters = tuple(p for p in scheme.parameters() if p.requires_grad) if scheme is not None else ()
    plan = RingPlan(
        shard=shard,
        block_positions=lambda rank: key_block_positions(context, shard, rank, query.device),
        bias_of=lambda rows, block: _block_bias(module, scheme, rows, block, causal),
        bias_parameters=parameters,
        scale=query.shape[-1] ** -0.5 if scaling is None else scaling,
        settings=settings,
        causal=causal,
        row_end=row_end(shard, query.device) if settings is not None and not causal else None,
        key_dim=key.shape[-1],
        chunk=chunk_size(query.shape[0], query.shape[1], max(shard.lengths), CHUNK_ELEMENTS),
        index=queries.index,
        positions=queries.positions,
        has_bias=scheme is not None,
        fused=fused_applies(query, settings, parameters),
    )
    return queries, own, plan


def _refuse_packed(shard: RingShard, causal: bool) -> None:
    """Causal transformers models given position ids that step by other than 1 and no attention_mask read them as
    packed sequences (``masking_utils.find_packed_sequence_indices``: a new sequence at each step, attended alone);
    the ring attends across such steps, so it refuses rather than differ from one process."""
    if causal and shard.packed:
        raise InvalidConfigError(
            "context_parallel got position_ids with gaps or restarts and no attention_mask: one process would read "
            "them as packed sequences (a new sequence at each gap, attending only within itself), which the ring "
            "does not do. For one sequence with gapped positions (PoSE), pass attention_mask (all ones) with them; "
            "for packed sequences, run one sequence per row."
        )


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
    """The scheme's bias [1 or B, H, q, n] from the queries' and the block's global positions (given position ids, or
    the index; None without a bias scheme)."""
    if scheme is None:
        return None
    return scheme(queries.positions, block.positions, getattr(module, "layer_idx", 0) or 0, causal, None)


def _pack(block: KeyBlock) -> torch.Tensor:
    """One tensor [B, Hkv, n, D + (D) + Dv] for the ring (one shift per step keeps every rank's backward in step)."""
    parts = [block.keys] + ([block.far_keys] if block.far_keys is not None else []) + [block.values]
    return torch.cat(parts, dim=-1)
