"""What every position scheme shares: the config base class, the model facts a scheme is built from, the
scheme registry, and the three module contracts (absolute, rotary, bias).

A scheme is *what* is computed; where it goes inside a model is the family adapter's business
(``hf_posswap.families``). See docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from ..errors import InvalidConfigError, InvalidOptionError, UnknownSchemeError, closest_hint
from ..registry import Registry

#: what a scheme computes: vectors added to the embeddings, a rotation of q and k, a logit bias, nothing; or a mix
#: of those per layer (``mix``: :class:`~hf_posswap.schemes.mix.LayerMix`) or per head (``head_mix``)
SchemeKind = Literal["absolute", "rotary", "bias", "none", "mix", "head_mix"]
#: a bias as one elementwise function for ``flex_attention``'s ``score_mod``: (query head h, query position, key
#: position, lane) -> the logit bias, float32 (see :meth:`BiasPositions.flex_bias`). Arguments are scalar int tensors
#: inside the kernel, or any broadcasting int tensors outside it; the function combines tensors it captured with
#: elementwise ops and gathers, and gathers each captured tensor that needs a gradient once (compiled flex refuses
#: a second gather of it).
FlexBias = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: set on a native module (and its parameters) that a reloaded swapped model re-created with random weights
FRESH_MARK = "_posswap_fresh_native"


class NativeWeightsMissingWarning(UserWarning):
    """A native position module came back with transformers' fresh initialisation, not trained weights."""


@dataclass(frozen=True)
class ModelSpec:
    """Facts about a model that a scheme needs to build its module; filled in by the family adapter."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    is_causal: bool
    max_positions: int | None
    initializer_range: float
    native_rope_theta: float | None
    dtype: torch.dtype
    device: torch.device
    existing_table: torch.Tensor | None = None  # [max_positions, hidden] when the model has a learned table


@dataclass
class SchemeConfig:
    """Base class of every scheme's config.

    Subclasses are dataclasses that validate in ``__post_init__`` and serialize to plain JSON with
    :meth:`to_dict`. They set ``name`` (the registry key) and ``kind`` (a :data:`SchemeKind`).
    """

    name: ClassVar[str] = ""
    kind: ClassVar[SchemeKind] = "none"
    paper: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`InvalidConfigError` for an invalid value. Subclasses extend this."""

    @property
    def layer_shared(self) -> bool:
        """Whether every layer gets the same positions (bias schemes: one bias for all layers)."""
        return True

    def resolve(self, spec: ModelSpec) -> SchemeConfig:
        """Return a copy with model-dependent defaults (``None`` fields) filled in from ``spec``."""
        return dataclasses.replace(self)

    def build(self, spec: ModelSpec) -> nn.Module | None:
        """Build the module carrying this scheme for a model described by ``spec`` (``None``: nothing to carry)."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form: ``{"scheme": name, **fields}``."""
        return {"scheme": self.name, **dataclasses.asdict(self)}

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, **options: Any) -> SchemeConfig:
        """Build the config from keyword options, rejecting options the scheme does not have."""
        allowed = cls.option_names()
        for key in options:
            if key not in allowed:
                listed = ", ".join(allowed) if allowed else "none"
                raise InvalidOptionError(
                    f"Scheme '{cls.name}' ({cls.__name__}) has no option '{key}'. Its options are: {listed}."
                    f"{closest_hint(key, allowed)}"
                )
        return cls(**options)


SCHEME_REGISTRY: Registry[type[SchemeConfig]] = Registry(
    "position scheme", UnknownSchemeError, "List them with hf_posswap.available_schemes()."
)


def register_scheme(cls: type[SchemeConfig]) -> type[SchemeConfig]:
    """Class decorator: register a :class:`SchemeConfig` subclass under its ``name``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} must set a non-empty class attribute `name`.")
    return SCHEME_REGISTRY.register(cls.name)(cls)


def scheme_config_from_dict(data: dict[str, Any]) -> SchemeConfig:
    """Inverse of :meth:`SchemeConfig.to_dict`."""
    fields = dict(data)
    name = fields.pop("scheme", None)
    if not isinstance(name, str):
        raise InvalidConfigError(f"A scheme record needs a string 'scheme' key, got {name!r} in {data!r}.")
    return SCHEME_REGISTRY.get(name).from_options(**fields)


# ---------------------------------------------------------------------------------------------------------------
# Validation helpers: each raises InvalidConfigError naming the field, the bad value and what is allowed.


def require_positive(owner: str, field: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidConfigError(f"{owner}.{field} must be a positive finite number, got {value!r}.")


#: the largest finite float32: frequencies base^(-2i/d) stay finite and non-zero in float32 up to this base
MAX_FREQUENCY_BASE = float(torch.finfo(torch.float32).max)


def require_frequency_base(owner: str, field: str, value: float) -> None:
    """A base of geometric frequencies base^(-2i/d): above 1 (so frequencies fall from 1 and differ) and at most
    float32's largest value (so none becomes infinite or zero)."""
    if 1.0 < value <= MAX_FREQUENCY_BASE:
        return
    why = (
        "a base <= 1 gives frequencies >= 1 that repeat within a few tokens (1 makes them all equal)"
        if value <= 1.0
        else "a larger base makes the lowest frequencies underflow to 0 in float32"
    )
    raise InvalidConfigError(
        f"{owner}.{field} must be above 1 and at most {MAX_FREQUENCY_BASE:.3g}, got {value!r}: {why}. "
        "Typical values are 10000 to 1e6."
    )


def require_int_at_least(owner: str, field: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidConfigError(f"{owner}.{field} must be an integer >= {minimum}, got {value!r}.")


def require_fraction(owner: str, field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise InvalidConfigError(f"{owner}.{field} must be in (0, 1], got {value!r}.")


def require_bool(owner: str, field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidConfigError(f"{owner}.{field} must be True or False, got {value!r}.")


# ---------------------------------------------------------------------------------------------------------------
# Module contracts.


class AbsolutePositions(nn.Module):
    """position ids [B, L] (or [1, L]) -> vectors [B, L, hidden] added to the token embeddings."""

    def __init__(self) -> None:
        super().__init__()
        # Empty buffer that follows model.to(dtype/device) so computed vectors match the embeddings.
        self.register_buffer("_dtype_probe", torch.empty(0), persistent=False)

    @property
    def out_dtype(self) -> torch.dtype:
        return self._dtype_probe.dtype


class RotaryPositions(nn.Module):
    """forward: (positions [P] or [B, P], current sequence length) -> (cos, sin), each [(B,) P, rotary_dim],
    rotate-half layout; xPos (``scales_keys``) also takes ``keys`` and the ``reference`` both count from.

    Scheme modules are always *called* (never a method looked up on them), so wrappers such as peft's
    ``ModulesToSaveWrapper`` dispatch to the trained copy.
    """

    rotary_dim: int

    def forward(self, positions: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class BiasPositions(nn.Module):
    """forward: (query positions [q], key positions [kv], layer index, causal, memo) -> logit bias [1, H, q, kv];
    per-row positions ([B, q], [B, kv]: explicit or padded positions) give [B, H, q, kv].

    ``memo`` is a per-forward dict where a scheme may keep gradient-free intermediates (bucket ids) for the
    next layer; it may be ``None``. The library passes one, and with it 1-D positions are always index positions:
    consecutive ranges (a scheme may read them from their first entry and length); direct calls without a memo
    may pass any positions.
    """

    #: the fewest queries a call needs before :meth:`fused_attention` may take it (None: the scheme has no fused
    #: form); the sdpa carrier skips building a :class:`FusedCall` for calls below it (decoding steps, for T5)
    fused_min_queries: ClassVar[int | None] = None
    #: the name :mod:`hf_posswap.core.paths` records when :meth:`fused_attention` takes a call
    fused_path: ClassVar[str] = "fused"
    #: whether the bias reads the query's absolute position, not only query-key distances (FIRE's normaliser
    #: psi(max(i, L))): a padded batch then gives it per-row positions [B, q], [B, kv] that skip padding, so a
    #: left-padded row gets the bias of the row alone
    reads_query_positions: ClassVar[bool] = False

    def forward(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, layer_idx: int, causal: bool, memo: dict | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def fused_attention(self, call: FusedCall) -> torch.Tensor | None:
        """Attention with this bias without building the dense ``[B, H, q, kv]`` bias: output [B, q, H, D].

        Return ``None`` when ``call`` needs the dense path (the default: every scheme has the dense path; a scheme
        overrides this where an exact cheaper form exists). Only the sdpa carrier asks; eager attention, which must
        return the attention weights, always takes the dense path, so eager = sdpa checks every fused form.
        """
        return None

    def flex_bias(self, spec: FlexSpec) -> FlexBias | None:
        """This scheme's bias as an elementwise function (:data:`FlexBias`) equal to :meth:`forward` at every
        (head, query position, key position), for ``flex_attention`` (:mod:`hf_posswap.core.flex_bias`); None: not
        expressible (the default), and the fused or dense paths run.

        Captured tensors keep their graph: compiled ``flex_attention`` on CUDA returns gradients for them, by one
        atomic add per (batch, head, query, key) into the captured tensor's gradient. A parameter gathered by head
        alone would take every add of a head at one address, so parameters are captured spread over ``spec.lanes``
        copies (:func:`spread`) and gathered at ``[..., lane]``: the adds of a block of 128 x 128 scores then go to
        many addresses, and autograd sums the copies.
        """
        return None


@dataclass(frozen=True)
class FlexSpec:
    """What a bias scheme's :meth:`BiasPositions.flex_bias` knows of the call it serves."""

    layer_idx: int
    causal: bool
    #: the largest ``|key position - query position|`` over every (query, key) pair of the call, masked pairs
    #: included (the kernel evaluates the function on whole blocks and masks afterwards): how long a table over
    #: relative positions must be
    reach: int
    #: (least, greatest) query position of the call: the span of a table over query positions
    query_range: tuple[int, int]
    device: torch.device
    #: how many copies of a parameter to gather from (1: no gradient is needed); ``lane % 128`` is the key's index
    #: within its block of 128, so a table over relative positions (whose adds already spread along diagonals)
    #: spreads over min(lanes, 128) copies
    lanes: int = 1


def spread(values: torch.Tensor, lanes: int) -> torch.Tensor:
    """values [...] -> [..., lanes]: each value repeated along a new last dimension. Gathered at ``[..., lane]`` in
    a score_mod it reads the value; its gradient in compiled flex is accumulated per lane, and autograd sums the
    lanes into ``values``' gradient (see :meth:`BiasPositions.flex_bias`). A contiguous copy, not an expanded view:
    flex's backward (aot_eager on CPU, torch 2.13) returns no gradient for a captured view."""
    return values[..., None].expand(*values.shape, lanes).clone()


@dataclass
class FusedCall:
    """One self-attention call as a bias scheme's :meth:`BiasPositions.fused_attention` sees it.

    ``query`` [B, H, q, D]; ``key``/``value`` [B, Hkv, kv, D] (grouped heads not expanded); positions [q], [kv]
    (or [B, q], [B, kv] for explicit per-row positions); ``attention_mask`` as transformers' sdpa mask builder
    made it (``None``: no padding — causal models then rely on causality, encoders see every key — or a bool /
    float mask [B or 1, 1, q, kv]).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    query_pos: torch.Tensor
    key_pos: torch.Tensor
    layer_idx: int
    causal: bool
    scaling: float
    dropout: float
    memo: dict
    #: (first query position, first key position) of index positions, known to the caller without reading a tensor
    #: (None: explicit per-row positions, or not given)
    starts: tuple[int, int] | None = None
    #: first query's token index minus first key's: key j is in query i's past when j - i <= it (see causal_lag)
    index_lag: int | None = None

    def first_relative(self) -> int:
        """The first key's position minus the first query's, for index positions [q], [kv] (one sync at most)."""
        if self.starts is not None:
            return self.starts[1] - self.starts[0]
        return int(self.key_pos[0] - self.query_pos[0])

    def causal_lag(self) -> int:
        """:attr:`index_lag`, else (index positions, where position order is token order) from the positions."""
        return self.index_lag if self.index_lag is not None else -self.first_relative()


def pinned_id(memo: dict | None, tensor: Any) -> int | None:
    """``id(tensor)`` for a key of a per-forward memo, with ``tensor`` kept alive by the memo until the forward ends
    (None for None). An id names one object only while that object lives: a mask made for one layer alone (by a
    forward hook) is freed before the next layer's, whose new mask may get the same id and would then be answered
    from the first mask's entry."""
    if tensor is None:
        return None
    if torch.compiler.is_compiling():  # the memo keeps nothing then (core/forward_memo.py), and dynamo cannot id()
        return 0
    if memo is not None:
        memo.setdefault(("pinned",), {})[id(tensor)] = tensor
    return id(tensor)


class NoPositions(AbsolutePositions):
    """Zero vectors: stands in for a model's absolute table when the table is removed (NoPE and every
    non-absolute scheme)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        # [B, L] -> [B, L, hidden]
        return torch.zeros((*position_ids.shape, self.hidden_size), dtype=self.out_dtype, device=position_ids.device)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}"


# ---------------------------------------------------------------------------------------------------------------
# How absolute vectors join the token embeddings (``combine`` of the absolute schemes).

#: "add": e + p (Vaswani et al. 2017, §3.5); "concat": W [e; p], a learned projection back to the hidden size
COMBINE_MODES = ("add", "concat")


def require_combine(owner: str, value: Any) -> None:
    if not isinstance(value, str) or value not in COMBINE_MODES:
        raise InvalidConfigError(
            f"{owner}.combine must be 'add' (position vectors added to the token embeddings) or 'concat' "
            f"(concatenated with them and projected back to the hidden size), got {value!r}."
        )


class ConcatPositions(AbsolutePositions):
    """Concatenation instead of addition: ``projection([e; p])`` for token embeddings ``e`` and position vectors
    ``p = positions(position_ids)``, both of the hidden size ``d``.

    The projection ``W = [W_e | W_p]`` maps ``2d -> d`` without bias, so ``W [e; p] = W_e e + W_p p``:
    concatenation is addition with separately projected token and position vectors (the untying Ke et al. 2021,
    TUPE, arXiv:2006.15595, argue for). ``W`` starts as ``[I | I]``, where ``W [e; p] = e + p`` is exactly the
    additive model of Vaswani et al. 2017, §3.5 (each output sums two non-zero products, so float32 gives the
    same bits). Position vectors of another width than ``d`` would have no such start and are not offered.

    Called as ``module(position_ids, inputs_embeds)`` it returns the new embeddings; called with position ids
    alone it keeps the absolute contract and returns what the positions add, ``W_p p``.
    """

    def __init__(self, positions: AbsolutePositions, hidden_size: int) -> None:
        super().__init__()
        self.positions = positions
        self.hidden_size = hidden_size
        self.projection = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        with torch.no_grad():
            identity = torch.eye(hidden_size)
            self.projection.weight.copy_(torch.cat((identity, identity), dim=1))  # [d, 2d] = [I | I]

    def forward(self, position_ids: torch.Tensor, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.projection.weight
        if inputs_embeds is None:  # [B, L] -> [B, L, d]: the position half of the projection
            vectors = self.positions(position_ids).to(weight.dtype)
            return nn.functional.linear(vectors, weight[:, self.hidden_size:])
        vectors = self.positions(position_ids).to(inputs_embeds.dtype)  # [B or 1, L, d]
        vectors = vectors.expand(*inputs_embeds.shape[:-1], -1)  # [B, L, d]
        widened = torch.cat((inputs_embeds, vectors), dim=-1)  # [B, L, 2d]
        return self.projection(widened.to(weight.dtype)).to(inputs_embeds.dtype)  # [B, L, d]

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, combine='concat'"
