"""Sandwich (Chi et al. 2023, "Dissecting Transformer Length Extrapolation via the Lens of Receptive Field
Analysis", ACL 2023, arXiv:2212.10356): the inner product of two sinusoidal position embeddings, used as a
parameter-free attention-logit bias.

With sinusoidal embeddings p_m of dimension d̄ (frequencies w_k = base^(-2k/d̄), k = 1..d̄/2),
``p_i · p_j = sum_k cos((i - j) * w_k)``: a function of the distance alone, equal to d̄/2 at distance 0 and
decaying (logarithmically, the paper's receptive-field argument) with distance. Per head h = 1..H it is shifted
so the diagonal is 0 and compressed with ALiBi's head-dependent ratio 8h/H (the paper's Figure 1 and §5):

    bias[h, i, j] = (sum_{k=1}^{d̄/2} cos((i - j) / base^(2k/d̄)) - d̄/2) / (8h / H)

(the -d̄/2 shift is the same for every key of a row, so it changes no attention weight; it keeps the bias <= 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidConfigError
from .base import BiasPositions, FlexBias, FlexSpec, ModelSpec, SchemeConfig, register_scheme, require_frequency_base
from .kept_rows import kept_row


def sandwich_distance_table(count: int, dim: int, base: float, num_heads: int, device: torch.device) -> torch.Tensor:
    """The bias for distances 0..count-1 per head: [num_heads, count] float32 (formula in the module docstring)."""
    return sandwich_bias_at(torch.arange(count, device=device), dim, base, num_heads)


def sandwich_bias_at(distance: torch.Tensor, dim: int, base: float, num_heads: int) -> torch.Tensor:
    """The bias at the distances ``distance`` [n] (>= 0) per head: [num_heads, n] float32.

    Computed in float64 where the device has it: the angles ``distance * w_k`` of long contexts lose digits in
    float32."""
    device = distance.device
    wide = torch.float64 if device.type != "mps" else torch.float32
    k = torch.arange(1, dim // 2 + 1, dtype=wide, device=device)
    inv_freq = base ** (-2.0 * k / dim)  # [d̄/2]
    inner = torch.cos(distance.to(wide)[:, None] * inv_freq[None, :]).sum(-1) - dim / 2  # p_i·p_j - d̄/2: [n]
    compression = torch.arange(1, num_heads + 1, dtype=wide, device=device) * 8.0 / num_heads  # 8h/H: [H]
    return (inner[None, :] / compression[:, None]).to(torch.float32)


def _compiled_bias(query_pos: torch.Tensor, key_pos: torch.Tensor, dim: int, base: float,
                   num_heads: int) -> torch.Tensor:
    """The bias [H, q, kv] of index positions (runs of consecutive integers, [q] and [kv]) without reading them, for
    ``torch.compile`` (sizing a table by the largest distance would break the graph): their q + kv - 1 differences
    i - j are the consecutive integers from query_pos[0] - key_pos[-1] up, so a table over those is exact."""
    lowest = query_pos[0] - key_pos[-1]  # the smallest i - j
    signed = lowest + torch.arange(query_pos.shape[0] + key_pos.shape[0] - 1, device=query_pos.device)  # every i - j
    table = sandwich_bias_at(signed.abs(), dim, base, num_heads)  # [H, q + kv - 1]
    return table[:, query_pos[:, None] - key_pos[None, :] - lowest]  # [H, q, kv]


class SandwichBias(BiasPositions):
    """Parameter-free: nothing to train or save; the bias is computed for the distances each call needs."""

    def __init__(self, num_heads: int, dim: int, base: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dim = dim
        self.base = base

    def forward(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, layer_idx: int, causal: bool, memo: dict | None = None
    ) -> torch.Tensor:
        # query_pos [q], key_pos [kv] -> [1, H, q, kv]  (or [B, q], [B, kv] -> [B, H, q, kv])
        # cos is even: the bias is symmetric, so causal and bidirectional attention use the same |i - j|
        if torch.compiler.is_compiling() and query_pos.dim() == 1:
            return _compiled_bias(query_pos, key_pos, self.dim, self.base, self.num_heads).unsqueeze(0)
        distance = (query_pos[..., :, None] - key_pos[..., None, :]).abs().long()  # [..., q, kv]
        table = sandwich_distance_table(int(distance.max()) + 1, self.dim, self.base, self.num_heads,
                                        distance.device)  # [H, max distance + 1]
        bias = table[:, distance]  # [H, ..., q, kv]
        return bias.movedim(0, -3) if bias.dim() == 4 else bias.unsqueeze(0)

    def flex_bias(self, spec: FlexSpec) -> FlexBias:
        """The distance table gathered at ``|i - j|``, elementwise: a row ``[H, 2 span + 1]`` over relative positions
        -span .. span (span >= reach), kept on the module across calls (:mod:`~hf_posswap.schemes.kept_rows`; it
        depends on nothing trainable), so its shape changes only when a longer input doubles it."""

        def build(relative: torch.Tensor) -> torch.Tensor:  # [2 span + 1] -> [H, 2 span + 1]
            span = int(relative[-1])
            table = sandwich_distance_table(span + 1, self.dim, self.base, self.num_heads, relative.device)
            return table[:, relative.abs()]

        row, span = kept_row(self, "sandwich-flex", None, spec.reach, build, torch.device(spec.device))

        def bias(head: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                 lane: torch.Tensor) -> torch.Tensor:
            return row[head, (key_pos - query_pos).clamp(-span, span) + span]

        return bias

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, dim={self.dim}, base={self.base}"


@register_scheme
@dataclass
class SandwichConfig(SchemeConfig):
    """Sandwich: a parameter-free logit bias, the inner product of sinusoidal embeddings of i and j per head.

    Exactly, for head h = 1..H (shared by all layers; causal and bidirectional attention get the same symmetric
    bias): ``bias[h, i, j] = (sum_{k=1}^{dim/2} cos((i - j) / base^(2k/dim)) - dim/2) / (8h / H)``, the paper's
    p_i·p_j shifted to 0 at i = j and divided by ALiBi's head-dependent compression ratio 8h/H.

    Initialisation: none, there are no parameters; the bias is the paper's from the first step.

    Args:
        dim: d̄, the dimension of the sinusoidal embeddings whose inner product is taken (a hyperparameter of the
            paper, independent of the model's widths); even.
        base: the sinusoids' frequency base (10000 as in Vaswani et al. and the paper).
    """

    name = "sandwich"
    kind = "bias"
    paper = "Chi et al. 2023, Sandwich (arXiv:2212.10356)"

    dim: int = 128
    base: float = 10000.0

    def validate(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 2 or self.dim % 2:
            raise InvalidConfigError(
                f"SandwichConfig.dim must be an even integer >= 2 (the sinusoidal embedding's d̄: sin/cos pairs), "
                f"got {self.dim!r}. Use dim=128, the default."
            )
        if isinstance(self.base, bool) or not isinstance(self.base, (int, float)):
            raise InvalidConfigError(f"SandwichConfig.base must be a number, got {self.base!r}. Use base=10000.0.")
        require_frequency_base("SandwichConfig", "base", self.base)

    def build(self, spec: ModelSpec) -> SandwichBias:
        return SandwichBias(spec.num_heads, self.dim, float(self.base))
