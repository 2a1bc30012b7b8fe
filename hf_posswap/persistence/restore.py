"""Replay a swap (and context extension) recorded in ``config.posswap`` on a freshly built model, and check what
was loaded around it.

``from_pretrained`` builds models on the meta device, so the swap replayed in ``__init__`` replaces *meta*
native modules (GPT-2's ``wpe``, LLaMA's ``rotary_emb``, BERT's position buffers). After the weights load,
:func:`after_load` refuses position weights that the checkpoint lacks or holds in excess (never invented, never
dropped), and wraps the swap's edits so that ``unswap`` / ``swap(replace=True)`` rebuild the native modules the
way transformers initialises them. A rotary module or a position buffer is deterministic and comes back exactly;
a learned table was never saved in a swapped checkpoint, so it comes back freshly initialised with a
:class:`NativeWeightsMissingWarning` naming it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from typing import Any

from torch import nn

from ..core.context import POSITIONS_ATTR
from ..core.native import install_native_restorers
from ..core.state import MODEL_TYPE_PREFIX, check_record, swap_state
from ..edits import Edit
from ..errors import InvalidConfigError, PosSwapError
from ..schemes.base import (
    SCHEME_REGISTRY,
    AbsolutePositions,
    BiasPositions,
    NativeWeightsMissingWarning,
    RotaryPositions,
    SchemeConfig,
)
from ..schemes.rope_scaling import SCALING_REGISTRY

BOOKKEEPING = ("version", "family", "scheme", "extension", "native")
#: the module ``export_standalone`` writes beside a checkpoint, which config.json's ``auto_map`` names
REMOTE_MODULE = "modeling_posswap"


def scheme_from_record(record: dict[str, Any]) -> SchemeConfig:
    """The scheme config of a record, ignoring (with a warning) fields this version does not know."""
    cls = SCHEME_REGISTRY.get(record["scheme"])
    known = {f.name for f in dataclasses.fields(cls)}
    fields = {key: value for key, value in record.items() if key not in BOOKKEEPING}
    unknown = sorted(set(fields) - known)
    if unknown:
        warnings.warn(
            f"config.posswap has fields this hf_posswap does not know for scheme '{cls.name}': {unknown}; "
            "they are ignored (written by a newer version?).",
            stacklevel=4,
        )
    fields = {key: value for key, value in fields.items() if key in known}
    scaling = fields.get("scaling")
    if isinstance(scaling, dict):
        scaling_cls = SCALING_REGISTRY.get(scaling.get("method", ""))
        scaling_known = {f.name for f in dataclasses.fields(scaling_cls)} | {"method"}
        fields["scaling"] = {key: value for key, value in scaling.items() if key in scaling_known}
    try:
        return cls.from_options(**fields)
    except (TypeError, ValueError) as error:
        raise InvalidConfigError(f"The checkpoint's config.posswap record is malformed: {error}") from error


def restore_swap(model: nn.Module, record: Any) -> None:
    """Swap ``model`` as ``record`` says, then re-apply its recorded context length."""
    from ..core.extend import replay_extension
    from ..core.swap import swap
    from ..families.base import get_family

    record = check_record(record)
    config = scheme_from_record(record)
    family = record.get("family")
    if family is not None and family != get_family(model).name:
        raise InvalidConfigError(
            f"The checkpoint's config.posswap record says family {family!r} but the model is "
            f"'{get_family(model).name}' ({type(model).__name__}): config.json was edited or mixed up after saving. "
            "Restore it as hf_posswap saved it."
        )
    # The loaded record and model type belong to the swap about to be replayed, not to the original model:
    # drop them so that unswap() returns a plain config.
    for attr in ("posswap", "model_type"):
        model.config.__dict__.pop(attr, None)
    try:
        swap(model, config)
    except PosSwapError as error:
        raise InvalidConfigError(f"Cannot rebuild the swapped model from config.posswap: {error}") from error
    extension = record.get("extension")
    if extension:
        replay_extension(model, extension)
    state = swap_state(model)
    state.edits.insert(0, ModelClassEdit(model))  # reverted last: unswap gives back the family's own class


class ModelClassEdit(Edit):
    """The loaded model is an instance of the registered ``PosSwap<Model>`` subclass; reverting makes it the
    family's own class again (the subclass adds only loading code), as an in-memory model is."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.loaded_class = model, type(model)
        self.base_class = next(c for c in type(model).__mro__[1:] if not c.__name__.startswith("PosSwap"))
        self.where = ""

    def apply(self) -> None:
        self.model.__class__ = self.loaded_class

    def revert(self) -> None:
        self.model.__class__ = self.base_class


# --- after from_pretrained -----------------------------------------------------------------------------------


def after_load(model: nn.Module, info: dict[str, Any], source: Any = None) -> None:
    """Checks and fix-ups once ``from_pretrained`` has loaded a swapped checkpoint into ``model``."""
    check_position_weights(model, info, source)
    install_native_restorers(model)
    _forget_export_code(model)


def _forget_export_code(model: nn.Module) -> None:
    """A model that hf_posswap itself loaded from an ``export_standalone`` folder does not carry the folder's
    ``modeling_posswap.py``, so config.json's ``auto_map`` naming it would make every later save a checkpoint whose
    remote code is missing. Dropped here; a model loaded as remote code (``trust_remote_code``, its class registered
    for an Auto class) keeps it, and transformers copies the file when it saves."""
    auto_map = getattr(model.config, "auto_map", None)
    if getattr(type(model), "_auto_class", None) is not None or not isinstance(auto_map, dict):
        return
    names = [name for value in auto_map.values() for name in (value if isinstance(value, (list, tuple)) else [value])]
    if any(isinstance(name, str) and name.startswith(f"{REMOTE_MODULE}.") for name in names):
        del model.config.auto_map


def position_module_paths(model: nn.Module) -> list[str]:
    """Qualified names of the modules that carry positions (scheme modules and their stand-ins)."""
    from ..families.base import IdentityRotary

    kinds = (AbsolutePositions, RotaryPositions, BiasPositions, IdentityRotary)
    return [name for name, module in model.named_modules() if name and isinstance(module, kinds)]


def _under(key: str, paths: Iterable[str]) -> bool:
    return POSITIONS_ATTR in key.split(".") or any(key == p or key.startswith(p + ".") for p in paths)


def check_position_weights(model: nn.Module, info: dict[str, Any], source: Any = None) -> None:
    """Raise when position weights are missing from the checkpoint (they would be invented) or left over in it
    (they would be dropped); warn for those re-initialised on request (``ignore_mismatched_sizes=True``)."""
    paths = position_module_paths(model)
    where = f" at {source}" if source is not None else ""
    scheme = getattr(swap_state(model), "config", None)
    scheme_name = getattr(scheme, "name", "?")
    missing = sorted(k for k in info.get("missing_keys") or () if _under(k, paths))
    if missing:
        raise InvalidConfigError(
            f"The checkpoint{where} lacks the position weights {missing} that its config.posswap record (scheme "
            f"'{scheme_name}') needs; loading would fill them with fresh random values instead of trained ones. "
            "The weight file was changed after saving or belongs to another swap: re-save the swapped model."
        )
    unexpected = sorted(k for k in info.get("unexpected_keys") or () if _under(k, paths))
    if unexpected:
        raise InvalidConfigError(
            f"The checkpoint{where} holds position weights {unexpected} that the swap recorded in its "
            f"config.posswap (scheme '{scheme_name}') does not use; loading would drop them. config.json was "
            "edited after saving: restore its original 'posswap' record, or re-save the swapped model."
        )
    mismatched = sorted(_key(k) for k in info.get("mismatched_keys") or () if _under(_key(k), paths))
    if mismatched:
        warnings.warn(
            f"Position weights {mismatched} did not match the checkpoint{where} in shape and were re-initialised "
            "(ignore_mismatched_sizes=True): they hold random values, not trained ones.",
            NativeWeightsMissingWarning,
            stacklevel=4,
        )


def _key(entry: Any) -> str:
    return entry[0] if isinstance(entry, tuple) else str(entry)



# --- checkpoints loaded as the wrong model ------------------------------------------------------------------


def check_checkpoint_keys(config: dict[str, Any], weight_keys: Iterable[str], where: str = "") -> None:
    """Before loading: refuse a checkpoint whose weights hold hf_posswap position tensors (``posswap_positions.*``)
    while config.json does not say it is a swapped model (``model_type`` not ``hf_posswap_<family>``)."""
    model_type = str(config.get("model_type", ""))
    if model_type.startswith(MODEL_TYPE_PREFIX):
        return
    found = sorted(key for key in weight_keys if POSITIONS_ATTR in key.split("."))
    if found:
        raise InvalidConfigError(
            f"The checkpoint{f' at {where}' if where else ''} holds hf_posswap position weights {found[:4]} but its "
            f"config.json says model_type '{model_type}', so it would load as the plain model and drop them. "
            f"Set \"model_type\": \"{MODEL_TYPE_PREFIX}{model_type}\" and restore its 'posswap' record."
        )
