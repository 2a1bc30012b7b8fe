"""FIRE: functional interpolation for relative positions (Li et al. 2024, "Functional Interpolation for Relative
Positions Improves Long Context Transformers", ICLR 2024, arXiv:2310.04418).

A small learned MLP f: R -> R^H reads the log-transformed distance, normalised by the log-transformed query
position (progressive interpolation: every distance a query can see maps into [0, 1]), per head h:

    bias[h, i, j] = f( psi(i - j) / psi(max(i, L)) )_h,   psi(x) = log(c * x + 1)

with learnable c (init 0.1) and threshold L (init 512, learned as a multiplier of its initial value, as in the
paper's pseudocode); L keeps short prefixes from being stretched over the whole [0, 1] range. A small eps (1e-6)
keeps the normaliser away from 0, as the paper's code does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InvalidConfigError
from .base import (
    BiasPositions,
    FlexBias,
    FlexSpec,
    ModelSpec,
    SchemeConfig,
    register_scheme,
    require_bool,
    require_int_at_least,
    spread,
)

FIRE_EPS = 1e-6


class FireFunction(nn.Module):
    """One FIRE bias function: the MLP ``1 -> width -> ReLU -> H`` and the scalars c, L."""

    def __init__(self, num_heads: int, width: int, init_c: float, init_threshold: float) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(1, width), nn.ReLU(), nn.Linear(width, num_heads))
        nn.init.zeros_(self.mlp[2].weight)  # the bias starts at exactly 0 (see FireConfig)
        nn.init.zeros_(self.mlp[2].bias)
        self.c = nn.Parameter(torch.tensor(float(init_c)))
        self.threshold_scale = nn.Parameter(torch.tensor(1.0))  # L = |threshold_scale * initial L|
        self.initial_threshold = float(init_threshold)  # from the config: nothing to save

    def compute_dtype(self) -> torch.dtype:
        """float64 for a model cast to float64, else float32 (whatever half precision the model runs in)."""
        return torch.float64 if self.c.dtype == torch.float64 else torch.float32

    def scalars(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(c, L) as 0-dim tensors in :meth:`compute_dtype`, L = |threshold_scale * initial L|; both keep their
        graph. (0-dim also while DeepSpeed trains the parameters held as shape [1]: see
        hf_posswap.training.deepspeed_config.)"""
        dtype = self.compute_dtype()
        threshold = (self.threshold_scale.to(dtype).reshape(()) * self.initial_threshold).abs()
        return self.c.to(dtype).reshape(()), threshold

    def normalized_distance(self, query_pos: torch.Tensor, key_pos: torch.Tensor, causal: bool) -> torch.Tensor:
        """psi(i - j) / psi(max(i, L)): [..., q, kv] in :meth:`compute_dtype`. Causal: keys after the query (masked
        anyway) read distance 0. Bidirectional: the sign of i - j is kept, so f can tell keys before from keys
        after."""
        query = query_pos.to(self.compute_dtype())[..., :, None]  # [..., q, 1]
        key = key_pos.to(self.compute_dtype())[..., None, :]  # [..., 1, kv]
        return fire_normalized(query, key, *self.scalars(), causal)

    def forward(self, query_pos: torch.Tensor, key_pos: torch.Tensor, causal: bool) -> torch.Tensor:
        # -> [..., H, q, kv] float32 whatever half precision the model was cast to (float64 in a float64 model)
        dtype = self.compute_dtype()
        x = self.normalized_distance(query_pos, key_pos, causal)[..., None]  # [..., q, kv, 1]
        first, last = self.mlp[0], self.mlp[2]
        hidden = torch.relu(x * first.weight.to(dtype)[:, 0] + first.bias.to(dtype))  # [..., W]
        out = hidden @ last.weight.to(dtype).t() + last.bias.to(dtype)  # [..., q, kv, H]
        return out.movedim(-1, -3)

    def flex_bias(self, spec: FlexSpec) -> FlexBias | None:
        """:meth:`forward` at one (head, query position, key position), elementwise, reading four captured tables
        (compiled flex gathers each tensor that needs a gradient once):

        - the numerator psi(i - j) (signed when bidirectional) over relative positions, and the denominator
          psi(max(i, L)) + eps over query positions 0 .. the call's last, so x = numerator / denominator as in
          :func:`fire_normalized`;
        - the MLP ``1 -> W -> ReLU -> H`` as the piecewise-linear function it is: with the W kinks -b1/w1 sorted,
          on the k-th interval the active units are fixed and ``f_h(x) = slope[h, k] x + offset[h, k]``, where
          slope and offset sum ``w2 * w1`` and ``w2 * b1`` (+ b2) over the active units (made here with autograd, so
          the MLP's gradients flow through them). The kernel counts the kinks below x (W comparisons) and gathers.

        Exact: the same sums as the dense MLP in another order. None (dense path) for negative query positions.
        """
        if spec.query_range[0] < 0:
            return None
        numerator, span = self._numerator_row(spec)  # [2 span + 1], numerator[span + v]: relative position v = j - i
        denominator = self._denominator_row(spec)  # [P], denominator[p]: query position p
        kinks, slope, offset = self._pieces()  # [W] sorted (no grad), [H, W + 1], [H, W + 1]
        near = min(spec.lanes, 128)  # the adds of one relative / query position already spread over a block
        numerator, denominator = spread(numerator, near), spread(denominator, near)
        slope, offset = spread(slope, spec.lanes), spread(offset, spec.lanes)
        width = kinks.shape[0]

        def bias(head: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                 lane: torch.Tensor) -> torch.Tensor:
            relative = (key_pos - query_pos).clamp(-span, span) + span
            x = numerator[relative, lane % near] / denominator[query_pos, lane % near]
            piece = (x > kinks[0]).to(torch.int64)
            for unit in range(1, width):
                piece = piece + (x > kinks[unit]).to(torch.int64)
            return slope[head, piece, lane] * x + offset[head, piece, lane]

        return bias

    def _numerator_row(self, spec: FlexSpec) -> tuple[torch.Tensor, int]:
        """(row, span): psi(i - j) at relative positions j - i = -span .. span (clamped at 0 when causal, times
        sign(i - j) when bidirectional, as :func:`fire_normalized`); span a power of two >= the call's reach."""
        span = _table_size(spec.reach)
        relative = -torch.arange(-span, span + 1, device=spec.device).to(torch.float32)  # i - j
        c, _ = self.scalars()
        clamped = relative.clamp(min=0) if spec.causal else relative
        numerator = torch.log(torch.abs(c * clamped) + 1)
        return (numerator if spec.causal else numerator * torch.sign(relative)), span

    def _denominator_row(self, spec: FlexSpec) -> torch.Tensor:
        """psi(max(p, L)) + eps at query positions p = 0 .. P - 1 (P a power of two above the call's last)."""
        positions = torch.arange(_table_size(spec.query_range[1] + 1), device=spec.device).to(torch.float32)
        c, threshold = self.scalars()
        return torch.log(torch.abs(c * torch.maximum(positions, threshold)) + 1) + FIRE_EPS

    def _pieces(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kinks [W] ascending, slope [H, W + 1], offset [H, W + 1]) of the MLP as a piecewise-linear function of
        x: on piece k (exactly k kinks below x) it is slope[:, k] x + offset[:, k]. A unit with w1 = 0 has no kink
        (placed at +inf) and is active where b1 > 0."""
        first, last = self.mlp[0], self.mlp[2]
        w1, b1 = first.weight.to(torch.float32)[:, 0], first.bias.to(torch.float32)  # [W], [W]
        w2, b2 = last.weight.to(torch.float32), last.bias.to(torch.float32)  # [H, W], [H]
        with torch.no_grad():
            kinks = torch.where(w1 != 0, -b1 / w1, torch.full_like(w1, float("inf")))  # [W]
            order = torch.argsort(kinks, stable=True)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(order.shape[0], device=order.device)
            piece = torch.arange(order.shape[0] + 1, device=order.device)  # [W + 1]
            below = rank[:, None] < piece[None, :]  # [W, W + 1]: the unit's kink is below x on this piece
            rising, falling = (w1 > 0)[:, None], (w1 < 0)[:, None]
            active = torch.where(rising, below, torch.where(falling, ~below, (b1 > 0)[:, None]))  # relu's argument > 0
            active = active.to(torch.float32)
        slope = (w2 * w1) @ active  # [H, W + 1]
        offset = b2[:, None] + (w2 * b1) @ active
        return kinks[order], slope, offset


def _table_size(count: int) -> int:
    """A power of two >= count (at least 1024): tables captured by flex keep their shape across most calls."""
    return max(1024, 1 << max(count - 1, 0).bit_length())


def fire_normalized(
    query: torch.Tensor, key: torch.Tensor, c: torch.Tensor, threshold: torch.Tensor, causal: bool
) -> torch.Tensor:
    """psi(i - j) / (psi(max(i, L)) + eps), psi(x) = log(|c x| + 1), of float32 query and key positions i, j (any
    broadcasting shapes; elementwise, so flex's score_mod runs it per entry). Causal: i - j clamped at 0.
    Bidirectional: multiplied by sign(i - j)."""
    relative = query - key  # i - j
    if causal:
        relative = relative.clamp(min=0)
    normalizer = torch.maximum(query, threshold)
    numerator = torch.log(torch.abs(c * relative) + 1)
    denominator = torch.log(torch.abs(c * normalizer) + 1) + FIRE_EPS
    normalized = numerator / denominator
    return normalized if causal else normalized * torch.sign(relative)


class FireBias(BiasPositions):
    """FIRE functions: one shared by all layers, or one per layer."""

    reads_query_positions = True  # psi(max(i, L)) counts the query's tokens from the row's first real one

    def __init__(
        self, num_heads: int, num_layers: int, width: int, init_c: float, init_threshold: float, shared: bool
    ) -> None:
        super().__init__()
        count = 1 if shared else num_layers
        self.functions = nn.ModuleList(
            FireFunction(num_heads, width, init_c, init_threshold) for _ in range(count)
        )

    def forward(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, layer_idx: int, causal: bool, memo: dict | None = None
    ) -> torch.Tensor:
        # query_pos [q], key_pos [kv] -> [1, H, q, kv]  (or [B, q], [B, kv] -> [B, H, q, kv])
        function = self.functions[0] if len(self.functions) == 1 else self.functions[layer_idx]
        bias = function(query_pos, key_pos, causal)
        return bias if bias.dim() == 4 else bias.unsqueeze(0)

    def flex_bias(self, spec: FlexSpec) -> FlexBias | None:
        """The layer's FIRE function, elementwise (:meth:`FireFunction.flex_bias`)."""
        function = self.functions[0] if len(self.functions) == 1 else self.functions[spec.layer_idx]
        return function.flex_bias(spec)

    def extra_repr(self) -> str:
        return f"functions={len(self.functions)}"


@register_scheme
@dataclass
class FireConfig(SchemeConfig):
    """FIRE's learned bias function of the progressively interpolated log distance (formula in
    :mod:`hf_posswap.schemes.fire`).

    Causal models get the paper's form. Encoders (the paper defines FIRE for causal attention): the same
    normaliser psi(max(i, L)) of the query position, with the sign of ``i - j`` kept on the normalised distance,
    so the MLP sees keys before the query as positive and keys after as negative inputs and can treat the two
    directions differently (a symmetric form could not tell left from right).

    Initialisation: the paper's for the hidden layer, c = 0.1 and L = 512, but the MLP's output layer starts at
    zero, so right after the swap the bias is exactly 0 and the pretrained attention keeps its logits; the paper
    trains from scratch, where a random bias costs nothing, while on a pretrained model it would add noise on top
    of the removed positions. The output layer gets gradients from the first step, the rest from the second.

    Args:
        mlp_width: hidden width of the MLP (paper: 32).
        init_c: initial c of psi(x) = log(c·x + 1) (paper: 0.1); positive.
        init_threshold: initial L, the query position below which distances are normalised by psi(L) (paper: 512).
        shared_across_layers: one FIRE function for all layers (default) or one per layer.
    """

    name = "fire"
    kind = "bias"
    paper = "Li et al. 2024, FIRE (arXiv:2310.04418)"

    mlp_width: int = 32
    init_c: float = 0.1
    init_threshold: float = 512.0
    shared_across_layers: bool = True

    def validate(self) -> None:
        require_int_at_least("FireConfig", "mlp_width", self.mlp_width, 1)
        for field, example in (("init_c", "0.1"), ("init_threshold", "512.0")):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise InvalidConfigError(
                    f"FireConfig.{field} must be a positive finite number, got {value!r}. "
                    f"Use {field}={example}, the paper's value."
                )
        require_bool("FireConfig", "shared_across_layers", self.shared_across_layers)

    @property
    def layer_shared(self) -> bool:
        return self.shared_across_layers

    def build(self, spec: ModelSpec) -> FireBias:
        module = FireBias(spec.num_heads, spec.num_layers, self.mlp_width, float(self.init_c),
                          float(self.init_threshold), self.shared_across_layers)
        return module.to(device=spec.device, dtype=spec.dtype)
