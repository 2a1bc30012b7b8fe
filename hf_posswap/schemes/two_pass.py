"""The two-pass RoPE scalings: Self-Extend and ReRoPE. Keys near the query keep exact positions, farther keys get
"far" positions; :mod:`hf_posswap.core.self_extend` runs both passes, query-chunked, and merges them. RoPE then
goes inside attention (cached keys stay unrotated), so these scalings are never native transformers."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import InvalidConfigError, InvalidOptionError
from .base import require_int_at_least, require_positive
from .rope_scaling import RopeScaling, register_scaling


class TwoPassSettings(NamedTuple):
    """What two-pass attention (:mod:`hf_posswap.core.self_extend`) reads, as (group, window, start). Keys closer
    than ``window`` to the query keep exact positions; farther ones take the "far" logit, keys at far(j) and queries
    at far(i) + window - far(window): far(p) = floor(p / G) for an integer group (Self-Extend), p / k for a float
    one (leaky ReRoPE; inf: every far key at distance ``window``, ReRoPE). Causal queries before position ``start``
    (bidirectional rows shorter than it) use exact positions only."""

    group: int | float
    window: int
    start: int

    @property
    def floor(self) -> bool:
        """Whether far positions are rounded down (Self-Extend's integer groups)."""
        return isinstance(self.group, int)


def _default_window(window: int | None, original: int, name: str, field: str) -> int:
    """``window``, or a quarter of the original length; refused unless shorter than the original length."""
    window = window if window is not None else max(original // 4, 1)
    if window >= original:
        raise InvalidConfigError(f"{name}.{field}={window} must be shorter than the original length {original}.")
    return window


@register_scaling
@dataclass
class SelfExtend(RopeScaling):
    """Self-Extend (Jin et al. 2024, "LLM Maybe LongLM", arXiv:2401.01325): training-free grouped attention.

    Keys within ``neighbor_window`` of the query keep their exact relative positions; farther keys use grouped
    positions floor(pos / group_size), shifted so grouped distances continue where the window ends. Reachable
    length: (L0 - W) * G + W. Inputs no longer than the original length run exactly as without it. RoPE is applied
    inside attention (cached keys are stored unrotated), so it never is native transformers.

    Args:
        group_size: G; ``None`` picks the smallest G that reaches the target length.
        neighbor_window: W; ``None`` uses a quarter of the original length.
    """

    method = "self_extend"
    paper = "Jin et al. 2024, LLM Maybe LongLM: Self-Extend (arXiv:2401.01325)"
    length_dependent = True

    group_size: int | None = None
    neighbor_window: int | None = None

    def validate(self) -> None:
        super().validate()
        if self.group_size is not None:
            require_int_at_least("SelfExtend", "group_size", self.group_size, 1)
        if self.neighbor_window is not None:
            require_int_at_least("SelfExtend", "neighbor_window", self.neighbor_window, 1)

    def with_original(self, original: int) -> SelfExtend:
        scaled = super().with_original(original)
        original = scaled.original_max_position_embeddings  # type: ignore[assignment]
        window = _default_window(scaled.neighbor_window, original, "SelfExtend", "neighbor_window")
        target = math.ceil(scaled.factor * original)
        group = scaled.group_size or max(math.ceil((target - window) / (original - window)), 1)
        reach = (original - window) * group + window
        if reach < target:
            raise InvalidConfigError(
                f"SelfExtend with group_size={group} and neighbor_window={window} reaches {reach} tokens, short of "
                f"{target}; use group_size >= {math.ceil((target - window) / (original - window))}."
            )
        return dataclasses.replace(scaled, group_size=group, neighbor_window=window)

    def rope_parameters(self, rope_theta: float, rotary_dim: int) -> dict[str, Any]:
        return {"rope_type": "default", "rope_theta": rope_theta}

    def attention_settings(self) -> TwoPassSettings:
        """Grouped positions floor(p / G) past the window, only once the input outgrows the original length."""
        return TwoPassSettings(self.group_size, self.neighbor_window, self.original_max_position_embeddings)  # type: ignore[arg-type]


@register_scaling
@dataclass
class ReRoPE(SelfExtend):
    """ReRoPE (Su 2023, "Rectified Rotary Position Embeddings", github.com/bojone/rerope, kexue.fm/archives/9708).

    Relative distances d < ``window`` are exact; farther keys all sit at distance w (queries rotated to position w
    against unrotated keys). Leaky ReRoPE (``leaky_factor`` k): w + (d - w) / k beyond the window, reaching
    (L0 - w) * k + w tokens. Self-Extend's two-pass attention with an infinite group (leaky: group k, no floor).
    As in the reference, it acts at every length (inputs no longer than ``window`` are unchanged); RoPE goes
    inside attention, cached keys unrotated.

    Args:
        window: w; ``None`` uses a quarter of the original length (the reference's ReRoPE-w1024 on 4k LLaMA 2).
        leaky_factor: k > 1 for Leaky ReRoPE; ``None`` for ReRoPE.
    """

    method = "rerope"
    paper = "Su 2023, Rectified Rotary Position Embeddings (github.com/bojone/rerope, kexue.fm/archives/9708)"
    length_dependent = False

    window: int | None = None
    leaky_factor: float | None = None

    @classmethod
    def option_names(cls) -> list[str]:
        return [name for name in super().option_names() if name not in ("group_size", "neighbor_window")]

    def validate(self) -> None:
        RopeScaling.validate(self)
        if self.group_size is not None or self.neighbor_window is not None:
            raise InvalidOptionError(
                "ReRoPE has no group_size or neighbor_window (those are Self-Extend's); its options are "
                f"{', '.join(self.option_names())}."
            )
        if self.window is not None:
            require_int_at_least("ReRoPE", "window", self.window, 1)
        if self.leaky_factor is not None:
            require_positive("ReRoPE", "leaky_factor", self.leaky_factor)
            if self.leaky_factor <= 1:
                raise InvalidConfigError(
                    f"ReRoPE.leaky_factor must exceed 1 (1 is plain RoPE), got {self.leaky_factor!r}; leave it out "
                    "for ReRoPE without leak."
                )

    def with_original(self, original: int) -> ReRoPE:
        scaled = RopeScaling.with_original(self, original)
        original = scaled.original_max_position_embeddings  # type: ignore[assignment]
        window = _default_window(scaled.window, original, "ReRoPE", "window")  # type: ignore[attr-defined]
        target = math.ceil(scaled.factor * original)
        leak = scaled.leaky_factor  # type: ignore[attr-defined]
        if leak is not None and (original - window) * leak + window < target:
            raise InvalidConfigError(
                f"Leaky ReRoPE with leaky_factor={leak} and window={window} reaches "
                f"{math.floor((original - window) * leak + window)} tokens, short of {target}; use leaky_factor >= "
                f"{(target - window) / (original - window):g}."
            )
        return dataclasses.replace(scaled, window=window)  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **{name: getattr(self, name) for name in self.option_names()}}

    def attention_settings(self) -> TwoPassSettings:
        """Far keys unrotated (leaky: at p / k), far queries at w (leaky: p / k + w - w / k), at every length."""
        group = float(self.leaky_factor) if self.leaky_factor is not None else math.inf  # a float: no floor
        return TwoPassSettings(group, self.window, self.window)  # type: ignore[arg-type]
