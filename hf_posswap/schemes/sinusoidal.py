"""Fixed sinusoidal absolute positions (Vaswani et al. 2017, "Attention Is All You Need", §3.5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import (
    AbsolutePositions,
    ConcatPositions,
    ModelSpec,
    SchemeConfig,
    register_scheme,
    require_combine,
    require_frequency_base,
    require_positive,
)


def sinusoidal_table(position_ids: torch.Tensor, hidden_size: int, base: float) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(pos / base^(2i/d)) (Vaswani et al. 2017, §3.5).

    position_ids [...] -> [..., hidden_size] in float32; an odd ``hidden_size`` drops the last cosine.
    """
    exponents = torch.arange(0, hidden_size, 2, dtype=torch.float32, device=position_ids.device) / hidden_size
    inv_freq = base ** (-exponents)  # [ceil(d/2)]
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [..., ceil(d/2)]
    table = torch.stack((angles.sin(), angles.cos()), dim=-1)  # [..., ceil(d/2), 2] -> interleave sin, cos
    return table.flatten(-2)[..., :hidden_size]


class SinusoidalPositions(AbsolutePositions):
    """Computes the sinusoidal vectors on the fly, so there is no length limit and nothing to train."""

    def __init__(self, hidden_size: int, base: float) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.base = base

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        # [B, L] -> [B, L, hidden]
        return sinusoidal_table(position_ids, self.hidden_size, self.base).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, base={self.base}"


@register_scheme
@dataclass
class SinusoidalConfig(SchemeConfig):
    """The fixed sin/cos table of Vaswani et al. 2017, added to the token embeddings.

    Args:
        base: the wavelength base (10000 in the paper).
        combine: ``"add"`` (default, as in the paper) or ``"concat"``: concatenated with the token embeddings and
            projected back to the hidden size by a learned map that starts as plain addition
            (:class:`~hf_posswap.schemes.base.ConcatPositions`).
    """

    name = "sinusoidal"
    kind = "absolute"
    paper = "Vaswani et al. 2017, Attention Is All You Need (arXiv:1706.03762)"

    base: float = 10_000.0
    combine: str = "add"

    def validate(self) -> None:
        require_positive("SinusoidalConfig", "base", self.base)
        require_frequency_base("SinusoidalConfig", "base", self.base)
        require_combine("SinusoidalConfig", self.combine)

    def build(self, spec: ModelSpec) -> SinusoidalPositions | ConcatPositions:
        # vectors come out in the model's dtype: fp16/bf16 embeddings plus float32 vectors would turn the hidden
        # states float32 and break the model's half-precision layers
        vectors = SinusoidalPositions(spec.hidden_size, float(self.base)).to(dtype=spec.dtype)
        if self.combine == "concat":
            return ConcatPositions(vectors, spec.hidden_size).to(dtype=spec.dtype, device=spec.device)
        return vectors
