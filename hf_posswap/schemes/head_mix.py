"""Per-head position schemes in one layer: a bias scheme on some heads, a rotary scheme on the others.

x-transformers lets ALiBi act on a subset of heads (``alibi_num_heads``) next to rotary embeddings; here the split
is exclusive, as Press et al.'s ALiBi and RoFormer's rotation each stand alone: *bias heads* get the bias scheme's
bias with unrotated q and k, *rotary heads* get the rotation and no bias. A bias head's bias is exactly the one
the bias scheme alone gives that head (ALiBi: the slope of head h among all H heads — x-transformers instead
recomputes the slopes for the subset's count).

With grouped-query attention several query heads share one key/value head, and a key is either rotated or not:
the bias heads must therefore be whole kv groups (:meth:`HeadMix.resolve` checks it against the model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import InvalidConfigError
from .base import SCHEME_REGISTRY, FlexBias, FlexSpec, ModelSpec, SchemeConfig, scheme_config_from_dict


class HeadSelectedBias(nn.Module):
    """A bias scheme's bias [.., H, q, kv] kept on ``bias_heads`` and zero on the other heads.

    Head lists are plain attributes, not buffers: ``from_pretrained`` builds on the meta device and would leave
    non-persistent buffers uninitialised."""

    def __init__(self, bias: nn.Module, bias_heads: list[int], num_heads: int) -> None:
        super().__init__()
        self.bias = bias
        self.keep = [float(head in bias_heads) for head in range(num_heads)]

    def forward(self, query_pos: torch.Tensor, key_pos: torch.Tensor, layer_idx: int, causal: bool,
                memo: dict | None = None) -> torch.Tensor:
        bias = self.bias(query_pos, key_pos, layer_idx, causal, memo)  # [1 or B, H, q, kv]
        keep = torch.tensor(self.keep, dtype=bias.dtype, device=bias.device)  # [H]
        return bias * keep[:, None, None]

    def flex_bias(self, spec: FlexSpec) -> FlexBias | None:
        """The bias scheme's elementwise bias times 1 on bias heads, 0 on the others (as :meth:`forward`); None
        when the bias scheme has none."""
        inner_of = getattr(self.bias, "flex_bias", None)
        inner = inner_of(spec) if inner_of is not None else None
        if inner is None:
            return None
        keep = torch.tensor(self.keep, dtype=torch.float32, device=spec.device)  # [H]

        def bias(head: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                 lane: torch.Tensor) -> torch.Tensor:
            return keep[head] * inner(head, query_pos, key_pos, lane)

        return bias


class HeadMixPositions(nn.Module):
    """The modules of a head mix: ``bias`` (zero on rotary heads), ``rotary``, and which heads rotate
    (:meth:`rotary_heads`: [H] and [Hkv] bool masks)."""

    def __init__(self, bias: nn.Module, rotary: nn.Module, bias_heads: list[int], num_heads: int,
                 num_kv_heads: int) -> None:
        super().__init__()
        self.bias = HeadSelectedBias(bias, bias_heads, num_heads)
        self.rotary = rotary
        self.bias_heads = list(bias_heads)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads

    def rotary_heads(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[H] and [Hkv] masks, True where a head is rotated (a kv head serves num_heads / num_kv_heads heads)."""
        heads = torch.ones(self.num_heads, dtype=torch.bool, device=device)
        heads[self.bias_heads] = False
        return heads, heads[:: self.num_heads // self.num_kv_heads]

    def extra_repr(self) -> str:
        return f"bias_heads={self.bias_heads}"


def _part(value: Any, kind: str, field: str) -> SchemeConfig:
    if isinstance(value, dict):
        value = scheme_config_from_dict(value)
    elif isinstance(value, str):
        value = SCHEME_REGISTRY.get(value)()
    if not isinstance(value, SchemeConfig) or value.kind != kind:
        got = f"'{value.name}' ({value.kind})" if isinstance(value, SchemeConfig) else repr(value)
        examples = "alibi, t5, kerple, sandwich, fire" if kind == "bias" else "rope"
        raise InvalidConfigError(f"HeadMix.{field} must be a {kind} scheme ({examples}), got {got}.")
    return value


@dataclass
class HeadMix(SchemeConfig):
    """A bias scheme on ``bias_heads``, a rotary scheme on the other heads of every layer it is given to.

    Alone (``swap(model, HeadMix(...))``) it acts on every layer (saved as ``LayerMix(default=HeadMix(...))``); as a
    part of a ``LayerMix``, on that part's layers. It is not a registered scheme name: its record lives in a mix's.

    Args:
        bias: the bias scheme of the bias heads (a registered name or a config).
        rotary: the rotary scheme of the other heads.
        bias_heads: query-head indices with the bias; ``None``: the first half of the key/value groups' heads.
            With grouped-query attention they must be whole groups (a key/value head is rotated or not).
    """

    name = "head_mix"
    kind = "head_mix"
    paper = "Press et al. 2022 (ALiBi) and Su et al. 2021 (RoPE) per head, as x-transformers' alibi_num_heads"

    bias: Any = "alibi"
    rotary: Any = "rope"
    bias_heads: Any = None

    def validate(self) -> None:
        self.bias = _part(self.bias, "bias", "bias")
        self.rotary = _part(self.rotary, "rotary", "rotary")
        if self.bias_heads is None:
            return
        heads = list(self.bias_heads) if isinstance(self.bias_heads, (list, tuple, range)) else None
        bad = heads is None or not heads or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in heads)
        if bad or len(set(heads)) != len(heads):  # type: ignore[arg-type]
            raise InvalidConfigError(
                f"HeadMix.bias_heads must be a non-empty list of distinct head indices (integers >= 0), got "
                f"{self.bias_heads!r}."
            )
        self.bias_heads = sorted(heads)  # type: ignore[arg-type]

    @property
    def layer_shared(self) -> bool:
        return self.bias.layer_shared

    def heads_for(self, spec: ModelSpec) -> list[int]:
        """The bias heads for a model, checked: in range, whole kv groups, some heads left for the rotation."""
        group = spec.num_heads // spec.num_kv_heads
        heads = self.bias_heads
        if heads is None:
            heads = list(range(group * max(spec.num_kv_heads // 2, 1)))
        outside = [h for h in heads if h >= spec.num_heads]
        if outside:
            raise InvalidConfigError(
                f"HeadMix.bias_heads lists heads {outside}, but the model has {spec.num_heads} attention heads "
                f"(indices 0 to {spec.num_heads - 1})."
            )
        groups = [list(range(g * group, (g + 1) * group)) for g in range(spec.num_kv_heads)]
        split = [g for g in groups if 0 < len(set(g) & set(heads)) < group]
        if split:
            whole = [g for g in groups if set(g) & set(heads)]
            raise InvalidConfigError(
                f"HeadMix.bias_heads={heads} splits key/value groups {split}: with grouped-query attention "
                f"{spec.num_heads} query heads share {spec.num_kv_heads} key/value heads ({group} per group), and a "
                f"key/value head is either rotated or not. Give whole groups, e.g. bias_heads="
                f"{sorted(h for g in whole for h in g)}."
            )
        if len(heads) == spec.num_heads:
            raise InvalidConfigError(
                f"HeadMix.bias_heads={heads} covers every head, leaving none for '{self.rotary.name}'. Swap to "
                f"'{self.bias.name}' alone, or leave some heads out."
            )
        return list(heads)

    def resolve(self, spec: ModelSpec) -> HeadMix:
        return HeadMix(bias=self.bias.resolve(spec), rotary=self.rotary.resolve(spec), bias_heads=self.heads_for(spec))

    def with_rotary(self, change: Any) -> HeadMix:
        """A copy with ``change(rotary)`` (``extend_context`` scales the rotary heads' RoPE)."""
        return dataclasses.replace(self, rotary=change(self.rotary))

    def build(self, spec: ModelSpec) -> HeadMixPositions:
        heads = self.heads_for(spec)
        module = HeadMixPositions(self.bias.build(spec), self.rotary.build(spec), heads, spec.num_heads,
                                  spec.num_kv_heads)
        return module.to(spec.device)

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.name, "bias": self.bias.to_dict(), "rotary": self.rotary.to_dict(),
                "bias_heads": None if self.bias_heads is None else list(self.bias_heads)}
