"""Rotary position embeddings (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding").

Layout: Hugging Face's rotate-half pairing (dimension i pairs with i + d/2), the layout of every HF LLaMA-like
checkpoint. Frequencies: inv_freq_i = theta^(-2i/d) for i < d/2 (RoFormer eq. 15), d = head_dim * partial_rotary_factor.
"""

from __future__ import annotations

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
    require_positive,
)

DEFAULT_ROPE_THETA = 10_000.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: (x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` [B, H, L, D] by cos/sin [L, r]; the rest pass through."""
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotated = rotated * cos + rotate_half(rotated) * sin
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated


def rotary_dim_for(head_dim: int, partial_rotary_factor: float) -> int:
    """Number of rotated dims, rounded down to even (as transformers does for partial rotary)."""
    dim = int(head_dim * partial_rotary_factor)
    return dim - dim % 2


class RotaryEmbedding(RotaryPositions):
    """cos/sin of ``position * inv_freq`` for the rotate-half layout, applied inside attention."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
        self.attention_scaling = attention_scaling
        self.rotary_dim = 2 * inv_freq.shape[0]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [P] -> cos, sin [P, rotary_dim] (float32)
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]  # [P, r/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [P, r]
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, attention_scaling={self.attention_scaling}"


def default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    """inv_freq_i = theta^(-2i/d), i = 0..d/2-1 (Su et al. 2021, eq. 15)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


@register_scheme
@dataclass
class RopeConfig(SchemeConfig):
    """Rotary position embeddings.

    Args:
        rope_theta: the frequency base. ``None`` keeps the model's own base when it has RoPE, else 10000.
        partial_rotary_factor: fraction of each head's dims that are rotated (the rest carry no position).
    """

    name = "rope"
    kind = "rotary"
    paper = "Su et al. 2021, RoFormer (arXiv:2104.09864)"

    rope_theta: float | None = None
    partial_rotary_factor: float = 1.0

    def validate(self) -> None:
        if self.rope_theta is not None:
            require_positive("RopeConfig", "rope_theta", self.rope_theta)
        require_fraction("RopeConfig", "partial_rotary_factor", self.partial_rotary_factor)

    def resolve(self, spec: ModelSpec) -> RopeConfig:
        theta = self.rope_theta
        if theta is None:
            theta = spec.native_rope_theta if spec.native_rope_theta is not None else DEFAULT_ROPE_THETA
        return RopeConfig(rope_theta=float(theta), partial_rotary_factor=float(self.partial_rotary_factor))

    def rope_parameters(self) -> dict[str, Any]:
        """The ``config.rope_parameters`` dict transformers uses for this RoPE."""
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.partial_rotary_factor != 1.0:
            params["partial_rotary_factor"] = self.partial_rotary_factor
        return params

    def build(self, spec: ModelSpec) -> RotaryEmbedding:
        rotary_dim = rotary_dim_for(spec.head_dim, self.partial_rotary_factor)
        if rotary_dim < 2:
            raise InvalidConfigError(
                f"RopeConfig.partial_rotary_factor={self.partial_rotary_factor} rotates {rotary_dim} of "
                f"{spec.head_dim} head dims; at least 2 are needed. Use a larger factor."
            )
        inv_freq = default_inv_freq(float(self.rope_theta or DEFAULT_ROPE_THETA), rotary_dim)
        return RotaryEmbedding(inv_freq.to(spec.device))
