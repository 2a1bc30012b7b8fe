"""NoPE: no position signal at all (Kazemnejad et al. 2023, "The Impact of Positional Encoding on Length
Generalization in Transformers"). A causal mask alone lets a decoder infer positions; an encoder becomes a
bag of tokens."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ModelSpec, SchemeConfig, register_scheme


@register_scheme
@dataclass
class NoPEConfig(SchemeConfig):
    """No position information: the model's table or rotary is removed and nothing replaces it."""

    name = "none"
    kind = "none"
    paper = "Kazemnejad et al. 2023 (arXiv:2305.19466)"

    def build(self, spec: ModelSpec) -> None:
        return None
