"""RoPE scalings for running a RoPE model past its trained length.

Each scaling is a validated dataclass that writes the ``config.rope_parameters`` entries transformers uses, so the
frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (natively on LLaMA-like models, and through the same
functions for RoPE applied inside attention). Static NTK has no transformers type: it is expressed as plain RoPE
with a larger base, which transformers also loads natively.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import InvalidConfigError, InvalidOptionError, UnknownSchemeError, closest_hint
from ..registry import Registry
from .base import require_int_at_least, require_positive

#: an unknown name's error lists the known ones: that list is the fix
SCALING_REGISTRY: Registry[type[RopeScaling]] = Registry("RoPE scaling method", UnknownSchemeError)


@dataclass
class RopeScaling:
    """Base class: a scaling ``factor`` (>= 1) relative to ``original_max_position_embeddings``."""

    method: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    #: True when the frequencies depend on the current sequence length (cached keys may not match a recompute)
    length_dependent: ClassVar[bool] = False

    factor: float = 1.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        name = type(self).__name__
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not self.factor >= 1.0:
            raise InvalidConfigError(
                f"{name}.factor must be a number >= 1 (the new length over the original one), got {self.factor!r}. "
                "A factor below 1 would shrink the context."
            )
        if not math.isfinite(self.factor):
            raise InvalidConfigError(f"{name}.factor must be finite, got {self.factor!r}.")
        if self.original_max_position_embeddings is not None:
            require_int_at_least(name, "original_max_position_embeddings", self.original_max_position_embeddings, 1)

    def with_original(self, original: int) -> RopeScaling:
        """A copy with ``original_max_position_embeddings`` filled in when it was left out."""
        if self.original_max_position_embeddings is not None:
            return self
        return dataclasses.replace(self, original_max_position_embeddings=original)

    def rope_parameters(self, rope_theta: float, rotary_dim: int) -> dict[str, Any]:
        """The ``config.rope_parameters`` entries for this scaling (rope_theta included)."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **dataclasses.asdict(self)}

    @classmethod
    def option_names(cls) -> list[str]:
        """The options a user may set (the record's keys besides ``method``)."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, **options: Any) -> RopeScaling:
        allowed = cls.option_names()
        for key in options:
            if key not in allowed:
                raise InvalidOptionError(
                    f"RoPE scaling '{cls.method}' ({cls.__name__}) has no option '{key}'. Its options are: "
                    f"{', '.join(allowed)}.{closest_hint(key, allowed)}"
                )
        return cls(**options)


def register_scaling(cls: type[RopeScaling]) -> type[RopeScaling]:
    return SCALING_REGISTRY.register(cls.method)(cls)


def scaling_from_dict(data: dict[str, Any]) -> RopeScaling:
    fields = dict(data)
    method = fields.pop("method", None)
    if not isinstance(method, str):
        raise InvalidConfigError(f"A RoPE scaling record needs a string 'method' key, got {method!r} in {data!r}.")
    return SCALING_REGISTRY.get(method).from_options(**fields)


@register_scaling
@dataclass
class LinearScaling(RopeScaling):
    """Position interpolation: positions divided by ``factor`` (Chen et al. 2023, arXiv:2306.15595)."""

    method = "linear"
    paper = "Chen et al. 2023, Position Interpolation (arXiv:2306.15595)"

    def rope_parameters(self, rope_theta: float, rotary_dim: int) -> dict[str, Any]:
        return {"rope_type": "linear", "rope_theta": rope_theta, "factor": float(self.factor)}


@register_scaling
@dataclass
class NTKScaling(RopeScaling):
    """Static NTK-aware scaling: base' = base * factor^(d / (d - 2)) (bloc97 2023, "NTK-Aware Scaled RoPE"),
    d the rotated dimension. Expressed as plain RoPE with the new base."""

    method = "ntk"
    paper = "bloc97 2023, NTK-Aware Scaled RoPE; Peng et al. 2023 (YaRN, arXiv:2309.00071) §3.1"

    def rope_parameters(self, rope_theta: float, rotary_dim: int) -> dict[str, Any]:
        return {"rope_type": "default", "rope_theta": ntk_theta(rope_theta, self.factor, rotary_dim)}


def ntk_theta(rope_theta: float, factor: float, rotary_dim: int) -> float:
    """base * s^(d/(d-2)): the NTK-aware base for a scale ``s`` and rotated dimension ``d`` (bloc97 2023; Peng et al.
    2023, YaRN §3.1); ``inf`` when it overflows (the caller refuses a base that large)."""
    try:
        return float(rope_theta * factor ** (rotary_dim / (rotary_dim - 2)))
    except OverflowError:
        return math.inf


@register_scaling
@dataclass
class DynamicNTKScaling(RopeScaling):
    """Dynamic NTK (emozilla 2023; Peng et al. 2023 §3.3): the NTK base grows with the current length L past the
    original length: base * (factor * L / L0 - (factor - 1))^(d/(d-2)); unchanged at or below L0."""

    method = "dynamic"
    paper = "emozilla 2023, Dynamically Scaled RoPE; Peng et al. 2023 (arXiv:2309.00071) §3.3"
    length_dependent = True

    def rope_parameters(self, rope_theta: float, rotary_dim: int) -> dict[str, Any]:
        return {"rope_type": "dynamic", "rope_theta": rope_theta, "factor": float(self.factor)}


@register_scaling
@dataclass
class YarnScaling(RopeScaling):
    """YaRN (Peng et al. 2023, arXiv:2309.00071): NTK-by-parts interpolation between ``beta_slow`` and
    ``beta_fast`` rotations, and attention temperature 0.1 ln(s) + 1 multiplied into cos and sin."""

    method = "yarn"
    paper = "Peng et al. 2023, YaRN (arXiv:2309.00071)"

    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def validate(self) -> None:
        super().validate()
        require_positive("YarnScaling", "beta_fast", self.beta_fast)
        require_positive("YarnScaling", "beta_slow", self.beta_slow)
        if self.beta_fast <= self.beta_slow:
            raise InvalidConfigError(
                f"YarnScaling.beta_fast ({self.beta_fast}) must exceed beta_slow ({self.beta_slow})."
            )
        if self.attention_factor is not None:
            require_positive("YarnScaling", "attention_factor", self.attention_factor)

    def rope_parameters(self, rope_theta: float, rotary_dim: int) -> dict[str, Any]:
        params = {
            "rope_type": "yarn",
            "rope_theta": rope_theta,
            "factor": float(self.factor),
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": float(self.beta_fast),
            "beta_slow": float(self.beta_slow),
        }
        if self.attention_factor is not None:
            params["attention_factor"] = float(self.attention_factor)
        return params


@register_scaling
@dataclass
class LongRopeScaling(RopeScaling):
    """LongRoPE (Ding et al. 2024, arXiv:2402.13753): one rescale factor per frequency, ``short_factor`` up to the
    original length and ``long_factor`` past it; attention factor sqrt(1 + ln s / ln L0)."""

    method = "longrope"
    paper = "Ding et al. 2024, LongRoPE (arXiv:2402.13753)"
    length_dependent = True

    short_factor: list[float] | None = None
    long_factor: list[float] | None = None
    attention_factor: float | None = None

    def validate(self) -> None:
        super().validate()
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is None:
                raise InvalidConfigError(
                    f"LongRopeScaling needs `{name}`: a list of rotary_dim / 2 positive rescale factors, one per "
                    "frequency (e.g. from the LongRoPE search or a Phi-3 config)."
                )
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value
            ):
                raise InvalidConfigError(f"LongRopeScaling.{name} must be a list of positive numbers, got {value!r}.")
        if len(self.short_factor) != len(self.long_factor):  # type: ignore[arg-type]
            raise InvalidConfigError(
                f"LongRopeScaling.short_factor has {len(self.short_factor)} entries and long_factor "  # type: ignore[arg-type]
                f"{len(self.long_factor)}; both need one per frequency."  # type: ignore[arg-type]
            )
        if self.attention_factor is not None:
            require_positive("LongRopeScaling", "attention_factor", self.attention_factor)

    def check_dim(self, rotary_dim: int) -> None:
        if len(self.short_factor) != rotary_dim // 2:  # type: ignore[arg-type]
            raise InvalidConfigError(
                f"LongRopeScaling factors have {len(self.short_factor)} entries but this model rotates "  # type: ignore[arg-type]
                f"{rotary_dim} dims per head, so {rotary_dim // 2} are needed (one per frequency)."
            )

    def rope_parameters(self, rope_theta: float, rotary_dim: int) -> dict[str, Any]:
        self.check_dim(rotary_dim)
        params = {
            "rope_type": "longrope",
            "rope_theta": rope_theta,
            "factor": float(self.factor),
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "short_factor": [float(v) for v in self.short_factor],  # type: ignore[union-attr]
            "long_factor": [float(v) for v in self.long_factor],  # type: ignore[union-attr]
        }
        if self.attention_factor is not None:
            params["attention_factor"] = float(self.attention_factor)
        return params


@register_scaling
@dataclass
class Llama3Scaling(RopeScaling):
    """Llama 3.1's scaling (Meta 2024, "The Llama 3 Herd of Models"): low frequencies divided by ``factor``, high
    frequencies kept, a smooth ramp between ``low_freq_factor`` and ``high_freq_factor`` wavelengths."""

    method = "llama3"
    paper = "Grattafiori et al. 2024, The Llama 3 Herd of Models (arXiv:2407.21783)"

    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def validate(self) -> None:
        super().validate()
        require_positive("Llama3Scaling", "low_freq_factor", self.low_freq_factor)
        require_positive("Llama3Scaling", "high_freq_factor", self.high_freq_factor)
        if self.high_freq_factor <= self.low_freq_factor:
            raise InvalidConfigError(
                f"Llama3Scaling.high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor})."
            )

    def rope_parameters(self, rope_theta: float, rotary_dim: int) -> dict[str, Any]:
        return {
            "rope_type": "llama3",
            "rope_theta": rope_theta,
            "factor": float(self.factor),
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "low_freq_factor": float(self.low_freq_factor),
            "high_freq_factor": float(self.high_freq_factor),
        }
