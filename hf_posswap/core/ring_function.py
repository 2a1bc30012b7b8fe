"""The ring attention as one autograd function: a forward that keeps only its inputs, output and log-sum-exp, and a
ring backward (keys, values and their gradients travel the ring once more), so a rank never holds more than one key
block's logits (per query chunk) in either pass.

Backward of softmax attention from the global log-sum-exp (Dao et al. 2022, "FlashAttention", arXiv:2205.14135,
Algorithm 4): with P = exp(S - lse) per block, dP = dO V^T, D = rowsum(dO * O), dS = P * (dP - D); then dQ += dS K,
dK += dS^T Q, dV += P^T dO (times the softmax scale for Q and K), and a bias scheme's parameters get dS through the
block's bias, recomputed under autograd. Self-Extend's blocks split dS between the neighbour and the grouped logits.
The gradients of a key block travel with it and reach its owner after one more step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..schemes.two_pass import TwoPassSettings
from .ring_math import KeyBlock, QueryBlock, block_logits, block_mask, block_partial, two_pass_choice


@dataclass
class RingPlan:
    """What the ring needs besides tensors: the shards, the scheme's block bias and the call's settings."""

    shard: Any  # RingShard
    #: (global rank) -> (index positions [n], scheme positions [n] or [B, n], real keys [B, n] or None)
    block_positions: Callable[[int], tuple]
    #: (query rows, key block) -> bias [1 or B, H, c, n] or None
    bias_of: Callable[[QueryBlock, KeyBlock], torch.Tensor | None]
    bias_parameters: tuple[torch.Tensor, ...]
    scale: float
    settings: TwoPassSettings | None
    causal: bool
    row_end: torch.Tensor | None
    key_dim: int
    chunk: int  # query rows per chunk
    index: torch.Tensor  # this rank's global index positions [q]
    positions: torch.Tensor  # this rank's scheme positions [q] or [B, q]
    has_bias: bool = False
    #: blocks run through the CPU flash kernel (:func:`fused_applies`), else as matmuls
    fused: bool = False


def exchange(tensor: torch.Tensor, shard: Any, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Send ``tensor`` to rank + step, receive a ``shape`` tensor from rank - step (both posted at once)."""
    world, rank = shard.world, shard.rank
    to = dist.get_global_rank(shard.group, (rank + step) % world)
    source = dist.get_global_rank(shard.group, (rank - step) % world)
    received = tensor.new_empty(shape)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), to, shard.group),
           dist.P2POp(dist.irecv, received, source, shard.group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def _unpack(packed: torch.Tensor, plan: RingPlan, source: int) -> KeyBlock:
    """packed [B, Hkv, n, D (+ D) + Dv] -> the key block of rank ``source``."""
    dim = plan.key_dim
    keys, rest = packed[..., :dim], packed[..., dim:]
    far_keys = None
    if plan.settings is not None:
        far_keys, rest = rest[..., :dim], rest[..., dim:]
    index, positions, valid = plan.block_positions(source)
    return KeyBlock(keys, far_keys, rest, index, positions, valid)


def _shifted(packed: torch.Tensor, plan: RingPlan, source: int) -> torch.Tensor:
    """The next block round the ring: ``source``'s, received from the previous rank."""
    return exchange(packed, plan.shard, +1, (*packed.shape[:2], plan.shard.lengths[source], packed.shape[-1]))


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, c, m] -> [B, Hkv, g c, m] (query heads of one key head stacked)."""
    batch, heads, rows, last = x.shape
    return x.reshape(batch, kv_heads, (heads // kv_heads) * rows, last)


class RingAttention(torch.autograd.Function):
    """(q [B, H, q, D], far q or None, packed own keys/values [B, Hkv, q, .], plan, *bias parameters) -> output
    [B, H, q, Dv] float32 over the whole split sequence."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, far_query: torch.Tensor | None, packed: torch.Tensor,
                plan: RingPlan, *parameters: torch.Tensor) -> torch.Tensor:
        queries = QueryBlock(query, far_query, plan.index, plan.positions)
        output = lse = None
        travelling = packed
        for step, source in _steps(plan):
            if step:
                travelling = _shifted(travelling, plan, source)
            if plan.causal and source > plan.shard.rank:  # wholly in the future
                continue
            block = _unpack(travelling, plan, source)
            forward_block = _fused_forward_block if plan.fused else _forward_block
            block_output, block_lse = forward_block(queries, block, plan, source)
            output, lse = _merge(output, lse, block_output, block_lse)
        ctx.save_for_backward(query, far_query, packed, output, lse)
        ctx.plan = plan
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        query, far_query, packed, output, lse = ctx.saved_tensors
        plan: RingPlan = ctx.plan
        grad_output = grad_output.float()
        delta = (grad_output * output).sum(-1)  # [B, H, q]
        queries = QueryBlock(query, far_query, plan.index, plan.positions)
        grads = _Grads(query, far_query, plan.bias_parameters)
        travelling, travelling_grad = packed, torch.zeros_like(packed, dtype=torch.float32)
        for step, source in _steps(plan):
            if step:
                travelling = _shifted(travelling, plan, source)
                travelling_grad = _shifted(travelling_grad, plan, source)
            if plan.causal and source > plan.shard.rank:
                continue
            block = _unpack(travelling, plan, source)
            if plan.fused:
                block_grad = _fused_backward_block(queries, block, plan, source, grad_output, output, lse, grads)
            else:
                block_grad = _backward_block(queries, block, plan, grad_output, lse, delta, grads)
            travelling_grad = travelling_grad + block_grad
        if plan.shard.world > 1:  # the last block's gradients go home: its owner is the next rank
            travelling_grad = exchange(travelling_grad, plan.shard, +1, packed.shape)
        return (grads.query.to(query.dtype), None if far_query is None else grads.far_query.to(far_query.dtype),
                travelling_grad.to(packed.dtype), None, *grads.parameters)


def _steps(plan: RingPlan) -> list[tuple[int, int]]:
    """(step, rank whose keys this rank holds at that step)."""
    return [(step, (plan.shard.rank - step) % plan.shard.world) for step in range(plan.shard.world)]


def _merge(output: torch.Tensor | None, lse: torch.Tensor | None, block_output: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Running log-sum-exp merge of (output [B, H, q, Dv], lse [B, H, q]) with one more block's."""
    if output is None:
        return block_output, block_lse
    merged = torch.logaddexp(lse, block_lse)
    output = output * torch.exp(lse - merged)[..., None] + block_output * torch.exp(block_lse - merged)[..., None]
    return output, merged


def _chunks(plan: RingPlan, q_len: int) -> list[slice]:
    return [slice(start, min(start + plan.chunk, q_len)) for start in range(0, q_len, plan.chunk)]


def _forward_block(queries: QueryBlock, block: KeyBlock, plan: RingPlan, source: int) -> tuple[torch.Tensor, ...]:
    """(output [B, H, q, Dv], lse [B, H, q]) of this rank's queries against one key block, by query chunks."""
    outputs, lses = [], []
    for rows in _chunks(plan, queries.queries.shape[2]):
        chunk = queries.rows(rows)
        logits = block_logits(chunk, block, plan.scale, plan.bias_of(chunk, block), plan.settings, plan.causal,
                              plan.row_end)
        output, lse = block_partial(logits, block_mask(chunk.index, block, plan.causal), block.values)
        outputs.append(output)
        lses.append(lse)
    return torch.cat(outputs, dim=2), torch.cat(lses, dim=2)


class _Grads:
    """Gradients accumulated over the blocks: queries (exact and grouped), bias parameters."""

    def __init__(self, query: torch.Tensor, far_query: torch.Tensor | None, parameters: tuple) -> None:
        self.query = torch.zeros_like(query, dtype=torch.float32)
        self.far_query = None if far_query is None else torch.zeros_like(far_query, dtype=torch.float32)
        self.parameters = [torch.zeros_like(p) for p in parameters]

    def add_bias(self, bias: torch.Tensor | None, grad: torch.Tensor, parameters: tuple) -> None:
        """Push dS [B, H, c, n] through a bias [1 or B, H, c, n] recomputed under autograd."""
        if bias is None or not parameters or not bias.requires_grad:
            return
        if bias.shape[0] == 1 and grad.shape[0] != 1:
            grad = grad.sum(0, keepdim=True)
        found = torch.autograd.grad(bias, parameters, grad.to(bias.dtype), allow_unused=True)
        for total, part in zip(self.parameters, found, strict=True):
            if part is not None:
                total.add_(part)


def _backward_block(queries: QueryBlock, block: KeyBlock, plan: RingPlan, grad_output: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, grads: _Grads) -> torch.Tensor:
    """This rank's contribution to one key block's gradients, packed like the block [B, Hkv, n, .] float32; adds
    the queries' and the bias parameters' gradients to ``grads``."""
    kv_heads = block.keys.shape[1]
    grad_keys = torch.zeros_like(block.keys, dtype=torch.float32)
    grad_far = None if block.far_keys is None else torch.zeros_like(block.far_keys, dtype=torch.float32)
    grad_values = torch.zeros_like(block.values, dtype=torch.float32)
    for rows in _chunks(plan, queries.queries.shape[2]):
        chunk = queries.rows(rows)
        with torch.enable_grad():
            bias = plan.bias_of(chunk, block)
        logits = block_logits(chunk, block, plan.scale, None if bias is None else bias.detach(), plan.settings,
                              plan.causal, plan.row_end).float()
        allowed = block_mask(chunk.index, block, plan.causal)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, torch.finfo(torch.float32).min)
        probs = torch.exp(logits - lse[:, :, rows, None])  # [B, H, c, n]
        grad_chunk = grad_output[:, :, rows]  # [B, H, c, Dv]
        grad_probs = torch.matmul(_grouped(grad_chunk, kv_heads), block.values.float().transpose(2, 3))
        grad_logits = probs * (grad_probs.view_as(probs) - delta[:, :, rows, None])  # dS [B, H, c, n]
        if allowed is not None:
            grad_logits = grad_logits.masked_fill(~allowed, 0.0)
        grads.add_bias(bias, grad_logits, plan.bias_parameters)
        grad_values += torch.matmul(_grouped(probs, kv_heads).transpose(2, 3), _grouped(grad_chunk, kv_heads))
        near, far = grad_logits, None
        if plan.settings is not None:
            choice = two_pass_choice(plan.settings, chunk.positions, block.positions, plan.causal, plan.row_end)
            near, far = grad_logits.masked_fill(choice, 0.0), grad_logits.masked_fill(~choice, 0.0)
            _qk_grads(far, chunk.far_queries, block.far_keys, plan.scale, grads.far_query, rows, grad_far)
        _qk_grads(near, chunk.queries, block.keys, plan.scale, grads.query, rows, grad_keys)
    parts = [grad_keys] + ([grad_far] if grad_far is not None else []) + [grad_values]
    return torch.cat(parts, dim=-1)


def _qk_grads(grad_logits: torch.Tensor, query: torch.Tensor, keys: torch.Tensor, scale: float,
              grad_query: torch.Tensor, rows: slice, grad_keys: torch.Tensor) -> None:
    """dQ[rows] += scale dS K and dK += scale dS^T Q for logits = scale Q K^T (grouped-query heads)."""
    kv_heads = keys.shape[1]
    stacked = _grouped(grad_logits, kv_heads)  # [B, Hkv, g c, n]
    grad_query[:, :, rows] += torch.matmul(stacked, keys.float()).view_as(query).mul(scale)
    grad_keys += torch.matmul(stacked.transpose(2, 3), _grouped(query.float(), kv_heads)).mul(scale)


#: the CPU flash kernel, which returns the log-sum-exp, and its backward, which takes the global output and
#: log-sum-exp (so each block's dQ, dK, dV are exact parts of the whole sequence's)
_FLASH = "_scaled_dot_product_flash_attention_for_cpu"
FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def fused_applies(query: torch.Tensor, settings: TwoPassSettings | None, parameters: tuple) -> bool:
    """Blocks take the CPU flash kernel where it gives every gradient needed: a CPU tensor of a dtype it takes, one
    logit per pair (no Self-Extend), and no bias parameter that needs a gradient (the kernel returns none for the
    additive mask), e.g. RoPE, xPos, NoPE, ALiBi's fixed slopes, any bias scheme under no_grad."""
    if query.device.type != "cpu" or query.dtype not in FUSED_DTYPES or settings is not None:
        return False
    if not hasattr(torch.ops.aten, _FLASH):
        return False
    return not (torch.is_grad_enabled() and any(p.requires_grad for p in parameters))


def _fused_calls(queries: QueryBlock, block: KeyBlock, plan: RingPlan, source: int) -> list[tuple]:
    """(query rows, additive mask or None, is_causal) of the kernel calls for one block: the whole block when no
    mask is needed (keys all in the past, or the diagonal block as ``is_causal``), else query chunks with the bias and
    the mask merged into one additive mask [1 or B, 1 or H, c, n] (lowest finite value where hidden, as the dense
    path)."""
    q_len, dtype = queries.queries.shape[2], queries.queries.dtype
    if not plan.has_bias and block.valid is None:
        return [(slice(0, q_len), None, plan.causal and source == plan.shard.rank)]
    calls = []
    for rows in _chunks(plan, q_len):
        chunk = queries.rows(rows)
        bias = plan.bias_of(chunk, block)
        shape = (1, 1, rows.stop - rows.start, block.keys.shape[2])
        mask = torch.zeros(shape, dtype=dtype) if bias is None else bias.detach().to(dtype)
        allowed = block_mask(chunk.index, block, plan.causal)
        if allowed is not None:
            mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
        calls.append((rows, mask, False))
    return calls


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, n, D] -> [B, H, n, D]: query head h reads key head h // (H / Hkv)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def _fused_forward_block(queries: QueryBlock, block: KeyBlock, plan: RingPlan, source: int) -> tuple[torch.Tensor, ...]:
    """(output [B, H, q, Dv] float32, lse [B, H, q]) of one block through the CPU flash kernel."""
    heads = queries.queries.shape[1]
    keys, values = _repeat(block.keys, heads), _repeat(block.values, heads)
    flash = getattr(torch.ops.aten, _FLASH)
    outputs, lses = [], []
    for rows, mask, causal in _fused_calls(queries, block, plan, source):
        output, lse = flash(queries.queries[:, :, rows], keys, values, 0.0, causal, attn_mask=mask, scale=plan.scale)
        outputs.append(output.float())
        lses.append(lse.float())
    return torch.cat(outputs, dim=2), torch.cat(lses, dim=2)


def _fused_backward_block(queries: QueryBlock, block: KeyBlock, plan: RingPlan, source: int,
                          grad_output: torch.Tensor, output: torch.Tensor, lse: torch.Tensor,
                          grads: _Grads) -> torch.Tensor:
    """One block's dK, dV (packed [B, Hkv, n, D + Dv] float32) and its part of dQ (into ``grads``), by the kernel's
    backward from the global output and log-sum-exp."""
    batch, heads = queries.queries.shape[:2]
    kv_heads, dtype = block.keys.shape[1], queries.queries.dtype
    keys, values = _repeat(block.keys, heads), _repeat(block.values, heads)
    backward = getattr(torch.ops.aten, _FLASH + "_backward")
    grad_keys = torch.zeros(keys.shape, dtype=torch.float32)
    grad_values = torch.zeros(values.shape, dtype=torch.float32)
    for rows, mask, causal in _fused_calls(queries, block, plan, source):
        grad_query, grad_key, grad_value = backward(
            grad_output[:, :, rows].to(dtype).contiguous(), queries.queries[:, :, rows], keys, values,
            output[:, :, rows].to(dtype).contiguous(), lse[:, :, rows].contiguous(), 0.0, causal, attn_mask=mask,
            scale=plan.scale,
        )
        grads.query[:, :, rows] += grad_query.float()
        grad_keys += grad_key.float()
        grad_values += grad_value.float()
    fold = (batch, kv_heads, heads // kv_heads)  # [B, H, n, D] -> [B, Hkv, n, D]: sum the heads of one key head
    grad_keys = grad_keys.view(*fold, *grad_keys.shape[2:]).sum(2)
    grad_values = grad_values.view(*fold, *grad_values.shape[2:]).sum(2)
    return torch.cat((grad_keys, grad_values), dim=-1)
