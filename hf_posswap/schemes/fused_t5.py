"""T5-bias attention without the dense ``[B, H, q, kv]`` bias, exact.

T5's bucketing sends every distance at or past the *saturation distance* S to one last bucket, so past S the bias
is one constant per head (and per direction when bidirectional). Attention then splits exactly into

- far parts: keys at distance >= S. A constant per head does not change their softmax, only their log-sum-exp, so
  sdpa's fused CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``, which returns the log-sum-exp) computes
  them with grouped kv heads unexpanded. Keys after the query (bidirectional) run the same causal kernel on
  reversed sequences.
- a near band: keys within S of the query, computed per block of ``Bq`` queries against a window of
  ``Bq + span - 1`` keys with one small ``[H, Bq, W]`` bias shared by every block.

The split is planned in :mod:`hf_posswap.schemes.fused_t5_plan`. The parts are merged by log-sum-exp. The
backward runs the fused kernel's backward for each far part with the merged output and log-sum-exp (as ring
attention does), differentiates the band by hand, and sums the table gradient per bucket over the band plus the far
constants. Everything here is CPU; the caller
(:meth:`hf_posswap.schemes.t5.T5RelativeBias.fused_attention`) declines other calls.

Dtypes: q, k, v in float32, float64, bfloat16 or float16; the table ``weight`` in the *working dtype* (float32 for
half precision, else q's). Half-precision far parts run the fused kernel in their dtype (float32 logits, softmax and
accumulation inside it; its log-sum-exp is float32); the band, the merge and every gradient sum run in the working
dtype, and the output and q/k/v gradients are rounded to q's dtype once, at the end (the dense path rounds its bias
to the model's dtype too, so this is at least as exact as it; measured in ``tests/schemes/test_fused_bf16.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from .fused_t5_plan import Band, FarPart, Plan

#: band logits computed at once when no gradient is needed (2**22 float32 = 16 MiB)
BAND_CHUNK_ELEMENTS = 1 << 22
#: logit of a masked band entry: finite, so a fully masked (padding) row stays finite; exp() of it is exactly 0
MASKED = -1e30

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# -- layouts: [B, H, q, D] <-> blocks [B, Hkv, n, G*Bq, D]; keys [B, Hkv, kv, D] -> windows [B, Hkv, n, W, D] --


def _to_blocks(x: torch.Tensor, band: Band, kv_heads: int) -> torch.Tensor:
    """Queries [B, H, q, D] -> blocks [B, Hkv, n, G*Bq, D]: n blocks of Bq queries, the G query heads that share a
    key-value head stacked in each block (q padded with zeros to n*Bq)."""
    batch, heads, length, dim = x.shape
    padded = band.blocks * band.block
    if padded != length:
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - length))  # [B, H, n*Bq, D]
    x = x.view(batch, kv_heads, heads // kv_heads, band.blocks, band.block, dim)  # [B, Hkv, G, n, Bq, D]
    x = x.transpose(2, 3)  # [B, Hkv, n, G, Bq, D]
    return x.reshape(batch, kv_heads, band.blocks, -1, dim)  # [B, Hkv, n, G*Bq, D]


def _from_blocks(x: torch.Tensor, band: Band, heads: int, length: int) -> torch.Tensor:
    """Inverse of :func:`_to_blocks`: blocks [B, Hkv, n, G*Bq, D] -> [B, H, q, D] (the padding rows dropped)."""
    batch, kv_heads, blocks, _, dim = x.shape
    x = x.view(batch, kv_heads, blocks, heads // kv_heads, band.block, dim)  # [B, Hkv, n, G, Bq, D]
    x = x.transpose(2, 3)  # [B, Hkv, G, n, Bq, D]
    return x.reshape(batch, heads, blocks * band.block, dim)[:, :, :length]  # [B, H, n*Bq, D] -> [B, H, q, D]


def _windows(x: torch.Tensor, band: Band) -> torch.Tensor:
    """Keys [B, Hkv, kv, D] -> overlapping windows [B, Hkv, n, W, D] (zeros outside the keys)."""
    span = (band.blocks - 1) * band.block + band.width
    left = max(0, -band.first)
    start = max(0, band.first)
    taken = x[:, :, start : start + span - left]
    padded = torch.nn.functional.pad(taken, (0, 0, left, span - left - taken.shape[2]))
    return padded.unfold(2, band.width, band.block).transpose(-1, -2)


def _fold(windows: torch.Tensor, band: Band, kv_len: int) -> torch.Tensor:
    """Adjoint of :func:`_windows`: sum window gradients [B, Hkv, n, W, D] back onto the keys [B, Hkv, kv, D]."""
    batch, kv_heads, blocks, width, dim = windows.shape
    chunks = -(-width // band.block)
    windows = torch.nn.functional.pad(windows, (0, 0, 0, chunks * band.block - width))
    acc = windows.new_zeros(batch, kv_heads, blocks + chunks - 1, band.block, dim)
    for c in range(chunks):
        acc[:, :, c : c + blocks] += windows[:, :, :, c * band.block : (c + 1) * band.block]
    acc = acc.view(batch, kv_heads, -1, dim)
    out = windows.new_zeros(batch, kv_heads, kv_len, dim)
    lo, hi = max(0, band.first), min(kv_len, band.first + acc.shape[2])
    if hi > lo:
        out[:, :, lo:hi] = acc[:, :, lo - band.first : hi - band.first]
    return out


# -- the parts ----------------------------------------------------------------------------------------------------


def _band_logits(
    qb: torch.Tensor, kw: torch.Tensor, bias: torch.Tensor, band: Band, scale: float, first_block: int = 0
) -> torch.Tensor:
    """Scaled band logits [B, Hkv, n, G*Bq, W] with the bias [H, Bq, W] added and keys outside [0, kv) masked;
    ``qb``/``kw`` may hold blocks ``first_block ..`` only (a chunk of the band)."""
    scores = torch.matmul(qb * scale, kw.transpose(-1, -2))  # [B, Hkv, n, G*Bq, D] @ [B, Hkv, n, D, W]
    batch, kv_heads, blocks, rows, width = scores.shape
    heads = bias.shape[0]
    # scores as [B, Hkv, n, G, Bq, W] + bias [H, Bq, W] as [Hkv, 1, G, Bq, W] (the same bias in every block)
    scores.view(batch, kv_heads, blocks, heads // kv_heads, band.block, width).add_(
        bias.view(kv_heads, 1, heads // kv_heads, band.block, width)
    )
    for m, outside in band.edges:
        if first_block <= m < first_block + blocks:
            scores[:, :, m - first_block].masked_fill_(outside, MASKED)
    return scores


def _band_forward(
    qb: torch.Tensor, kw: torch.Tensor, vw: torch.Tensor, bias: torch.Tensor, band: Band, scale: float,
    first_block: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp [B, Hkv, n, G*Bq, 1], output [B, Hkv, n, G*Bq, D], probabilities [.., W]) of the band blocks
    in ``qb`` (windows ``kw``, ``vw``), starting at block ``first_block``."""
    scores = _band_logits(qb, kw, bias, band, scale, first_block)
    # torch.softmax is one fused pass (exp of masked entries by hand takes a slow underflow path on CPU);
    # the largest probability is exp(top - lse), which gives the log-sum-exp to an ulp
    top = scores.amax(-1, keepdim=True)
    probs = torch.softmax(scores, -1)
    del scores
    return top - probs.amax(-1, keepdim=True).log(), torch.matmul(probs, vw), probs


def _band(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, band: Band, scale: float, keep: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The band's (log-sum-exp [B, H, q], output [B, H, q, D], probabilities or None). ``keep``: the backward needs
    the probabilities, computed for every block at once; otherwise blocks run in chunks whose logits hold at most
    :data:`BAND_CHUNK_ELEMENTS` numbers, so inference never holds the whole band's ``[n, G*Bq, W]`` logits (at 8,192
    bidirectional tokens, 8 heads: 76 MiB, twice with the probabilities)."""
    heads, kv_heads, length = q.shape[1], k.shape[1], q.shape[2]
    qb, kw, vw = _to_blocks(q, band, kv_heads), _windows(k, band), _windows(v, band)
    if keep:
        lse, out, probs = _band_forward(qb, kw, vw, bias, band, scale)
    else:
        per_block = qb[:, :, :1].numel() // qb.shape[-1] * band.width  # logits of one block
        step = max(1, BAND_CHUNK_ELEMENTS // per_block)
        lse, out = qb.new_empty(*qb.shape[:-1], 1), torch.empty_like(qb)
        for start in range(0, band.blocks, step):
            chunk = slice(start, start + step)
            lse[:, :, chunk], out[:, :, chunk], _ = _band_forward(
                qb[:, :, chunk], kw[:, :, chunk], vw[:, :, chunk], bias, band, scale, start
            )
        probs = None
    return _from_blocks(lse, band, heads, length)[..., 0], _from_blocks(out, band, heads, length), probs


def _slice(x: torch.Tensor, span: tuple[int, int], flipped: bool) -> torch.Tensor:
    part = x[:, :, span[0] : span[1]]
    return part.flip(2) if flipped else part


def _far_forward(part: FarPart, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple:
    """(output [B, H, rows, D] in q's dtype, log-sum-exp [B, H, rows] as the kernel gives it: float32 for half
    precision) of one far part, without its constant."""
    out, lse = _flash(
        _slice(q, part.rows, part.flipped),
        _slice(k, part.keys, part.flipped),
        _slice(v, part.keys, part.flipped),
        0.0,
        part.causal,
        scale=scale,
    )
    if part.flipped:
        out, lse = out.flip(2), lse.flip(-1)
    return out, lse


class FusedT5Attention(torch.autograd.Function):
    """(q [B, H, q, D], k/v [B, Hkv, kv, D], weight [H, buckets] in the working dtype, plan, keep) -> output
    [B, H, q, D] in q's dtype; ``keep``: a backward will follow (the band's probabilities are kept for it). Runs
    with autocast off, forward and backward: its dtypes are chosen here (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, plan: Plan, keep: bool
    ):
        with torch.autocast(q.device.type, enabled=False):
            out, saved = _fused_forward(q, k, v, weight, plan, keep)
        ctx.plan = plan
        if keep:
            ctx.save_for_backward(q, k, v, weight, *saved)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with torch.autocast(grad.device.type, enabled=False):
            return _fused_backward(ctx, grad)


def _fused_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, plan: Plan, keep: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(output [B, H, q, D] in the working dtype, tensors the backward reads) of :class:`FusedT5Attention`."""
    band, work = plan.band, weight.dtype
    bias = weight[:, band.bucket_ids].masked_fill(~band.inside, MASKED)  # [H, Bq, W]
    near_lse, near_out, probs = _band(q.to(work), k.to(work), v.to(work), bias, band, plan.scale, keep)
    lse = near_lse.clone()  # [B, H, q]; near_out [B, H, q, D]
    far = []
    for part in plan.parts:
        out_p, lse_p = _far_forward(part, q, k, v, plan.scale)
        lse_p = lse_p.to(work) + weight[:, part.bucket, None]
        rows = slice(*part.rows)
        lse[:, :, rows] = torch.logaddexp(lse[:, :, rows], lse_p)
        far.append((out_p, lse_p))
    out = near_out * (near_lse - lse).exp()[..., None]
    for part, (out_p, lse_p) in zip(plan.parts, far, strict=True):
        rows = slice(*part.rows)
        out[:, :, rows] += out_p.to(work) * (lse_p - lse[:, :, rows]).exp()[..., None]
    return out, [out, lse, near_lse, probs, *[t for pair in far for t in pair]] if keep else []


def _fused_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """Gradients (dq, dk, dv in their dtypes, dweight in the working dtype, None, None) of
    :class:`FusedT5Attention`: the far parts through the fused kernel's backward, the band by hand.

    Both use the softmax backward of FlashAttention (Dao et al. 2022, "FlashAttention", Alg. 4 / appendix B.2):
    with delta = rowsum(dO * O), the score gradients are dS = P * (dP - delta), where P is each part's share of the
    *merged* softmax, so the parts' gradients add up to the whole attention's."""
    q, k, v, weight, out, lse, near_lse, probs, *far = ctx.saved_tensors
    plan: Plan = ctx.plan
    work = weight.dtype
    grad_in = grad.contiguous().to(q.dtype)  # the kernel's dtype
    grad = grad_in.to(work)
    delta = (grad * out).sum(-1)  # [B, H, q]
    out_in = out.to(q.dtype)  # the output the caller got, as the kernel's backward reads it
    dq, dk, dv = (t.new_zeros(t.shape, dtype=work) for t in (q, k, v))
    dweight = torch.zeros_like(weight)
    far_pairs = [(far[2 * i], far[2 * i + 1]) for i in range(len(plan.parts))]  # (out_p, lse_p) per far part
    for part, (out_p, lse_p) in zip(plan.parts, far_pairs, strict=True):
        _far_part_grads(part, plan, q, k, v, weight, out_in, lse, grad_in, grad, delta, out_p, lse_p,
                        grads=(dq, dk, dv, dweight))
    _band_grads(plan, q.to(work), k.to(work), v.to(work), lse, near_lse, probs, grad, delta,
                grads=(dq, dk, dv, dweight), table_grad=ctx.needs_input_grad[3])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dweight, None, None


def _far_part_grads(part: Any, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor,
                    out_in: torch.Tensor, lse: torch.Tensor, grad_in: torch.Tensor, grad: torch.Tensor,
                    delta: torch.Tensor, out_p: torch.Tensor, lse_p: torch.Tensor, grads: tuple) -> None:
    """Add one far part's gradients to ``grads`` (dq, dk, dv, dweight): the fused kernel's backward run with the
    merged output and log-sum-exp (minus the part's constant, so the kernel's P is the part's merged share), and the
    constant's gradient, the sum over the part's probabilities of (dP - delta)."""
    dq, dk, dv, dweight = grads
    rows, keys = slice(*part.rows), slice(*part.keys)
    row_lse = lse[:, :, rows] - weight[:, part.bucket, None]  # [B, H, rows]: the merged softmax, seen from this part
    dq_p, dk_p, dv_p = _flash_backward(
        _slice(grad_in, part.rows, part.flipped),
        _slice(q, part.rows, part.flipped),
        _slice(k, part.keys, part.flipped),
        _slice(v, part.keys, part.flipped),
        _slice(out_in, part.rows, part.flipped),
        row_lse.flip(-1) if part.flipped else row_lse,
        0.0,  # dropout_p
        part.causal,  # is_causal
        scale=plan.scale,
    )
    if part.flipped:  # keys after the query ran on reversed sequences
        dq_p, dk_p, dv_p = dq_p.flip(2), dk_p.flip(2), dv_p.flip(2)
    dq[:, :, rows] += dq_p
    dk[:, :, keys] += dk_p
    dv[:, :, keys] += dv_p
    share = (lse_p - lse[:, :, rows]).exp()  # [B, H, rows]: the part's total probability under the merged softmax
    dweight[:, part.bucket] += (share * ((grad[:, :, rows] * out_p).sum(-1) - delta[:, :, rows])).sum((0, 2))


def _band_grads(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                near_lse: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor, delta: torch.Tensor, grads: tuple,
                table_grad: bool) -> None:
    """Add the near band's gradients to ``grads`` (dq, dk, dv, dweight), by hand, block by block; q, k, v and
    ``grad`` in the working dtype. Blocks: n blocks of Bq queries, each against a window of W keys."""
    dq, dk, dv, dweight = grads
    band, heads, kv_heads, length = plan.band, q.shape[1], k.shape[1], q.shape[2]
    weight_share = _to_blocks((near_lse - lse).exp()[..., None], band, kv_heads)  # [B, Hkv, n, G*Bq, 1]
    probs = probs * weight_share  # [B, Hkv, n, G*Bq, W]: band probabilities under the merged softmax
    grad_b = _to_blocks(grad, band, kv_heads)  # [B, Hkv, n, G*Bq, D]
    kw, vw = _windows(k, band), _windows(v, band)  # [B, Hkv, n, W, D] each
    dscores = torch.matmul(grad_b, vw.transpose(-1, -2))  # dP [B, Hkv, n, G*Bq, W]
    dscores = dscores.sub_(_to_blocks(delta[..., None], band, kv_heads)).mul_(probs)  # dS = P * (dP - delta)
    qb = _to_blocks(q, band, kv_heads)  # [B, Hkv, n, G*Bq, D]
    dq += _from_blocks(torch.matmul(dscores, kw), band, heads, length) * plan.scale  # [B, H, q, D]
    dk += _fold(torch.matmul(dscores.transpose(-1, -2), qb), band, plan.kv_len) * plan.scale  # [B, Hkv, kv, D]
    dv += _fold(torch.matmul(probs.transpose(-1, -2), grad_b), band, plan.kv_len)  # [B, Hkv, kv, D]
    if table_grad:  # each bias entry's gradient is the sum of dS over the scores it was added to
        batch, _, blocks, _, width = dscores.shape
        per_entry = dscores.view(batch, kv_heads, blocks, heads // kv_heads, band.block, width).sum((0, 2))
        dweight.index_add_(1, band.bucket_ids.flatten(), per_entry.reshape(heads, -1))  # [H, Bq * W] by bucket


def fused_t5_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, plan: Plan
) -> torch.Tensor:
    """Attention output [B, H, q, D] for T5 bias ``weight`` [H, buckets] split as ``plan`` says."""
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, weight))  # a backward will follow
    return FusedT5Attention.apply(q, k, v, weight, plan, keep)

