"""Rotary position embeddings (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding").

Layout: Hugging Face's rotate-half pairing (dimension i pairs with i + d/2), the layout of every HF LLaMA-like
checkpoint. Frequencies: inv_freq_i = theta^(-2i/d) for i < d/2 (RoFormer eq. 15), d = head_dim * partial_rotary_factor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidConfigError
from .base import (
    ModelSpec,
    RotaryPositions,
    SchemeConfig,
    register_scheme,
    require_fraction,
    require_frequency_base,
    require_positive,
)
from .precision import exact_buffer
from .rope_scaling import LongRopeScaling, RopeScaling, scaling_from_dict

DEFAULT_ROPE_THETA = 10_000.0
#: rope types whose frequencies depend on the current sequence length
LENGTH_DEPENDENT_TYPES = ("dynamic", "longrope")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: (x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` [B, H, L, D] by cos/sin [L, r] (or [B, L, r]); the rest
    pass through."""
    rotary_dim = cos.shape[-1]
    if cos.dim() == 3:  # per-row positions [B, L, r] -> [B, 1, L, r] (broadcast over heads)
        cos, sin = cos[:, None], sin[:, None]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotated = rotated * cos + rotate_half(rotated) * sin
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated


def rotary_dim_for(head_dim: int, partial_rotary_factor: float) -> int:
    """Number of rotated dims, rounded down to even (as transformers does for partial rotary)."""
    dim = int(head_dim * partial_rotary_factor)
    return dim - dim % 2


class RotaryEmbedding(RotaryPositions):
    """cos/sin of ``position * inv_freq`` for the rotate-half layout, applied inside attention.

    Frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` for ``rope_parameters``. ``inv_freq`` is a
    persistent buffer, so checkpoints carry it. Length-dependent scalings (dynamic NTK, LongRoPE) recompute the
    frequencies for the current sequence length on every forward; queries and all cached keys are rotated with
    the same frequencies, so cached generation equals a full recompute.
    """

    def __init__(self, rope_parameters: dict[str, Any], head_dim: int, original_length: int) -> None:
        super().__init__()
        self.rope_parameters = dict(rope_parameters)
        self.head_dim = head_dim
        self.original_length = original_length  # dynamic NTK and LongRoPE switch at this length
        inv_freq, self.attention_scaling = self._init(None, None)
        check_frequencies(inv_freq, self.rope_parameters)
        self.register_buffer("inv_freq", inv_freq.to(torch.float32))
        self.rotary_dim = 2 * inv_freq.shape[0]
        self._length_cache: tuple[int, torch.device, torch.Tensor, float] | None = None

    @property
    def rope_type(self) -> str:
        return self.rope_parameters["rope_type"]

    @property
    def length_dependent(self) -> bool:
        """Whether the rotation of a position changes with the current length (dynamic NTK, LongRoPE): keys then
        cannot be stored rotated in a KV cache."""
        return self.rope_type in LENGTH_DEPENDENT_TYPES

    def _init(self, device: torch.device | None, seq_len: int | None) -> tuple[torch.Tensor, float]:
        if self.rope_type == "default":
            rotary_dim = rotary_dim_for(self.head_dim, self.rope_parameters.get("partial_rotary_factor", 1.0))
            return default_inv_freq(self.rope_parameters["rope_theta"], rotary_dim).to(device), 1.0
        from ..transformers_internals import rope_init_functions

        view = _RopeConfigView(self.rope_parameters, self.head_dim, self.original_length)
        inv_freq, scaling = rope_init_functions()[self.rope_type](view, device, seq_len=seq_len)
        return inv_freq, float(scaling)

    def frequencies(self, seq_len: int | None, device: torch.device) -> tuple[torch.Tensor, float]:
        """inv_freq [rotary_dim / 2] and the attention factor for the current sequence length."""
        if not self.length_dependent or seq_len is None or seq_len <= self.original_length:
            # at or below L0: exactly the unscaled values (recomputed: a cast may have rounded the buffer)
            inv_freq = exact_buffer(self, "inv_freq", lambda: self._init(None, None)[0])
            return inv_freq.to(device), self.attention_scaling
        key = seq_len if self.rope_type == "dynamic" else self.original_length + 1  # longrope: one long set
        kept = self._length_cache  # one read: another thread may replace it meanwhile (for another length)
        if kept is None or kept[:2] != (key, device):
            inv_freq, scaling = self._init(device, key)
            kept = self._length_cache = (key, device, inv_freq.to(device, torch.float32), scaling)
        return kept[2], kept[3]

    def forward(self, positions: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [P] or [B, P] -> cos, sin [..., P, rotary_dim] (float32); seq_len: the current length
        inv_freq, scaling = self.frequencies(seq_len, positions.device)
        freqs = positions.to(torch.float32)[..., None] * inv_freq  # [..., P, r/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [P, r]
        return angles.cos() * scaling, angles.sin() * scaling

    def extra_repr(self) -> str:
        return (
            f"rope_type={self.rope_type}, rotary_dim={self.rotary_dim}, attention_scaling={self.attention_scaling:.4g}"
        )


def check_frequencies(inv_freq: torch.Tensor, rope_parameters: dict[str, Any]) -> None:
    """Refuse frequencies that are not finite and positive (e.g. an NTK base that overflowed): they give NaN.
    Proportional RoPE sets its lowest frequencies to exactly 0 on purpose (those pairs are not rotated)."""
    if inv_freq.is_meta:  # replayed inside from_pretrained: the values were checked when the swap was made
        return
    inv_freq = inv_freq.to(torch.float32)
    rotated = inv_freq[inv_freq != 0] if rope_parameters.get("rope_type") == "proportional" else inv_freq
    if not bool(torch.isfinite(inv_freq).all()) or not rotated.numel() or not bool((rotated > 0).all()):
        raise InvalidConfigError(
            f"RoPE parameters {rope_parameters} give frequencies from {float(inv_freq.min()):.3g} to "
            f"{float(inv_freq.max()):.3g}; all must be finite and above 0 in float32. Use a smaller rope_theta or "
            "scaling factor."
        )


class _RopeConfigView:
    """The attributes transformers' ``ROPE_INIT_FUNCTIONS`` read from a model config."""

    def __init__(self, rope_parameters: dict[str, Any], head_dim: int, max_position_embeddings: int) -> None:
        self.rope_parameters = rope_parameters
        self.head_dim = head_dim
        self.hidden_size = head_dim
        self.num_attention_heads = 1
        self.max_position_embeddings = max_position_embeddings

    def standardize_rope_params(self) -> None:
        """Already standard."""


def default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    """inv_freq_i = theta^(-2i/d), i = 0..d/2-1 (Su et al. 2021, eq. 15)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


@register_scheme
@dataclass
class RopeConfig(SchemeConfig):
    """Rotary position embeddings, optionally scaled for longer contexts.

    Args:
        rope_theta: the frequency base. ``None`` keeps the model's own base when it has RoPE, else 10000.
        partial_rotary_factor: fraction of each head's dims that are rotated (the rest carry no position).
        scaling: a :class:`~hf_posswap.schemes.rope_scaling.RopeScaling` (``YarnScaling(factor=4.0)``, ...) or
            ``None``. Its ``original_max_position_embeddings`` defaults to the model's trained length. ``None`` on
            a LLaMA-like model whose ``rope_parameters`` carry a scaling (``llama3``, ``yarn``, ...) keeps that
            scaling, as ``rope_theta=None`` keeps the base.
    """

    name = "rope"
    kind = "rotary"
    paper = "Su et al. 2021, RoFormer (arXiv:2104.09864)"

    rope_theta: float | None = None
    partial_rotary_factor: float = 1.0
    scaling: RopeScaling | None = None

    def validate(self) -> None:
        if self.rope_theta is not None:
            require_positive("RopeConfig", "rope_theta", self.rope_theta)
            require_frequency_base("RopeConfig", "rope_theta", self.rope_theta)
        require_fraction("RopeConfig", "partial_rotary_factor", self.partial_rotary_factor)
        if isinstance(self.scaling, dict):
            self.scaling = scaling_from_dict(self.scaling)
        if self.scaling is not None and not isinstance(self.scaling, RopeScaling):
            raise InvalidConfigError(
                f"RopeConfig.scaling must be a RopeScaling such as hf_posswap.YarnScaling(factor=4.0) or None, "
                f"got {self.scaling!r}."
            )

    @property
    def rotates_full_head(self) -> bool:
        """Whether cos/sin span the whole head, as LLaMA's ``apply_rotary_pos_emb`` needs (partial RoPE does not)."""
        return self.partial_rotary_factor == 1.0

    def resolve(self, spec: ModelSpec) -> RopeConfig:
        theta = self.rope_theta
        if theta is None:
            theta = spec.native_rope_theta if spec.native_rope_theta is not None else DEFAULT_ROPE_THETA
        scaling = self.scaling
        if scaling is not None:
            if spec.max_positions is None and scaling.original_max_position_embeddings is None:
                raise InvalidConfigError(
                    f"{type(scaling).__name__}.original_max_position_embeddings is needed: the model declares no "
                    "trained length."
                )
            scaling = scaling.with_original(spec.max_positions)  # type: ignore[arg-type]
            if isinstance(scaling, LongRopeScaling):
                scaling.check_dim(rotary_dim_for(spec.head_dim, self.partial_rotary_factor))
        return dataclasses.replace(
            self, rope_theta=float(theta), partial_rotary_factor=float(self.partial_rotary_factor), scaling=scaling
        )

    @property
    def original_length(self) -> int | None:
        return self.scaling.original_max_position_embeddings if self.scaling is not None else None

    def rope_parameters(self, head_dim: int) -> dict[str, Any]:
        """The ``config.rope_parameters`` dict transformers uses for this RoPE."""
        theta = float(self.rope_theta or DEFAULT_ROPE_THETA)
        if self.scaling is None:
            params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
        else:
            params = self.scaling.rope_parameters(theta, rotary_dim_for(head_dim, self.partial_rotary_factor))
        if self.partial_rotary_factor != 1.0:
            params["partial_rotary_factor"] = self.partial_rotary_factor
        if params["rope_theta"] != theta:  # static NTK raises the base: it must stay usable too
            owner = f"RopeConfig (with {type(self.scaling).__name__})"
            require_frequency_base(owner, "rope_theta", params["rope_theta"])
        return params

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["scaling"] = self.scaling.to_dict() if self.scaling is not None else None
        return data

    def build(self, spec: ModelSpec) -> RotaryEmbedding:
        rotary_dim = rotary_dim_for(spec.head_dim, self.partial_rotary_factor)
        if rotary_dim < 2:
            raise InvalidConfigError(
                f"RopeConfig.partial_rotary_factor={self.partial_rotary_factor} rotates {rotary_dim} of "
                f"{spec.head_dim} head dims; at least 2 are needed. Use a larger factor."
            )
        # dynamic NTK measures length against the original length (transformers uses max_position_embeddings)
        length = self.original_length or spec.max_positions or 2048
        return RotaryEmbedding(self.rope_parameters(spec.head_dim), spec.head_dim, length).to(spec.device)
