"""Position schemes. Importing this package registers every built-in scheme, in this order."""

# isort: off
from .two_pass import ReRoPE, SelfExtend  # registers the two-pass RoPE scalings
from .learned import LearnedConfig, LearnedPositions
from .sinusoidal import SinusoidalConfig, SinusoidalPositions, sinusoidal_table
from .nope import NoPEConfig
from .rope import RopeConfig, RotaryEmbedding, apply_rotary, rotate_half
from .alibi import AlibiBias, AlibiConfig, alibi_slopes
from .t5 import T5BiasConfig, T5RelativeBias, relative_position_bucket
from .kerple import KerpleBias, KerpleConfig
from .sandwich import SandwichBias, SandwichConfig
from .fire import FireBias, FireConfig
from .xpos import XposConfig, XposEmbedding
from .proportional import ProportionalRopeConfig
from .head_mix import HeadMix, HeadMixPositions
from .mix import LayerMix, MixPositions

# isort: on

from .base import (
    SCHEME_REGISTRY,
    AbsolutePositions,
    BiasPositions,
    ModelSpec,
    NoPositions,
    RotaryPositions,
    SchemeConfig,
    register_scheme,
    scheme_config_from_dict,
)

__all__ = [
    "SCHEME_REGISTRY",
    "AbsolutePositions",
    "AlibiBias",
    "AlibiConfig",
    "BiasPositions",
    "FireBias",
    "FireConfig",
    "HeadMix",
    "HeadMixPositions",
    "KerpleBias",
    "KerpleConfig",
    "LayerMix",
    "LearnedConfig",
    "LearnedPositions",
    "MixPositions",
    "ModelSpec",
    "NoPEConfig",
    "NoPositions",
    "ProportionalRopeConfig",
    "ReRoPE",
    "RopeConfig",
    "RotaryEmbedding",
    "RotaryPositions",
    "SandwichBias",
    "SandwichConfig",
    "SchemeConfig",
    "SelfExtend",
    "SinusoidalConfig",
    "SinusoidalPositions",
    "T5BiasConfig",
    "T5RelativeBias",
    "XposConfig",
    "XposEmbedding",
    "alibi_slopes",
    "apply_rotary",
    "register_scheme",
    "relative_position_bucket",
    "rotate_half",
    "scheme_config_from_dict",
    "sinusoidal_table",
]
