"""KERPLE: kernelized relative positional embedding (Chi et al. 2022, "KERPLE: Kernelized Relative Positional
Embedding for Length Extrapolation", NeurIPS 2022, arXiv:2205.09921).

A learned, conditionally positive definite kernel of the distance, added to the attention logits, per head h:

- log variant:   ``bias[h, i, j] = -r1_h * log(1 + r2_h * |i - j|)``
- power variant: ``bias[h, i, j] = -r1_h * |i - j| ** r2_h``  with ``0 < r2_h <= 2``

(the paper's constant r3 shifts every logit of a row equally and cancels in the softmax, so it is left out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..errors import InvalidConfigError
from .base import BiasPositions, FlexBias, FlexSpec, ModelSpec, SchemeConfig, register_scheme, spread

KERPLE_VARIANTS = ("log", "power")
#: the authors' floor on r1, r2 (their code clamps both to >= 1e-2 after every step)
KERPLE_FLOOR = 1e-2
#: the power variant's exponent stays in (0, 2]: -|x|^p is conditionally positive definite only there
KERPLE_MAX_POWER = 2.0


def kerple_initial_values(num_heads: int, variant: str, generator: torch.Generator | None = None) -> tuple:
    """The authors' initialisation (chijames/KERPLE, megatron/mpu/layers.py): per head, uniform draws.

    log:   r1 ~ U(0, 2), r2 ~ U(0, 1);  power: r1 ~ U(0, 1), r2 ~ U(0, 2); all clamped to >= 1e-2 as their code
    does (and the power exponent to < 2 so its logit stays finite). Returns (r1, r2), each [num_heads] float32.
    """
    first = torch.rand(num_heads, generator=generator, dtype=torch.float32)
    second = torch.rand(num_heads, generator=generator, dtype=torch.float32)
    if variant == "log":
        r1, r2 = 2.0 * first, second
    else:
        r1, r2 = first, (2.0 * second).clamp(max=KERPLE_MAX_POWER - KERPLE_FLOOR)
    return r1.clamp(min=KERPLE_FLOOR), r2.clamp(min=KERPLE_FLOOR)


class KerpleBias(BiasPositions):
    """Per-head learnable r1, r2, stored unconstrained so they stay in range under any optimiser step:
    ``r1 = exp(raw_r1)``; log variant ``r2 = exp(raw_r2)``; power variant ``r2 = 2 * sigmoid(raw_r2)``."""

    def __init__(self, r1: torch.Tensor, r2: torch.Tensor, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.raw_r1 = nn.Parameter(r1.log())
        if variant == "log":
            self.raw_r2 = nn.Parameter(r2.log())
        else:
            self.raw_r2 = nn.Parameter(torch.logit(r2 / KERPLE_MAX_POWER))

    def compute_dtype(self) -> torch.dtype:
        """float64 for a model cast to float64, else float32 (whatever half precision the model runs in)."""
        return torch.float64 if self.raw_r1.dtype == torch.float64 else torch.float32

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(r1, r2), each [H] in :meth:`compute_dtype`, computed from the stored parameters."""
        r1 = self.raw_r1.to(self.compute_dtype()).exp()
        raw_r2 = self.raw_r2.to(self.compute_dtype())
        r2 = raw_r2.exp() if self.variant == "log" else KERPLE_MAX_POWER * torch.sigmoid(raw_r2)
        return r1, r2

    def forward(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, layer_idx: int, causal: bool, memo: dict | None = None
    ) -> torch.Tensor:
        # query_pos [q], key_pos [kv] -> [1, H, q, kv]  (or [B, q], [B, kv] -> [B, H, q, kv])
        distance = (query_pos[..., :, None] - key_pos[..., None, :]).to(self.compute_dtype())  # i - j: [..., q, kv]
        # causal: keys after the query are masked anyway; 0 keeps their (discarded) values finite
        distance = distance.clamp(min=0) if causal else distance.abs()
        distance = distance.unsqueeze(-3)  # [..., 1, q, kv]
        r1, r2 = (value[:, None, None] for value in self.coefficients())  # [H, 1, 1]
        if self.variant == "log":
            bias = -r1 * torch.log1p(r2 * distance)
        else:
            bias = -r1 * distance.pow(r2)
        return bias if bias.dim() == 4 else bias.unsqueeze(0)

    def flex_bias(self, spec: FlexSpec) -> FlexBias:
        """The kernel of :meth:`forward`, elementwise (float32). The power variant reads ``|i - j| ** r2`` through
        a base of 1 at distance 0 (then masked to 0, the value ``0 ** r2`` has): ``d/dr2 0 ** r2 = 0 * log 0`` would
        be NaN in a compiled backward, while the dense path's ``pow`` backward returns 0 there."""
        r1, r2 = (spread(value, spec.lanes) for value in self.coefficients())  # [H, lanes] each, with their graph
        causal = spec.causal

        def distance_of(query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
            distance = (query_pos - key_pos).to(torch.float32)  # i - j
            return distance.clamp(min=0) if causal else distance.abs()

        def log_bias(head: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                     lane: torch.Tensor) -> torch.Tensor:
            return -r1[head, lane] * torch.log1p(r2[head, lane] * distance_of(query_pos, key_pos))

        def power_bias(head: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                       lane: torch.Tensor) -> torch.Tensor:
            distance = distance_of(query_pos, key_pos)
            away = distance > 0
            powered = torch.pow(torch.where(away, distance, torch.ones_like(distance)), r2[head, lane])
            return torch.where(away, -r1[head, lane] * powered, torch.zeros_like(powered))

        return log_bias if self.variant == "log" else power_bias

    def extra_repr(self) -> str:
        return f"variant={self.variant!r}, num_heads={self.raw_r1.shape[0]}"


@register_scheme
@dataclass
class KerpleConfig(SchemeConfig):
    """KERPLE's learnable kernel biases on the attention logits, one (r1, r2) pair per head, shared by all layers.

    Causal models get ``|i - j| = i - j`` for keys at or before the query (the paper's setting); encoders the
    symmetric ``|i - j|`` in both directions, as the kernel is defined on the absolute distance.

    Initialisation: the authors' (uniform per-head draws, see :func:`kerple_initial_values`), not zero. With
    r1 = 0 the bias would be zero but r2 would get no gradient; the authors' draws give every head a different
    decay from the first step, which is what replaces the positions the swap removed (as ALiBi's fixed slopes
    do), so a swapped model keeps a recency preference instead of losing all order information.

    Args:
        variant: ``"log"`` (``-r1·log(1 + r2·|i-j|)``, the paper's best) or ``"power"`` (``-r1·|i-j|^r2``).
    """

    name = "kerple"
    kind = "bias"
    paper = "Chi et al. 2022, KERPLE (arXiv:2205.09921)"

    variant: Literal["log", "power"] = "log"

    def validate(self) -> None:
        if self.variant not in KERPLE_VARIANTS:
            raise InvalidConfigError(
                f"KerpleConfig.variant must be one of {', '.join(map(repr, KERPLE_VARIANTS))}, got "
                f"{self.variant!r}. Use variant='log' (-r1*log(1+r2*|i-j|), the paper's default) or "
                "variant='power' (-r1*|i-j|**r2)."
            )

    def build(self, spec: ModelSpec) -> KerpleBias:
        r1, r2 = kerple_initial_values(spec.num_heads, self.variant)
        module = KerpleBias(r1, r2, self.variant)
        return module.to(device=spec.device, dtype=spec.dtype)

