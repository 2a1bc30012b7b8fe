"""RoPE inside attention with keys rotated once, where they enter the KV cache.

GPT-2 and BERT cache keys with no hook after their projection, so rotary schemes rotate q and k inside attention,
which receives the cache's own key tensor. Rotating every cached key at every decode step costs a pass over the
cache per layer and step (0.74x native tokens/s), so a key is rotated once, *in the cache's own tensor*, and the
layer records how many leading slots hold rotated keys and with which rotation (:class:`RotatedKeys`, a layer
attribute that ``copy.deepcopy`` carries). Later steps rotate only the new tail, with cos/sin made once per forward.

Keys are rotated in place (:func:`cache_layer` picks the layers) for a length-independent rotation (not dynamic
NTK, LongRoPE or Self-Extend), in a cache layer that is not sliding, whose key tensor is memory it made itself
(transformers' layers copy what they store) and whose slots are indexed by position; everything else rotates every
key at every step, out of place. So does compiled code in a layer with no record: reading and writing the record
are host work that would break the graph in every layer and step, and inductor fuses the rotation into the step's
graph; a layer an eager forward recorded is continued as recorded. Queries are always rotated out of place: they
may be views of a projection's output that a forward hook holds.

Why the record stays right: beam search (``reorder_cache``), ``batch_select_indices`` and ``batch_repeat_interleave``
move rows, not positions; ``crop`` (assisted decoding) and ``reset`` shorten the layer, and only ``min(count,
cached length)`` slots are trusted; slots appended by anything else (a forward that made its own cache, a native
model) are rotated when they are first seen. A cache layer whose keys require grad, or are inference tensors outside
inference mode, is never written: its unrotated tail is rotated out of place at every step.

Not protected: a cache rebuilt from its tensors (the record is lost: keys rotated twice), and a model without
hf_posswap's attention (native, or unswapped) continuing a cache a swapped model filled. Swapped models refuse a
cache rotated otherwise, or reaching a scheme that needs unrotated keys (:func:`refuse_foreign_rotation`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import InvalidConfigError
from ..schemes.base import pinned_id
from ..schemes.kept_rows import same_values
from ..schemes.rope import apply_rotary
from ..transformers_internals import (
    CACHE_KWARG,
    cache_layer_at,
    layer_is_sliding,
    layer_keys,
    layer_length,
    self_attention_layers,
)
from .rotation import rotate_pairs, rotate_pairs_, rotation_matrices

#: attribute of a transformers cache layer that records its rotated slots
MARKER = "posswap_rotated_keys"


@dataclass(frozen=True)
class RotatedKeys:
    """Slots ``[0, count)`` of a cache layer's keys hold keys rotated by their slot index, with the rotation whose
    cos and sin at position 1 are ``signature``; xPos keys are also scaled, counting positions from ``reference``."""

    count: int
    signature: tuple[float, ...]
    reference: int = 0


def rotates_once(positions: nn.Module | None, two_pass: Any) -> bool:
    """Whether a rotary scheme may store keys rotated: the rotation of a position must not depend on the current
    length, and nothing may need the keys unrotated later (Self-Extend regroups positions past its window)."""
    return two_pass is None and getattr(positions, "length_dependent", None) is False


def scales_keys(positions: nn.Module | None) -> bool:
    """Whether queries and keys get different factors (xPos): the scheme is then called with ``keys`` and a
    ``reference`` position that the queries and keys of one attention call share."""
    return bool(getattr(positions, "scales_keys", False))


def rotary_inputs(module: nn.Module, query: torch.Tensor, key: torch.Tensor, context: Any) -> tuple[torch.Tensor, ...]:
    """Rotated (q [B, H, q, D], k [B, Hkv, kv, D]) for a :class:`~hf_posswap.core.context.PositionContext`.

    Keys held by a cache layer (see :func:`cache_layer`) are rotated once, in place; other keys are all rotated,
    out of place, with the positions the context gives them (they may be a cache's tensor that the model made
    itself, which must stay unrotated). The query is always rotated out of place: GPT-2 and BERT hand attention
    views of their projections' outputs, which forward hooks (activation capture, interpretability tools) may
    hold, and those must keep the values the projection returned. xPos (:func:`scales_keys`) counts positions
    from a reference that queries and keys share: the centre of the call's positions, or the one a cache layer
    recorded.
    """
    scheme = context.positions
    q_len, kv_len = query.shape[2], key.shape[2]
    seq_len = context.query_offset + q_len  # the current length, for length-dependent scalings
    rows = context.row_positions
    if rows is not None and rows.shape[-1] == q_len == kv_len:  # explicit positions (PoSE): no cache
        reference = rows[..., q_len // 2 : q_len // 2 + 1]  # [B, 1]: each row's middle position
        query = rotate(query, *_row_angles(context, scheme, rows, seq_len, False, reference), context)
        return query, rotate(key, *_row_angles(context, scheme, rows, seq_len, True, reference), context)
    layer = cache_layer(module, query, key, context)
    if layer is None:
        start = context.key_start(q_len, kv_len)
        reference = start + kv_len // 2  # the centre of the keys (the queries are among them)
        cos, sin = angles(context, context.query_offset, q_len, seq_len, query.device, reference)
        query = rotate(query, cos, sin, context)
        return query, rotate(key, *angles(context, start, kv_len, seq_len, key.device, reference, True), context)
    step = _decode_step(layer, query, key, context)
    if step is not None:
        return step
    done, reference = _rotated_prefix(layer, key, q_len, context)
    cos, sin = angles(context, context.query_offset, q_len, seq_len, query.device, reference)
    query = rotate(query, cos, sin, context)
    return query, _rotate_cached(layer, key, q_len, context, done, reference)


def _decode_step(layer: Any, query: torch.Tensor, key: torch.Tensor, context: Any) -> tuple[torch.Tensor, ...] | None:
    """A decode step's fast path (None where it does not apply): one new token, every earlier slot of the layer
    already rotated by this rotation, no xPos factors, a rotation without trainable parameters in play. The query
    and the new key (in the cache's own tensor) are rotated by the position's [D, D] matrix (:func:`_step_matrix`).
    At one token a step, the lookups and checks of the general path cost as much as the rotation itself (measured
    ~0.35 ms a layer on 2 cores, ~10 % of a small model's step); here they are done once per forward."""
    offset = context.query_offset
    marker = getattr(layer, MARKER, None)
    if query.shape[2] != 1 or marker is None or marker.count < offset or marker.reference or not _writable(key):
        return None
    if query.requires_grad:  # the kept matrices stay out of autograd (they may be inference tensors)
        return None
    matrix = _step_matrix(context, offset, query.device, query.dtype, query.shape[-1])
    if matrix is None or marker.signature is not context.memo.get("rope-signature"):
        return None  # (a marker of another rotation: the general path explains the refusal)
    tail = key[:, :, offset : offset + 1]
    tail.copy_(_turn(tail, matrix))
    setattr(layer, MARKER, RotatedKeys(offset + 1, marker.signature))
    return _turn(query, matrix), key


def _step_matrix(context: Any, position: int, device: torch.device, dtype: torch.dtype, dim: int) -> Any:
    """The rotation matrix [D, D] of ``position`` (see :func:`_rotation_matrix`), or None for a rotation this
    cannot hold (xPos, trainable parameters under grad). Matrices are made for :data:`STEP_BLOCK` positions at a
    time and kept per scheme module while its tensors and attention factor are unchanged (the signature's stamp),
    so a decode step usually only indexes them."""
    memo_key = ("rope-step-matrix", position, device, dtype)
    if memo_key in context.memo:
        return context.memo.get(memo_key)
    scheme = context.positions
    signature = rotation_signature(context, device)
    trainable = torch.is_grad_enabled() and any(p.requires_grad for p in scheme.parameters())
    found = None
    if not (scales_keys(scheme) or trainable):
        block = _STEP_MATRICES.get(scheme)
        if block is None or block[0] is not signature or block[1:4] != (dtype, dim, device) \
                or not 0 <= position - block[4] < len(block[5]):
            with torch.no_grad():
                cos, sin = scheme(torch.arange(position, position + STEP_BLOCK, device=device))  # [n, r] each
                matrices = rotation_matrices(cos.to(dtype), sin.to(dtype), dim)  # [n, D, D]
            block = (signature, dtype, dim, device, position, matrices.unbind(0))
            _STEP_MATRICES[scheme] = block
        found = block[5][position - block[4]]  # (a list: no tensor op to pick one)
    context.memo[memo_key] = found
    return found


#: positions whose decode-step matrices are made at once (64 x 64 x 64 float32: 1 MiB)
STEP_BLOCK = 64
#: scheme module -> (signature, dtype, head dim, device, first position, the matrices [D, D] of n positions)
_STEP_MATRICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def angles(
    context: Any,
    start: int,
    length: int,
    seq_len: int,
    device: torch.device,
    reference: int = 0,
    keys: bool = False,
) -> tuple[torch.Tensor, ...]:
    """cos, sin [length, r] of positions ``start .. start + length - 1``, computed once per forward and shared by
    every layer (and, for RoPE, by the queries and the new keys, which sit at the same positions). xPos gets the
    factors for ``keys`` or queries, counted from ``reference``; RoPE ignores both."""
    scaled = scales_keys(context.positions)
    reference, keys = (reference, keys) if scaled else (0, False)
    memo_key = ("rope-angles", start, length, seq_len, device, torch.is_grad_enabled(), reference, keys)
    found = context.memo.get(memo_key)
    if found is None:
        positions = torch.arange(start, start + length, device=device)
        extra = {"keys": keys, "reference": reference} if scaled else {}
        found = context.positions(positions, seq_len, **extra)
        context.memo[memo_key] = found
    return found


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: Any, in_place: bool = False) -> torch.Tensor:
    """``apply_rotary(x, cos, sin)`` for x [B, H, n, D], with fewer passes over x and no full-size temporaries: one
    token (a decode step) is one matmul with its rotation matrix (same values to float rounding, the matrix built
    once per forward); more tokens are rotated pair-wise in blocks of positions (:mod:`~hf_posswap.core.rotation`:
    the same values bit for bit, and a backward that is one inverse rotation). ``in_place``: x is memory the caller
    owns (a cache layer's own key tensor, never a view of a projection's output that a forward hook may hold) and
    nobody reads it unrotated again, so x may be rotated where it lies when nothing needs a gradient (the result
    is then x itself)."""
    if sin.requires_grad or cos.requires_grad:  # a trainable rotation: keep autograd's view of every product
        return apply_rotary(x, cos, sin)
    if x.shape[-2] == 1 and cos.dim() == 2:
        return _turn(x, _rotation_matrix(context, cos, sin, x.shape[-1], x.dtype))
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if cos.dim() == 3:  # per-row positions [B, L, r] -> [B, 1, L, r] (broadcast over heads)
        cos, sin = cos[:, None], sin[:, None]
    if in_place and _writable(x) and 0 not in x.stride():  # (an expanded x shares memory between its elements)
        return rotate_pairs_(x, cos, sin)
    return rotate_pairs(x, cos, sin)


def _turn(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, D] @ matrix [D, D]: a few tokens rotated in one operation."""
    return torch.matmul(x, matrix)


def _rotation_matrix(context: Any, cos: torch.Tensor, sin: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """R [D, D] with x @ R = x * cos + rotate_half(x) * sin on the first r dims and x on the others (cos, sin
    [1, r]), once per forward."""
    memo_key = ("rope-matrix", pinned_id(context.memo, cos), dim, dtype)
    found = context.memo.get(memo_key)
    if found is None:
        found = context.memo[memo_key] = rotation_matrices(cos.to(dtype), sin.to(dtype), dim)[0]
    return found


def _row_angles(
    context: Any, scheme: nn.Module, rows: torch.Tensor, seq_len: int, keys: bool, reference: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """cos, sin [B, L, r] of explicit per-row positions, once per forward (xPos: for ``keys`` or queries, counted
    from each row's ``reference`` [B, 1]; RoPE: the same for both)."""
    scaled = scales_keys(scheme)
    keys = keys and scaled
    memo_key = ("rope-rows", pinned_id(context.memo, rows), seq_len, rows.device, torch.is_grad_enabled(), keys)
    found = context.memo.get(memo_key)
    if found is None:
        found = scheme(rows, seq_len, keys=keys, reference=reference) if scaled else scheme(rows, seq_len)
        context.memo[memo_key] = found
    return found


def cache_layer(module: nn.Module, query: torch.Tensor, key: torch.Tensor, context: Any) -> Any | None:
    """The cache layer whose key tensor ``key`` is, when its keys may be stored rotated (else None): a
    length-independent rotation, a layer that is not sliding, slots indexed by position, and a key tensor that the
    layer made itself (:func:`_made_by_cache`)."""
    if context.cache is None or not rotates_once(context.positions, context.two_pass):
        return None
    layer = cache_layer_at(context.cache, getattr(module, "layer_idx", None))
    if layer is None or layer_keys(layer) is not key or layer_is_sliding(layer):
        return None
    if key.dim() != 4 or key.shape[2] < context.query_offset + query.shape[2]:  # slot index != position
        return None
    if torch.compiler.is_compiling() and getattr(layer, MARKER, None) is None:
        return None  # compiled, no record: every key rotated out of place in the graph (see the module's docstring)
    return layer if _made_by_cache(key, query) else None


def _made_by_cache(key: torch.Tensor, query: torch.Tensor) -> bool:
    """Whether a cache layer's key tensor [B, Hkv, kv, D] is memory of its own, which may be rotated in place, and
    not the key projection's output that the layer kept as it was handed over (a forward hook on the projection may
    hold that output, and must keep seeing the values the projection returned).

    transformers' layers copy every key they store: a dynamic layer concatenates (``torch.cat`` allocates, even onto
    its empty first tensor), a static layer writes into its own buffer (``index_copy_``). A layer that kept the
    handed tensor would show it here as a view of another tensor (tracked outside inference mode), as a tensor that
    shares memory with the query (a fused qkv projection: GPT-2's ``c_attn``), or as a strided one (the
    [B, L, H, D] projection read as [B, H, L, D]; the layers' own tensors are dense)."""
    if key._base is not None or not key.is_contiguous():
        return False
    return key.untyped_storage().data_ptr() != query.untyped_storage().data_ptr()


def _rotate_cached(layer: Any, key: torch.Tensor, q_len: int, context: Any, done: int, reference: int) -> torch.Tensor:
    """Rotate the slots of ``key`` (the layer's own tensor) after the ``done`` rotated ones; return the keys to
    attend. xPos keys are scaled from ``reference``, which the layer records with them."""
    end = context.query_offset + q_len
    if _writable(key):
        tail = key[:, :, done:end]
        rotated = rotate(tail, *angles(context, done, end - done, end, key.device, reference, True), context, True)
        if rotated is not tail:  # a decode step's matrix product, or a trainable rotation
            tail.copy_(rotated)
        setattr(layer, MARKER, RotatedKeys(end, rotation_signature(context, key.device), reference))
        return key
    # never written (keys that require grad, inference tensors): rotate the rest out of place at every step
    cos, sin = angles(context, done, key.shape[2] - done, end, key.device, reference, True)
    rest = rotate(key[:, :, done:], cos, sin, context)
    return torch.cat((key[:, :, :done], rest), dim=2) if done else rest


def _rotated_prefix(layer: Any, key: torch.Tensor, q_len: int, context: Any) -> tuple[int, int]:
    """How many leading slots of the layer hold keys rotated by this rotation (crop and reset shorten a layer
    without telling it: only slots still in the cache before this forward count), and the reference position
    their xPos factors count from (a new one, the centre of this forward's positions, when none are kept)."""
    offset = context.query_offset
    marker = getattr(layer, MARKER, None)
    done = min(marker.count, offset) if marker is not None else 0
    if not done:
        return 0, (offset + q_len) // 2 if scales_keys(context.positions) else 0
    signature = rotation_signature(context, key.device)
    if marker.signature != signature:
        theirs, ours = _describe_signature(marker.signature), _describe_signature(signature)
        raise InvalidConfigError(
            f"The KV cache holds keys that another RoPE (cos/sin at position 1 starting {theirs}) stored "
            f"rotated, and this model rotates with {ours}: continuing the cache would mix two rotations. Continue "
            f"the cache with the model that filled it, or start a new one ({CACHE_KWARG}=None)."
        )
    return done, marker.reference


def rotation_signature(context: Any, device: torch.device) -> tuple[float, ...]:
    """cos and sin at position 1 (they fix the frequencies and the attention factor), computed once per scheme
    module and state of its tensors, looked up once per forward."""
    signature = context.memo.get("rope-signature")
    if signature is None:
        scheme = context.positions
        stamp = (device, getattr(scheme, "attention_scaling", None))
        tensors = _scheme_tensors(scheme)
        known = _SIGNATURES.get(scheme)
        if known is None or known[0] != stamp or not _same_tensors(known[1], tensors):
            cos, sin = scheme(torch.ones(1, device=device))
            with torch.inference_mode(False):  # kept copies: normal tensors even under inference_mode
                copies = [t.detach().clone() for t in tensors]
            known = (stamp, copies, tuple(torch.cat((cos, sin), dim=-1).flatten().tolist()))
            _SIGNATURES[scheme] = known
        signature = context.memo["rope-signature"] = known[2]
    return signature


def _scheme_tensors(scheme: nn.Module) -> list[torch.Tensor]:
    """The scheme module's buffers and parameters (read from its own dicts when it has no submodules: walking the
    module tree costs ~50 µs a decoding step on a CPU whose caches the KV cache's copy has just flushed)."""
    if scheme._modules:
        return [*scheme.buffers(), *scheme.parameters()]
    return [t for t in (*scheme._buffers.values(), *scheme._parameters.values()) if t is not None]


def _same_tensors(kept: list[torch.Tensor], tensors: list[torch.Tensor]) -> bool:
    """Whether the scheme's tensors still hold the kept values (compared by value, see :func:`same_values`)."""
    return len(kept) == len(tensors) and all(same_values(a, b) for a, b in zip(kept, tensors, strict=True))


#: scheme module -> ((device, attention factor), copies of its tensors, signature)
_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _writable(key: torch.Tensor) -> bool:
    """Keys that may be rotated in place: no autograd history to corrupt, and not a read-only inference tensor."""
    if key.requires_grad:
        return False
    return not (key.is_inference() and not torch.is_inference_mode_enabled())


def refuse_foreign_rotation(cache: Any, positions: nn.Module | None, kind: str, two_pass: Any) -> None:
    """Refuse a cache that holds rotated keys when this model's scheme needs them unrotated (any scheme but a
    length-independent RoPE inside attention; that one checks the rotation itself, layer by layer)."""
    if cache is None or (kind == "rotary" and rotates_once(positions, two_pass)):
        return
    for index, layer in enumerate(self_attention_layers(cache)):
        marker = getattr(layer, MARKER, None)
        if marker is not None and min(marker.count, layer_length(layer)) > 0:
            raise InvalidConfigError(
                f"The KV cache holds keys that a model with RoPE inside attention stored rotated (layer {index}, "
                f"{min(marker.count, layer_length(layer))} positions), and this model's {_needs(kind, two_pass)} "
                "needs them unrotated. Continue the cache with the model that filled it, or start a new one "
                f"({CACHE_KWARG}=None)."
            )


def _needs(kind: str, two_pass: Any) -> str:
    if kind != "rotary":
        return f"'{kind}' scheme"
    return "two-pass RoPE (Self-Extend, ReRoPE)" if two_pass is not None else "RoPE that changes with the length"


def _describe_signature(signature: tuple[float, ...]) -> str:
    return "(" + ", ".join(f"{value:.4g}" for value in signature[:3]) + ", ...)"
