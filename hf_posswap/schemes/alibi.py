"""ALiBi: attention with linear biases (Press et al. 2022, "Train Short, Test Long", arXiv:2108.12409)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .base import (
    BiasPositions,
    FlexBias,
    FlexSpec,
    FusedCall,
    ModelSpec,
    SchemeConfig,
    register_scheme,
    require_bool,
    spread,
)
from .fused_alibi import alibi_attention
from .precision import exact_buffer


def alibi_slopes(num_heads: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Head slopes m_h of Press et al. 2022, §3 and their reference code.

    For n a power of two: the geometric sequence starting at and with ratio 2^(-8/n). Otherwise: the slopes for the
    closest smaller power of two p, followed by every other slope of the 2p sequence until n slopes exist.
    Returns [num_heads] in ``dtype`` (computed in Python's float64, then rounded once).
    """

    def power_of_two_slopes(n: int) -> list[float]:
        ratio = 2.0 ** (-8.0 / n)
        return [ratio ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two_slopes(closest)
    if closest != num_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=dtype)


class AlibiBias(BiasPositions):
    """bias[h, i, j] = -m_h * (i - j) for causal attention (keys at or before the query), and the symmetric
    -m_h * |i - j| for bidirectional (encoder) attention."""

    fused_min_queries = 1
    fused_path = "fused-alibi"

    def __init__(self, slopes: torch.Tensor, trainable: bool) -> None:
        super().__init__()
        if trainable:
            self.slopes = nn.Parameter(slopes)
        else:
            self.register_buffer("slopes", slopes)

    def exact_slopes(self) -> torch.Tensor:
        """The slopes the bias uses, float32 (float64 in a float64 model): trainable ones as trained; fixed ones as
        stored, except values that are Press et al.'s rounded by a cast after the swap (``model.to(torch.bfloat16)``
        moves them by up to 0.4 %: two logits at a distance of 2,047), which get the exact ones
        (:func:`~hf_posswap.schemes.precision.exact_buffer`)."""
        if isinstance(self.slopes, nn.Parameter) or self.slopes.requires_grad:
            return self.slopes.to(torch.float64 if self.slopes.dtype == torch.float64 else torch.float32)
        return exact_buffer(self, "slopes", lambda: alibi_slopes(self.slopes.shape[0], torch.float64))

    def forward(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, layer_idx: int, causal: bool, memo: dict | None = None
    ) -> torch.Tensor:
        # query_pos [q], key_pos [kv] -> [1, H, q, kv]  (or [B, q], [B, kv] -> [B, H, q, kv])
        # float32 at least (half-precision slopes would round the distances), float64 for a float64 model
        slopes = self.exact_slopes()
        distance = (key_pos[..., None, :] - query_pos[..., :, None]).to(slopes.dtype)  # [..., q, kv], j - i
        if not causal:
            distance = -distance.abs()
        bias = slopes[:, None, None] * distance.unsqueeze(-3)  # -m (i - j): [..., H, q, kv]
        return bias if bias.dim() == 4 else bias.unsqueeze(0)

    def fused_attention(self, call: FusedCall) -> torch.Tensor | None:
        """Attention without the dense bias (``fused_alibi``): the separable form when causal, a strided Toeplitz
        view of the bias when bidirectional (half precision on CPU too); None (dense path) for half precision on
        other devices and layouts it does not handle."""
        return alibi_attention(call, self.exact_slopes(), self)

    def flex_bias(self, spec: FlexSpec) -> FlexBias:
        """``m_h (j - i)``, or ``-m_h |j - i|`` when bidirectional, elementwise (as :meth:`forward`, float32)."""
        slopes = spread(self.exact_slopes().to(torch.float32), spec.lanes)  # [H, lanes]; trainable: with graph

        def causal_bias(head: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                        lane: torch.Tensor) -> torch.Tensor:
            return slopes[head, lane] * (key_pos - query_pos).to(torch.float32)

        def symmetric_bias(head: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                           lane: torch.Tensor) -> torch.Tensor:
            return -slopes[head, lane] * (key_pos - query_pos).abs().to(torch.float32)

        return causal_bias if spec.causal else symmetric_bias

    def extra_repr(self) -> str:
        return f"num_heads={self.slopes.shape[0]}, trainable={isinstance(self.slopes, nn.Parameter)}"


@register_scheme
@dataclass
class AlibiConfig(SchemeConfig):
    """Linear biases on attention logits, one slope per head; no position vectors anywhere.

    Causal models get the paper's causal form; encoders the symmetric ``-m·|i-j|`` form.

    Args:
        trainable_slopes: make the slopes a trainable parameter (the paper keeps them fixed).
    """

    name = "alibi"
    kind = "bias"
    paper = "Press et al. 2022, Train Short, Test Long (arXiv:2108.12409)"

    trainable_slopes: bool = False

    def validate(self) -> None:
        require_bool("AlibiConfig", "trainable_slopes", self.trainable_slopes)

    def build(self, spec: ModelSpec) -> AlibiBias:
        dtype = torch.float64 if spec.dtype == torch.float64 else torch.float32  # half precision rounds slopes
        return AlibiBias(alibi_slopes(spec.num_heads, dtype).to(spec.device), self.trainable_slopes)
