"""T5 relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified
Text-to-Text Transformer", §2.1): a learned scalar per (head, bucket of relative distance), added to the logits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import InvalidConfigError
from .base import BiasPositions, ModelSpec, SchemeConfig, register_scheme, require_bool, require_int_at_least


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Map relative positions (key - query) to bucket ids as T5 does (Raffel et al. 2020, §2.1).

    Half the buckets (per direction when bidirectional) hold exact distances; the rest cover distances up to
    ``max_distance`` in logarithmically growing ranges; farther distances share the last bucket.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # only keys at or before the query
    exact = num_buckets // 2
    is_small = distance < exact
    # log-spaced buckets between `exact` and `max_distance`
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = exact + (log_ratio * (num_buckets - exact)).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class _GatherBuckets(torch.autograd.Function):
    """weight [H, nb] gathered at bucket ids [q, kv] -> [H, q, kv].

    Same values as ``weight[:, buckets]``; the backward sums gradients per bucket with ``index_add_``, which on CPU
    is about 4x faster than the generic indexing backward for the few-buckets, many-positions case here.
    """

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(buckets)
        ctx.num_buckets = weight.shape[1]
        return weight[:, buckets]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (buckets,) = ctx.saved_tensors
        grad_weight = grad.new_zeros(grad.shape[0], ctx.num_buckets)
        grad_weight.index_add_(1, buckets.flatten(), grad.reshape(grad.shape[0], -1))
        return grad_weight, None


class T5RelativeBias(BiasPositions):
    """Learned bias tables ``[num_buckets, num_heads]``: one shared by all layers, or one per layer."""

    def __init__(
        self, num_heads: int, num_layers: int, num_buckets: int, max_distance: int, shared_across_layers: bool
    ) -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        count = 1 if shared_across_layers else num_layers
        self.tables = nn.ModuleList(nn.Embedding(num_buckets, num_heads) for _ in range(count))
        for table in self.tables:
            nn.init.zeros_(table.weight)

    def forward(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, layer_idx: int, causal: bool, memo: dict | None = None
    ) -> torch.Tensor:
        # query_pos [q], key_pos [kv] -> [1, H, q, kv]  (or [B, q], [B, kv] -> [B, H, q, kv])
        table = self.tables[0] if len(self.tables) == 1 else self.tables[layer_idx]
        memo_key = (  # index positions are ranges (shape + start say it all); row positions live for the forward
            "t5-buckets",
            causal,
            tuple(query_pos.shape),
            tuple(key_pos.shape),
            int(query_pos.flatten()[0]),
            int(key_pos.flatten()[0]),
            id(query_pos) if query_pos.dim() > 1 else None,
        )
        buckets = memo.get(memo_key) if memo is not None else None
        if buckets is None:
            relative = key_pos[..., None, :] - query_pos[..., :, None]  # [..., q, kv], memory - context as in T5
            buckets = relative_position_bucket(relative, not causal, self.num_buckets, self.max_distance)
            if memo is not None:
                memo[memo_key] = buckets
        weight = table.weight.to(torch.float32).t()  # [num_buckets, H] -> [H, num_buckets]
        bias = _GatherBuckets.apply(weight, buckets)  # [H, ..., q, kv]
        return bias.movedim(0, -3) if bias.dim() == 4 else bias.unsqueeze(0)  # -> [B or 1, H, q, kv]

    def extra_repr(self) -> str:
        return f"num_buckets={self.num_buckets}, max_distance={self.max_distance}, tables={len(self.tables)}"


@register_scheme
@dataclass
class T5BiasConfig(SchemeConfig):
    """T5's bucketed relative position bias: bidirectional buckets for encoders, causal buckets for decoders.

    Initialisation: the tables start at zero, so right after the swap the bias is exactly 0 and the model sees no
    position signal from it; attention logits keep their pretrained scale. This disturbs a pretrained model least
    (random tables would add noise of their own on top of removing the old positions); fine-tuning then learns
    the bias.

    Args:
        num_buckets: buckets per table (T5: 32).
        max_distance: distances at or past this share the last bucket (T5: 128).
        shared_across_layers: one table for all layers, as T5 does (default), or one per layer.
    """

    name = "t5"
    kind = "bias"
    paper = "Raffel et al. 2020, T5 (arXiv:1910.10683)"

    num_buckets: int = 32
    max_distance: int = 128
    shared_across_layers: bool = True

    def validate(self) -> None:
        require_int_at_least("T5BiasConfig", "num_buckets", self.num_buckets, 2)
        require_int_at_least("T5BiasConfig", "max_distance", self.max_distance, 1)
        require_bool("T5BiasConfig", "shared_across_layers", self.shared_across_layers)

    @property
    def layer_shared(self) -> bool:
        return self.shared_across_layers

    def resolve(self, spec: ModelSpec) -> T5BiasConfig:
        # With bidirectional buckets each direction gets num_buckets // 2; its exact half must be >= 1.
        per_direction = self.num_buckets if spec.is_causal else self.num_buckets // 2
        if per_direction // 2 < 1:
            raise InvalidConfigError(
                f"T5BiasConfig.num_buckets={self.num_buckets} leaves no exact bucket for a bidirectional model; "
                "use num_buckets >= 4."
            )
        if self.max_distance <= per_direction // 2:
            raise InvalidConfigError(
                f"T5BiasConfig.max_distance={self.max_distance} must exceed the {per_direction // 2} exact buckets "
                f"(num_buckets={self.num_buckets}); raise max_distance or lower num_buckets."
            )
        return super().resolve(spec)  # type: ignore[return-value]

    def build(self, spec: ModelSpec) -> T5RelativeBias:
        module = T5RelativeBias(
            spec.num_heads, spec.num_layers, self.num_buckets, self.max_distance, self.shared_across_layers
        )
        return module.to(device=spec.device, dtype=spec.dtype)
