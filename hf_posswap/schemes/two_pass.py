"""The two-pass RoPE scalings: Self-Extend and ReRoPE. Keys near the query keep exact positions, farther keys get
"far" positions; :mod:`hf_posswap.core.self_extend` runs both passes, query-chunked, and merges them. RoPE then
goes inside attention (cached keys stay unrotated), so these scalings are never native transformers."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import InvalidConfigError
from .base import require_bool, require_int_at_least, require_positive
from .rope_scaling import RopeScaling, register_scaling


class TwoPassSettings(NamedTuple):
    """What two-pass attention (:mod:`hf_posswap.core.self_extend`) reads, as (group, window, start). Keys closer
    than ``window`` to the query keep exact positions; farther ones take the "far" logit, keys at far(j) and queries
    at far(i) + window - far(window): far(p) = floor(p / G) for an integer group (Self-Extend), p / k for a float
    one (leaky ReRoPE; inf: every far key at distance ``window``, ReRoPE). Causal queries before position ``start``
    (bidirectional rows shorter than it) use exact positions only. ``start`` = ``window`` bounds nothing (no key is
    ``window`` away from an earlier query): the two-pass attention then runs from that length on, as both methods'
    reference code does; ``start`` = the original length is Self-Extend's ``exact_within_original``."""

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


@dataclass
class TwoPassScaling(RopeScaling):
    """A RoPE scaling run as two-pass attention (:mod:`hf_posswap.core.self_extend`): plain RoPE parameters, with
    RoPE applied inside attention, and the :class:`TwoPassSettings` the attention reads."""

    def rope_parameters(self, rope_theta: float, rotary_dim: int) -> dict[str, Any]:
        return {"rope_type": "default", "rope_theta": rope_theta}

    def attention_settings(self) -> TwoPassSettings:
        """The (group, window, start) of the two passes, once the original length is set."""
        raise NotImplementedError


@register_scaling
@dataclass
class SelfExtend(TwoPassScaling):
    """Self-Extend (Jin et al. 2024, "LLM Maybe LongLM", arXiv:2401.01325): training-free grouped attention.

    As the authors' code does (github.com/datamllab/LongLM, ``self_extend_patch/Llama_4_40.py``): for query i and
    key j, i - j < W ("neighbour" attention) uses the exact positions; farther keys use the grouped ones, key at
    floor(j / G) and query at floor(i / G) + W - floor(W / G), so grouped distances continue where the window ends.
    This holds at every length and for every query: inputs no longer than W are unchanged, longer ones group the
    keys past the window even below the original length (the original length only sets the defaults). A query's
    logits depend only on its own and its keys' positions, so a cached decode equals a full recompute. The authors'
    code is causal; bidirectional models (BERT) take the grouped logit where |i - j| >= W. Reachable length:
    (L0 - W) * G + W. RoPE is applied inside attention (cached keys are stored unrotated), so it never is native
    transformers.

    Args:
        group_size: G; ``None`` picks the smallest G that reaches the target length.
        neighbor_window: W; ``None`` uses a quarter of the original length.
        exact_within_original: not in the authors' code. True: causal queries before the original length attend
            with exact positions (the unextended model), only later ones group; a bidirectional row groups only
            when it is longer than the original length. Inputs within the original length are then bit-identical
            to the unextended model and take its ordinary attention path. The authors' rule costs a little there:
            on SmolLM2-135M with a declared original length of 512 (W 128, G 5), perplexity at positions 128-511
            rose by 0.8 % +- 0.15 % (26 of 32 pieces), with 1,024 (W 256) by 0.35 % +- 0.26 %; past the original
            length the two rules differed by 0.05 % (within noise). See
            ``scripts/benchmarks/self_extend_within_original.py``.
    """

    method = "self_extend"
    paper = "Jin et al. 2024, LLM Maybe LongLM: Self-Extend (arXiv:2401.01325)"
    length_dependent = True

    group_size: int | None = None
    neighbor_window: int | None = None
    exact_within_original: bool = False

    def validate(self) -> None:
        super().validate()
        if self.group_size is not None:
            require_int_at_least("SelfExtend", "group_size", self.group_size, 1)
        if self.neighbor_window is not None:
            require_int_at_least("SelfExtend", "neighbor_window", self.neighbor_window, 1)
        require_bool(type(self).__name__, "exact_within_original", self.exact_within_original)

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

    def attention_settings(self) -> TwoPassSettings:
        """Grouped positions floor(p / G) past the window, from length W on (the authors' rule), or only for queries
        past the original length with ``exact_within_original``."""
        start = self.original_max_position_embeddings if self.exact_within_original else self.neighbor_window
        return TwoPassSettings(self.group_size, self.neighbor_window, start)  # type: ignore[arg-type]


@register_scaling
@dataclass
class ReRoPE(TwoPassScaling):
    """ReRoPE (Su 2023, "Rectified Rotary Position Embeddings", github.com/bojone/rerope, kexue.fm/archives/9708).

    Relative distances d < ``window`` are exact; farther keys all sit at distance w (queries rotated to position w
    against unrotated keys). Leaky ReRoPE (``leaky_factor`` k): w + (d - w) / k beyond the window, reaching
    (L0 - w) * k + w tokens. Self-Extend's two-pass attention with an infinite group (leaky: group k, no floor).
    As in the reference, it acts at every length (inputs no longer than ``window`` are unchanged); RoPE goes
    inside attention, cached keys unrotated. Self-Extend's options (``group_size``, ``neighbor_window``,
    ``exact_within_original``) are not ReRoPE's: naming one is refused with ReRoPE's options listed.

    Args:
        window: w; ``None`` uses a quarter of the original length (the reference's ReRoPE-w1024 on 4k LLaMA 2).
        leaky_factor: k > 1 for Leaky ReRoPE; ``None`` for ReRoPE.
    """

    method = "rerope"
    paper = "Su 2023, Rectified Rotary Position Embeddings (github.com/bojone/rerope, kexue.fm/archives/9708)"
    length_dependent = False

    window: int | None = None
    leaky_factor: float | None = None

    def validate(self) -> None:
        super().validate()
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
        scaled = super().with_original(original)
        original = scaled.original_max_position_embeddings  # type: ignore[assignment]
        window = _default_window(scaled.window, original, "ReRoPE", "window")
        target = math.ceil(scaled.factor * original)
        leak = scaled.leaky_factor
        if leak is not None and (original - window) * leak + window < target:
            raise InvalidConfigError(
                f"Leaky ReRoPE with leaky_factor={leak} and window={window} reaches "
                f"{math.floor((original - window) * leak + window)} tokens, short of {target}; use leaky_factor >= "
                f"{(target - window) / (original - window):g}."
            )
        return dataclasses.replace(scaled, window=window)

    def attention_settings(self) -> TwoPassSettings:
        """Far keys unrotated (leaky: at p / k), far queries at w (leaky: p / k + w - w / k), at every length."""
        group = float(self.leaky_factor) if self.leaky_factor is not None else math.inf  # a float: no floor
        return TwoPassSettings(group, self.window, self.window)  # type: ignore[arg-type]
