"""Proportional RoPE, p-RoPE (Barbero et al. 2024, "Round and Round We Go! What makes Rotary Positional Encodings
useful?", arXiv:2410.06205, §6): rotate only the highest frequencies and leave the lowest ones unrotated.

transformers' rope type ``"proportional"`` (``modeling_rope_utils._compute_proportional_rope_parameters``) defines
it: with ``a = int(p * head_dim // 2)`` rotated pairs, inv_freq_i = theta^(-2i / head_dim) for i < a and 0 for
a <= i < head_dim / 2. The frequencies kept are exactly RoPE's a highest ones over the *whole* head.

Its layout differs from partial RoPE (``RopeConfig(partial_rotary_factor=p)``, GPT-NeoX and Phi-3), which rotates
the first r = p * head_dim dims with frequencies theta^(-2i / r) and pairs dim i with i + r / 2. p-RoPE keeps the
rotate-half pairing of the whole head (dim i with i + head_dim / 2); the unrotated dims are the pairs
a .. head_dim / 2 - 1, i.e. dims [a, d/2) and [d/2 + a, d), not a tail of the head. cos/sin span the whole head,
so a LLaMA-like model carries p-RoPE natively in ``config.rope_parameters``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidConfigError
from .base import ModelSpec, register_scheme
from .rope import DEFAULT_ROPE_THETA, RopeConfig, RotaryEmbedding


def proportional_rope_angles(head_dim: int, partial_rotary_factor: float) -> int:
    """Rotated pairs of a head, counted as transformers counts them: int(p * head_dim // 2)."""
    return int(partial_rotary_factor * head_dim // 2)


@register_scheme
@dataclass
class ProportionalRopeConfig(RopeConfig):
    """p-RoPE: RoPE on the highest ``partial_rotary_factor`` fraction of each head's frequencies, none on the rest.

    Args:
        rope_theta: the frequency base. ``None`` keeps the model's own base when it has RoPE, else 10000.
        partial_rotary_factor: the fraction p of frequency pairs that rotate (the paper's ``rope_percentage``);
            the lowest 1 - p are set to 0. 1.0 is plain RoPE.
        scaling: must stay ``None``: transformers' proportional rope type takes no context scaling.
    """

    name = "proportional"
    kind = "rotary"
    paper = "Barbero et al. 2024, Round and Round We Go! (p-RoPE, arXiv:2410.06205)"

    partial_rotary_factor: float = 0.75

    def validate(self) -> None:
        super().validate()
        if self.scaling is not None:
            raise InvalidConfigError(
                f"ProportionalRopeConfig.scaling must be None, got {self.scaling!r}: transformers' 'proportional' rope "
                "type has no context scaling, so p-RoPE cannot be scaled or extended. Swap to "
                "hf_posswap.RopeConfig(scaling=...) for a scaled RoPE, or keep p-RoPE at its trained length."
            )

    @property
    def rotates_full_head(self) -> bool:
        """cos/sin always span the whole head (unrotated pairs have frequency 0)."""
        return True

    def rope_parameters(self, head_dim: int) -> dict[str, Any]:
        """The ``config.rope_parameters`` transformers reads for p-RoPE."""
        return {
            "rope_type": "proportional",
            "rope_theta": float(self.rope_theta or DEFAULT_ROPE_THETA),
            "partial_rotary_factor": float(self.partial_rotary_factor),
        }

    def resolve(self, spec: ModelSpec) -> ProportionalRopeConfig:
        resolved = super().resolve(spec)
        self.check_head(spec.head_dim)  # before any edit, native (LLaMA) or in attention alike
        return resolved  # type: ignore[return-value]

    def build(self, spec: ModelSpec) -> RotaryEmbedding:
        length = spec.max_positions or 2048
        return RotaryEmbedding(self.rope_parameters(spec.head_dim), spec.head_dim, length).to(spec.device)

    def check_head(self, head_dim: int) -> None:
        """At least one pair must rotate, and heads must split into pairs."""
        angles = proportional_rope_angles(head_dim, self.partial_rotary_factor)
        if head_dim % 2 or angles < 1:
            raise InvalidConfigError(
                f"ProportionalRopeConfig.partial_rotary_factor={self.partial_rotary_factor} rotates {angles} of "
                f"{head_dim // 2} frequency pairs of a {head_dim}-dim head; p-RoPE needs an even head_dim and at "
                f"least one rotated pair. Use partial_rotary_factor >= {2 / head_dim:.3g}."
            )
