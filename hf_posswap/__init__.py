"""hf_posswap: swap the positional mechanism inside Hugging Face transformers models.

>>> import hf_posswap as ps
>>> ps.swap(model, "alibi")                                  # doctest: +SKIP
>>> ps.swap(model, ps.RopeConfig(rope_theta=10_000.0), replace=True)  # doctest: +SKIP
>>> print(ps.describe(model))                                # doctest: +SKIP
"""

from .core import attention as _attention  # noqa: F401  (registers posswap_eager / posswap_sdpa)
from .core.describe import PositionDescription, describe
from .core.extend import available_extension_methods, extend_context
from .core.swap import available_schemes, supported_families, swap, unswap
from .errors import (
    AlreadySwappedError,
    IncompatibleAttentionError,
    InvalidConfigError,
    InvalidOptionError,
    NotSwappedError,
    PosSwapError,
    UnknownSchemeError,
    UnsupportedFamilyError,
)
from .families import FamilyAdapter, register_family
from .persistence.adapters import load_adapter, lora_config, save_adapter, trainable_position_modules
from .persistence.autoload import register_auto_classes as _register_auto_classes  # noqa: E402
from .persistence.export import export_standalone
from .schemes import (
    AlibiConfig,
    LearnedConfig,
    NoPEConfig,
    RopeConfig,
    SchemeConfig,
    SinusoidalConfig,
    T5BiasConfig,
    register_scheme,
)
from .schemes.rope_scaling import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRopeScaling,
    NTKScaling,
    RopeScaling,
    SelfExtend,
    YarnScaling,
)
from .version import __version__

_register_auto_classes(supported_families())

__all__ = [
    "DynamicNTKScaling",
    "LinearScaling",
    "Llama3Scaling",
    "LongRopeScaling",
    "NTKScaling",
    "RopeScaling",
    "SelfExtend",
    "YarnScaling",
    "available_extension_methods",
    "export_standalone",
    "extend_context",
    "load_adapter",
    "lora_config",
    "save_adapter",
    "trainable_position_modules",
    "AlibiConfig",
    "AlreadySwappedError",
    "FamilyAdapter",
    "IncompatibleAttentionError",
    "InvalidConfigError",
    "InvalidOptionError",
    "LearnedConfig",
    "NoPEConfig",
    "NotSwappedError",
    "PosSwapError",
    "PositionDescription",
    "RopeConfig",
    "SchemeConfig",
    "SinusoidalConfig",
    "T5BiasConfig",
    "UnknownSchemeError",
    "UnsupportedFamilyError",
    "__version__",
    "available_schemes",
    "describe",
    "register_family",
    "register_scheme",
    "supported_families",
    "swap",
    "unswap",
]
