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
from .base import BiasPositions, ModelSpec, SchemeConfig, register_scheme, require_bool, require_int_at_least

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

    def normalized_distance(self, query_pos: torch.Tensor, key_pos: torch.Tensor, causal: bool) -> torch.Tensor:
        """psi(i - j) / psi(max(i, L)): [..., q, kv] float32. Causal: keys after the query (masked anyway) read
        distance 0. Bidirectional: the sign of i - j is kept, so f can tell keys before from keys after."""
        query = query_pos.to(torch.float32)
        relative = query[..., :, None] - key_pos.to(torch.float32)[..., None, :]  # i - j
        if causal:
            relative = relative.clamp(min=0)
        c = self.c.to(torch.float32)
        threshold = (self.threshold_scale.to(torch.float32) * self.initial_threshold).abs()
        normalizer = torch.maximum(query, threshold)[..., :, None]  # [..., q, 1]
        numerator = torch.log(torch.abs(c * relative) + 1)
        denominator = torch.log(torch.abs(c * normalizer) + 1) + FIRE_EPS
        normalized = numerator / denominator
        return normalized if causal else normalized * torch.sign(relative)

    def forward(self, query_pos: torch.Tensor, key_pos: torch.Tensor, causal: bool) -> torch.Tensor:
        # -> [..., H, q, kv] float32, whatever dtype the model was cast to
        x = self.normalized_distance(query_pos, key_pos, causal)[..., None]  # [..., q, kv, 1]
        first, last = self.mlp[0], self.mlp[2]
        hidden = torch.relu(x * first.weight.to(torch.float32)[:, 0] + first.bias.to(torch.float32))  # [..., W]
        out = hidden @ last.weight.to(torch.float32).t() + last.bias.to(torch.float32)  # [..., q, kv, H]
        return out.movedim(-1, -3)


class FireBias(BiasPositions):
    """FIRE functions: one shared by all layers, or one per layer."""

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
