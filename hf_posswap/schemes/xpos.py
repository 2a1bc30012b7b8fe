"""xPos, the extrapolatable rotary embedding (Sun et al. 2023, "A Length-Extrapolatable Transformer",
arXiv:2212.10554, §3.1-3.2): RoPE whose pair i of a query at position n is also scaled by zeta_i^(n / gamma) and of
a key at position m by zeta_i^(-m / gamma), so the logit of (n, m) carries zeta_i^((n - m) / gamma) and decays with
the distance n - m >= 0.

zeta_i = (2i / d + 0.4) / 1.4 for the d / 2 pairs of a head (the paper's gamma = 0.4), gamma = ``scale_base``
(512 in the paper and in both reference implementations, microsoft/torchscale
``torchscale/component/xpos_relative_position.py`` and lucidrains/x-transformers ``RotaryEmbedding(use_xpos=True)``).
Pairs use Hugging Face's rotate-half layout (dim i with i + d / 2), as :mod:`~hf_posswap.schemes.rope` does; the
references pair neighbours (2i, 2i + 1), which gives the same logits up to that permutation of q and k.

Causal only: for a key after the query (bidirectional attention) the factor zeta^((n - m) / gamma) grows with the
distance instead of decaying (the paper restricts xPos to causal models; x-transformers refuses it for
bidirectional attention). ``swap`` refuses encoders.

Float range: only n - m matters, so the positions are counted from a ``reference`` that the caller picks once per
attention call (the centre of the positions, as the references do): queries and keys must share it. The factors
are kept within 2^±100 (far inside float32 and bfloat16; 2^±14 for a float16 model); a span of positions that needs
more raises an error naming a ``scale_base`` that fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import InvalidConfigError
from .base import (
    ModelSpec,
    RotaryPositions,
    SchemeConfig,
    register_scheme,
    require_frequency_base,
    require_positive,
)
from .precision import exact_buffer
from .rope import DEFAULT_ROPE_THETA, default_inv_freq

#: the paper's gamma in zeta_i = (2i / d + gamma) / (1 + gamma)
XPOS_ZETA_OFFSET = 0.4
#: xPos factors stay within 2^±this (float32 and bfloat16 hold 2^±126 as normal numbers; the rest is headroom for q
#: and k); float16 holds 2^±14 as normal numbers and overflows at 2^16, so its factors stay within 2^±14
MAX_EXPONENT_BITS = {torch.float16: 14.0}
DEFAULT_EXPONENT_BITS = 100.0


def xpos_zeta(head_dim: int) -> torch.Tensor:
    """zeta_i = (2i + 0.4 d) / (1.4 d), i = 0 .. d/2 - 1 (Sun et al. 2023, §3.2): [d / 2], from 0.286 up to ~1."""
    return (torch.arange(0, head_dim, 2, dtype=torch.float32) + XPOS_ZETA_OFFSET * head_dim) / (
        (1 + XPOS_ZETA_OFFSET) * head_dim
    )


class XposEmbedding(RotaryPositions):
    """cos/sin of RoPE times xPos's factor, for queries (``keys=False``: zeta^((p - reference) / gamma)) or keys
    (``keys=True``: zeta^(-(p - reference) / gamma)), rotate-half layout over the whole head.

    ``inv_freq`` and ``zeta`` are persistent buffers (checkpoints carry them). Nothing depends on the current
    length, so keys can be stored rotated and scaled in a KV cache (see :mod:`~hf_posswap.core.rotary_cache`, which
    recognises xPos by ``scales_keys``).
    """

    #: the rotation of a position does not change with the current length
    length_dependent: ClassVar[bool] = False
    #: queries and keys get different factors: callers pass ``keys`` and a shared ``reference``
    scales_keys: ClassVar[bool] = True

    def __init__(self, rope_theta: float, head_dim: int, scale_base: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        # empty, follows model.to(dtype): the dtype q and k are scaled in, which bounds the factors
        self.register_buffer("_dtype_probe", torch.empty(0, dtype=dtype), persistent=False)
        self.rope_theta = rope_theta
        self.head_dim = head_dim
        self.scale_base = scale_base
        self.rotary_dim = head_dim
        self.register_buffer("inv_freq", default_inv_freq(rope_theta, head_dim))
        self.register_buffer("zeta", xpos_zeta(head_dim))
        self._log_smallest = _log_smallest_zeta(head_dim)

    @property
    def max_span(self) -> int:
        """The largest |position - reference| whose factors stay within range for the model's dtype."""
        log_smallest = self.__dict__.get("_log_smallest")  # kept by __init__: compiled code reads it as a constant
        if log_smallest is None:
            log_smallest = self.__dict__["_log_smallest"] = _log_smallest_zeta(self.head_dim)
        return int(_span_per_scale_base(self.head_dim, self._dtype_probe.dtype, log_smallest) * self.scale_base)

    def frequencies(self, seq_len: int | None, device: torch.device) -> tuple[torch.Tensor, float]:
        """inv_freq [d / 2] and the attention factor (1: xPos scales per pair instead), as RoPE's module answers."""
        return self._inv_freq().to(device), 1.0

    def _inv_freq(self) -> torch.Tensor:
        return exact_buffer(self, "inv_freq", lambda: default_inv_freq(self.rope_theta, self.head_dim))

    def forward(
        self,
        positions: torch.Tensor,
        seq_len: int | None = None,
        keys: bool = False,
        reference: int | torch.Tensor = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [P] or [B, P] (reference: an int, or [B, 1]) -> cos, sin [..., P, head_dim] (float32, or float64
        # for a model cast to float64)
        inv_freq = self._inv_freq()
        zeta = exact_buffer(self, "zeta", lambda: xpos_zeta(self.head_dim))
        dtype = inv_freq.dtype  # float32, or float64 for a model cast to float64
        positions = positions.to(dtype)
        freqs = positions[..., None] * inv_freq  # [..., P, d/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [..., P, d]
        power = (positions - reference) / self.scale_base  # [..., P]
        self._check_span(power)
        if keys:
            power = -power
        scale = zeta.to(dtype) ** power[..., None]  # [..., P, d/2]
        scale = torch.cat((scale, scale), dim=-1)  # [..., P, d]
        return angles.cos() * scale, angles.sin() * scale

    def _check_span(self, power: torch.Tensor) -> None:
        """Refuse positions whose factors would leave float32's comfortable range (they overflow near 2^126)."""
        if power.is_meta or not power.numel():
            return
        if torch.compiler.is_compiling():  # checked in the graph: a host read would break it once per call
            torch._assert_async(
                power.abs().max() * self.scale_base <= self.max_span,
                f"xPos with scale_base={self.scale_base:g} got a position more than {self.max_span} tokens from "
                f"the reference, beyond what {str(self._dtype_probe.dtype).removeprefix('torch.')} keeps finite. "
                "Use shorter inputs, or swap with a larger XposConfig(scale_base=...).",
            )
            return
        farthest = float(power.abs().max()) * self.scale_base
        if farthest > self.max_span:
            needed = farthest * self.scale_base / self.max_span
            dtype = str(self._dtype_probe.dtype).removeprefix("torch.")
            raise InvalidConfigError(
                f"xPos with scale_base={self.scale_base:g} scales a position {farthest:.0f} tokens from the reference "
                f"by zeta^({farthest / self.scale_base:.1f}), beyond what {dtype} keeps finite (spans up to "
                f"{self.max_span} tokens). Use inputs of at most {self.max_span} tokens from the centre, or swap "
                f"with XposConfig(scale_base>={math.ceil(needed)})."
            )

    def extra_repr(self) -> str:
        return f"rope_theta={self.rope_theta:g}, head_dim={self.head_dim}, scale_base={self.scale_base:g}"


def xpos_max_span(head_dim: int, scale_base: float, dtype: torch.dtype = torch.float32) -> int:
    """Positions from the reference whose factor zeta_0^(±span / gamma) stays within 2^±bits for ``dtype``."""
    return int(_span_per_scale_base(head_dim, dtype) * scale_base)


def _span_per_scale_base(head_dim: int, dtype: torch.dtype, log_smallest: float | None = None) -> float:
    """The span :func:`xpos_max_span` gives per unit of gamma (the span is proportional to it); ``log_smallest``:
    :func:`_log_smallest_zeta` of ``head_dim`` when the caller keeps it."""
    if log_smallest is None:
        log_smallest = _log_smallest_zeta(head_dim)
    bits = MAX_EXPONENT_BITS.get(dtype, DEFAULT_EXPONENT_BITS)
    return bits * math.log(2) / -log_smallest


def _log_smallest_zeta(head_dim: int) -> float:
    """log of the smallest decay rate zeta_0 (it bounds the factors of a span)."""
    with torch.device("cpu"):  # a model built on the meta device (from_pretrained) has no values to read
        return math.log(float(xpos_zeta(head_dim)[0]))


@register_scheme
@dataclass
class XposConfig(SchemeConfig):
    """xPos: RoPE with a per-frequency decay of the logit with distance, for causal (decoder) models only.

    Args:
        rope_theta: the frequency base. ``None`` keeps the model's own base when it has RoPE, else 10000.
        scale_base: gamma, the distance over which the factor zeta_i^(distance / gamma) falls once by zeta_i (512).
    """

    name = "xpos"
    kind = "rotary"
    paper = "Sun et al. 2023, A Length-Extrapolatable Transformer (xPos, arXiv:2212.10554)"
    #: swap refuses models whose self-attention is bidirectional
    causal_only: ClassVar[bool] = True

    rope_theta: float | None = None
    scale_base: float = 512.0

    def validate(self) -> None:
        if self.rope_theta is not None:
            require_positive("XposConfig", "rope_theta", self.rope_theta)
            require_frequency_base("XposConfig", "rope_theta", self.rope_theta)
        require_positive("XposConfig", "scale_base", self.scale_base)

    def resolve(self, spec: ModelSpec) -> XposConfig:
        if not spec.is_causal:
            raise InvalidConfigError(
                f"xPos is for causal attention only, and this '{spec.model_type}' model's self-attention is "
                "bidirectional: a key after its query would get the factor zeta^((n - m) / scale_base) > 1, which "
                "grows with the distance instead of decaying (Sun et al. 2023 define xPos for causal models). Use "
                "'rope' for an encoder, or a decoder (e.g. BertConfig(is_decoder=True))."
            )
        if spec.head_dim % 2:
            raise InvalidConfigError(f"xPos rotates pairs of dims; this model's head_dim {spec.head_dim} is odd.")
        if xpos_max_span(spec.head_dim, self.scale_base, spec.dtype) < 1:  # every forward pass would be refused
            length = spec.max_positions or 1
            needed = math.ceil(length / _span_per_scale_base(spec.head_dim, spec.dtype))
            raise InvalidConfigError(
                f"XposConfig.scale_base={self.scale_base!r} makes the factor zeta^(distance / scale_base) leave "
                f"{spec.dtype}'s range within one token, so no input could run. Use scale_base >= {needed} (inputs "
                f"of {length} tokens), or the paper's 512."
            )
        theta = self.rope_theta
        if theta is None:
            theta = spec.native_rope_theta if spec.native_rope_theta is not None else DEFAULT_ROPE_THETA
        return XposConfig(rope_theta=float(theta), scale_base=float(self.scale_base))

    def build(self, spec: ModelSpec) -> XposEmbedding:
        theta = float(self.rope_theta or DEFAULT_ROPE_THETA)
        return XposEmbedding(theta, spec.head_dim, self.scale_base, spec.dtype).to(spec.device)
