"""hf_posswap: swap the positional mechanism inside Hugging Face transformers models.

>>> import hf_posswap as ps
>>> ps.swap(model, "alibi")                                  # doctest: +SKIP
>>> ps.swap(model, ps.RopeConfig(rope_theta=10_000.0), replace=True)  # doctest: +SKIP
>>> print(ps.describe(model))                                # doctest: +SKIP

``import hf_posswap`` registers hf_posswap with transformers (attention functions, and the Auto classes that
reload swapped checkpoints: ``AutoModelForCausalLM.from_pretrained(swapped_dir)`` works after it) and imports the
swap API. LoRA helpers (peft) and ``export_standalone`` are imported on first use.

One process is different: the ``hf-posswap`` command itself (the console script, or ``python -m hf_posswap``). There
the package stays light, without torch, so that ``hf-posswap --help`` answers at once; every public name still
resolves on first use, and the commands register with transformers before they load a model. (The command is
recognised by its console script's exact file name, so a program of your own named exactly ``hf-posswap``,
without an extension, would skip the registration.)
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:
    from .core.context_parallel import context_parallel
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
    from .evaluation.self_check import self_check
    from .families import FamilyAdapter, register_family
    from .persistence.adapters import load_adapter, lora_config, save_adapter, trainable_position_modules
    from .persistence.export import export_standalone
    from .persistence.native_smollm3 import save_native
    from .schemes import (
        AlibiConfig,
        FireConfig,
        HeadMix,
        KerpleConfig,
        LayerMix,
        LearnedConfig,
        NoPEConfig,
        ProportionalRopeConfig,
        RopeConfig,
        SandwichConfig,
        SchemeConfig,
        SinusoidalConfig,
        T5BiasConfig,
        XposConfig,
        register_scheme,
    )
    from .schemes.presets import cohere2_sliding_rope, llama4_irope, smollm3_nope
    from .schemes.rope_scaling import (
        DynamicNTKScaling,
        LinearScaling,
        Llama3Scaling,
        LongRopeScaling,
        NTKScaling,
        RopeScaling,
        YarnScaling,
    )
    from .schemes.two_pass import ReRoPE, SelfExtend

#: public name -> the module (below hf_posswap) that defines it
_EXPORTS = {
    **dict.fromkeys(("PositionDescription", "describe"), "core.describe"),
    **dict.fromkeys(("available_extension_methods", "extend_context"), "core.extend"),
    **dict.fromkeys(("available_schemes", "supported_families", "swap", "unswap"), "core.swap"),
    **dict.fromkeys(("AlreadySwappedError", "IncompatibleAttentionError", "InvalidConfigError", "InvalidOptionError",
                     "NotSwappedError", "PosSwapError", "UnknownSchemeError", "UnsupportedFamilyError"), "errors"),
    **dict.fromkeys(("FamilyAdapter", "register_family"), "families"),
    **dict.fromkeys(("cohere2_sliding_rope", "llama4_irope", "smollm3_nope"), "schemes.presets"),
    **dict.fromkeys(("HeadMix", "LayerMix"), "schemes"),
    **dict.fromkeys(("AlibiConfig", "FireConfig", "KerpleConfig", "LearnedConfig", "NoPEConfig",
                     "ProportionalRopeConfig", "RopeConfig", "SandwichConfig", "SchemeConfig", "SinusoidalConfig",
                     "T5BiasConfig", "XposConfig", "register_scheme"), "schemes"),
    **dict.fromkeys(("DynamicNTKScaling", "LinearScaling", "Llama3Scaling", "LongRopeScaling", "NTKScaling",
                     "RopeScaling", "YarnScaling"), "schemes.rope_scaling"),
    **dict.fromkeys(("ReRoPE", "SelfExtend"), "schemes.two_pass"),
    # imported on first use in every process: peft's helpers, the standalone export and save_native
    **dict.fromkeys(("load_adapter", "lora_config", "save_adapter", "trainable_position_modules"),
                    "persistence.adapters"),
    "export_standalone": "persistence.export",
    "context_parallel": "core.context_parallel",
    "self_check": "evaluation.self_check",
    "save_native": "persistence.native_smollm3",
}
_ON_FIRST_USE = ("core.context_parallel", "persistence.adapters", "persistence.export", "persistence.native_smollm3",
                 "evaluation.self_check")
#: the names pip gives the ``hf-posswap`` console script (POSIX; Windows launcher and its script)
_CONSOLE_SCRIPTS = ("hf-posswap", "hf-posswap.exe", "hf-posswap-script.py")
#: the ``-m`` targets that are the command line
_CLI_MODULES = ("hf_posswap", "hf_posswap.cli", "hf_posswap.cli.main", "hf_posswap.cli.finetune")

__all__ = [
    "AlibiConfig",
    "AlreadySwappedError",
    "DynamicNTKScaling",
    "FamilyAdapter",
    "FireConfig",
    "HeadMix",
    "IncompatibleAttentionError",
    "InvalidConfigError",
    "InvalidOptionError",
    "KerpleConfig",
    "LayerMix",
    "LearnedConfig",
    "LinearScaling",
    "Llama3Scaling",
    "LongRopeScaling",
    "NTKScaling",
    "NoPEConfig",
    "NotSwappedError",
    "PosSwapError",
    "PositionDescription",
    "ProportionalRopeConfig",
    "ReRoPE",
    "RopeConfig",
    "RopeScaling",
    "SandwichConfig",
    "SchemeConfig",
    "SelfExtend",
    "SinusoidalConfig",
    "T5BiasConfig",
    "UnknownSchemeError",
    "UnsupportedFamilyError",
    "XposConfig",
    "YarnScaling",
    "__version__",
    "available_extension_methods",
    "available_schemes",
    "cohere2_sliding_rope",
    "context_parallel",
    "describe",
    "export_standalone",
    "extend_context",
    "llama4_irope",
    "load_adapter",
    "lora_config",
    "register_family",
    "register_scheme",
    "save_adapter",
    "save_native",
    "self_check",
    "smollm3_nope",
    "supported_families",
    "swap",
    "trainable_position_modules",
    "unswap",
]


def __getattr__(name: str) -> Any:
    """PEP 562: a public name is imported from its module on first use, then kept."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def _command_line_process() -> bool:
    """Whether this process is the ``hf-posswap`` command (its console script, or ``python -m`` one of the CLI
    modules), which registers with transformers itself before it loads a model."""
    if Path(sys.argv[0]).name in _CONSOLE_SCRIPTS:
        return True
    argv = getattr(sys, "orig_argv", [])
    return any(flag == "-m" and target in _CLI_MODULES for flag, target in zip(argv, argv[1:], strict=False))


if not _command_line_process():
    from .persistence.autoload import register_config_classes as _register

    _register()
    for _name, _module in _EXPORTS.items():  # the swap API, imported now as any plain import would
        if _module not in _ON_FIRST_USE:
            __getattr__(_name)
    del _name, _module
