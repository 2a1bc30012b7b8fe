"""What a swapped model carries: its :class:`SwapState` in memory and, in ``config``, the ``posswap`` record and a
config class with model type ``hf_posswap_<family>`` (so ``save_pretrained`` writes what ``from_pretrained`` needs,
see ``hf_posswap.persistence.autoload``)."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..edits import Edit
from ..errors import InvalidConfigError
from ..schemes.base import SchemeConfig

STATE_ATTR = "_posswap_state"

CONFIG_RECORD = "posswap"

RECORD_VERSION = 1

MODEL_TYPE_PREFIX = "hf_posswap_"



@dataclass
class SwapState:
    """What ``swap`` did to a model, kept on the model so ``unswap`` and ``describe`` can read it."""

    config: SchemeConfig
    family: str
    native: bool
    edits: list[Edit]
    new_parameters: list[tuple[str, tuple[int, ...], bool]] = field(default_factory=list)
    #: set by ``extend_context``: method, original and current length, scaling parameters
    extension: dict[str, Any] | None = None
    #: the learned table's trained rows before any growth, so a second extension starts from them again
    original_table: Any = None


def swap_state(model: nn.Module) -> SwapState | None:
    """The :class:`SwapState` of a swapped model, else ``None``."""
    return getattr(model, STATE_ATTR, None)



def base_model_type(config: Any) -> str | None:
    """The family's own model type, for a plain or an hf_posswap config."""
    return getattr(config, "posswap_base_model_type", None) or getattr(config, "model_type", None)



@functools.cache
def posswap_config_class(base: type) -> type:
    """``PosSwap<Base>``: the base config class with model_type ``hf_posswap_<type>``.

    The class is also a module-level name of ``hf_posswap.core.state`` (:func:`_publish`), so configs and whole
    models pickle (``pickle.dumps(model.config)``, ``torch.save(model)``). Unpickling imports ``hf_posswap``,
    which registers every built-in family's classes first.
    """
    cls = type(
        f"PosSwap{base.__name__}",
        (base,),
        {
            "model_type": MODEL_TYPE_PREFIX + base.model_type,
            "posswap_base_model_type": base.model_type,
            "posswap_base_config_class": base,
            "__module__": __name__,
        },
    )
    return _publish(cls)



def check_record(record: Any) -> dict[str, Any]:
    """Validate a ``config.posswap`` record; unknown keys (a newer hf_posswap) are dropped with a warning."""
    if not isinstance(record, dict) or not isinstance(record.get("scheme"), str):
        raise InvalidConfigError(
            f"The checkpoint's config.posswap record is malformed: expected a dict with a string 'scheme', got "
            f"{record!r}. Re-save the model with hf_posswap, or fix config.json."
        )
    version = record.get("version", RECORD_VERSION)
    if not isinstance(version, int):
        raise InvalidConfigError(f"config.posswap.version must be an integer, got {version!r}.")
    if version > RECORD_VERSION:
        warnings.warn(
            f"This checkpoint was written by a newer hf_posswap (record version {version}, this one reads "
            f"{RECORD_VERSION}); loading what this version knows. Upgrade hf_posswap if the model misbehaves.",
            stacklevel=3,
        )
    return record



#: functions called with a model type each time a model of it is swapped (``hf_posswap.persistence.autoload`` adds
#: one that registers that family's Auto classes, so ``AutoModel*.from_config(swapped.config)`` works at once)
FAMILY_USED_HOOKS: list[Any] = []


def family_used(model_type: str) -> None:
    """Tell the hooks in :data:`FAMILY_USED_HOOKS` that a model of ``model_type`` is being swapped."""
    for hook in FAMILY_USED_HOOKS:
        hook(model_type)


#: class name -> a function that builds it: classes registered lazily (``hf_posswap.persistence.autoload``) that
#: pickle may look up on this module before anything built them
LAZY_CLASSES: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """PEP 562: a ``PosSwap<Config>`` class registered but not built yet (unpickling a config)."""
    build = LAZY_CLASSES.get(name)
    if build is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return build()


def _publish(cls: type) -> type:
    """Make ``cls`` reachable as ``hf_posswap.core.state.<name>`` (what pickle looks up)."""
    globals().setdefault(cls.__name__, cls)  # a clash of names (never among the built-in families) stays unpicklable
    return cls
