"""Rotate-half RoPE on q and k in blocks of positions: no full-size temporaries, a backward without zero-filling;
and as matrices.

transformers' formula ``x * cos + rotate_half(x) * sin`` allocates three tensors the size of x (``x * cos``,
``rotate_half``'s cat and its product by sin) and, when x needs a gradient, autograd's backward of that cat and of
its slices fills two more full-size tensors with zeros and adds them. Written on the halves x1, x2 of the rotated
dims (dim i pairs with i + r / 2) the same values are

    out1 = x1 * c1 - x2 * s1        out2 = x2 * c2 + x1 * s2

and they are the formula's bit for bit: ``(-a) * b == -(a * b)`` and ``c + (-d) == c - d`` exactly in IEEE
arithmetic. Here they are computed one block of positions at a time, so the only temporaries are two products of
one block (about 1 MiB each):

- :func:`rotate_pairs_` writes into x (keys in a KV cache layer's own tensor; never a query or key that may be a
  view of a projection's output, which a forward hook may hold);
- :func:`rotate_pairs` writes into one new tensor laid out like x (so attention sees the strides it sees natively),
  through an autograd Function whose backward is the transposed rotation, ``grad1 = g1 * c1 + g2 * s2``,
  ``grad2 = g2 * c2 - g1 * s1``: the values autograd computes through the formula, in one pass like the forward.

and :func:`rotation_matrices` gives the same rotation as one [D, D] matrix per position, with which a decode step's
single token is rotated in one matrix product.

cos and sin need no gradient here (a trainable rotation goes through the formula, see
:func:`~hf_posswap.core.rotary_cache.rotate`); they are [L, r] or [B, 1, L, r], in x's dtype.
"""

from __future__ import annotations

import torch

#: elements of one block's temporaries (1 MiB in float32)
BLOCK_ELEMENTS = 1 << 18


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, D] rotated by cos, sin [L, r] / [B, 1, L, r] on its first r dims, in a new tensor laid out as
    x is; differentiable in x (gradient: the inverse rotation)."""
    return _Rotation.apply(x, cos, sin, False)


def rotate_pairs_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, D] rotated in place (x must need no gradient and own its memory); returns x."""
    _rotate_into(x, x, cos, sin, inverse=False)
    return x


class _Rotation(torch.autograd.Function):
    """The rotation (``inverse``: its transpose) as one autograd node; its backward is the opposite rotation, itself
    differentiable (double backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.inverse = inverse
        out = _empty_like_layout(x)
        rotary_dim = cos.shape[-1]
        if rotary_dim < x.shape[-1]:  # partial rotary: the other dims pass through
            out[..., rotary_dim:].copy_(x[..., rotary_dim:])
        _rotate_into(out, x, cos, sin, inverse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        cos, sin = ctx.saved_tensors
        return _Rotation.apply(grad, cos, sin, not ctx.inverse), None, None, None


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> None:
    """out[..., :r] = rotation of x[..., :r] (``inverse``: its transpose), block by block of positions (dim -2);
    ``out`` may be ``x`` itself: each block's cross products are taken before the block is overwritten."""
    length = x.shape[-2]
    with torch.no_grad():  # the autograd Function (or the caller of the in-place form) owns the graph
        if torch.compiler.is_compiling():  # one block: a loop over a symbolic length would fix it in the guards
            _rotate_block(out, x, cos, sin, inverse)
            return
        row = x[..., :1, : cos.shape[-1] // 2].numel()  # elements of one position's half, over batch and heads
        step = max(1, BLOCK_ELEMENTS // max(1, row))
        for start in range(0, length, step):
            stop = min(start + step, length)
            c = cos[..., start:stop, :] if cos.shape[-2] == length else cos
            s = sin[..., start:stop, :] if sin.shape[-2] == length else sin
            _rotate_block(out[..., start:stop, :], x[..., start:stop, :], c, s, inverse)


def _rotate_block(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> None:
    """One block of positions: out[..., :r] = rotation of x[..., :r] (``out`` may be ``x``)."""
    half = cos.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half : 2 * half]  # [B, H, n, r/2] each
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    if inverse:  # transpose: out1 = x1 c1 + x2 s2, out2 = x2 c2 - x1 s1
        s1, s2 = s2, s1
    cross1, cross2 = x2 * s1, x1 * s2  # the block's two temporaries, before x1, x2 may be overwritten
    out1, out2 = out[..., :half], out[..., half : 2 * half]
    if torch.compiler.is_compiling():  # dynamo cannot trace out= into a strided view; inductor fuses these
        out1.copy_(x1 * c1)
        out2.copy_(x2 * c2)
    else:
        torch.mul(x1, c1, out=out1)
        torch.mul(x2, c2, out=out2)
    if inverse:
        out1.add_(cross1)
        out2.sub_(cross2)
    else:
        out1.sub_(cross1)
        out2.add_(cross2)


def _empty_like_layout(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of x's shape whose dims lie in memory in x's order (outermost = largest stride), dense
    even where x is a strided view (a query split from a fused qkv projection); ties keep the dims' order."""
    if torch.compiler.is_compiling():  # strides are symbols there (no order to sort by); inductor picks the layout
        return torch.empty_like(x)
    order = sorted(range(x.dim()), key=lambda dim: -x.stride(dim))
    return torch.empty_permuted(x.shape, order, dtype=x.dtype, device=x.device)


def rotation_matrices(cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """R [n, D, D] for cos, sin [n, r]: rotate_half(x) = x @ J, so R = diag(cos) + J * sin (column j scaled by
    sin_j): entries cos_j on the diagonal, -sin_j at (j + h, j) and sin_j at (j - h, j), exactly; the identity on
    the dims past r (partial rotary)."""
    rotary_dim = cos.shape[-1]
    found = torch.diag_embed(cos).addcmul_(_half_turn(rotary_dim, cos.dtype, cos.device), sin[:, None, :])
    if rotary_dim < dim:  # [n, r, r] -> [n, D, D]
        found = torch.nn.functional.pad(found, (0, dim - rotary_dim, 0, dim - rotary_dim))
        found[:, rotary_dim:, rotary_dim:] = torch.eye(dim - rotary_dim, dtype=cos.dtype, device=cos.device)
    return found


def _half_turn(rotary_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """J [r, r] with x @ J = rotate_half(x) = cat(-x2, x1): J[j + h, j] = -1 and J[j, j + h] = 1 for j < h.
    A constant, made once per (r, dtype, device)."""
    key = (rotary_dim, dtype, device)
    found = _HALF_TURNS.get(key)
    if found is None:
        half = rotary_dim // 2
        found = torch.zeros(rotary_dim, rotary_dim, dtype=dtype, device=device)
        index = torch.arange(half, device=device)
        found[index + half, index] = -1
        found[index, index + half] = 1
        _HALF_TURNS[key] = found
    return found


#: (rotary dims, dtype, device) -> J of :func:`_half_turn`; a handful of small constant matrices
_HALF_TURNS: dict = {}
