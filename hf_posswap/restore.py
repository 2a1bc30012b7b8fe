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
import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .autoload import MODEL_TYPE_PREFIX, check_record
from .edits import Edit
from .errors import InvalidConfigError, PosSwapError
from .schemes.base import (
    FRESH_MARK,
    SCHEME_REGISTRY,
    AbsolutePositions,
    BiasPositions,
    NativeWeightsMissingWarning,
    RotaryPositions,
    SchemeConfig,
)
from .schemes.rope_scaling import SCALING_REGISTRY

BOOKKEEPING = ("version", "family", "scheme", "extension")
POSITIONS_ATTR = "posswap_positions"


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
    from .extend import replay_extension
    from .families.base import get_family
    from .swap import swap

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
    state = _state(model)
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


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


# --- after from_pretrained -----------------------------------------------------------------------------------


def after_load(model: nn.Module, info: dict[str, Any], source: Any = None) -> None:
    """Checks and fix-ups once ``from_pretrained`` has loaded a swapped checkpoint into ``model``."""
    check_position_weights(model, info, source)
    install_native_restorers(model)


def position_module_paths(model: nn.Module) -> list[str]:
    """Qualified names of the modules that carry positions (scheme modules and their stand-ins)."""
    from .families.base import IdentityRotary

    kinds = (AbsolutePositions, RotaryPositions, BiasPositions, IdentityRotary)
    return [name for name, module in model.named_modules() if name and isinstance(module, kinds)]


def _under(key: str, paths: Iterable[str]) -> bool:
    return POSITIONS_ATTR in key.split(".") or any(key == p or key.startswith(p + ".") for p in paths)


def check_position_weights(model: nn.Module, info: dict[str, Any], source: Any = None) -> None:
    """Raise when position weights are missing from the checkpoint (they would be invented) or left over in it
    (they would be dropped); warn for those re-initialised on request (``ignore_mismatched_sizes=True``)."""
    paths = position_module_paths(model)
    where = f" at {source}" if source is not None else ""
    scheme = getattr(_state(model), "config", None)
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


def _state(model: nn.Module) -> Any:
    from .swap import swap_state

    return swap_state(model)


def install_native_restorers(model: nn.Module) -> None:
    """Wrap every edit of the swap whose saved native value is a meta tensor/module (replayed on the meta device)
    or a freshly initialised stand-in, so reverting it rebuilds or flags the native value (see module doc)."""
    state = _state(model)
    if state is None:
        return
    state.edits[:] = [
        RestoreNative(edit, model) if _needs_restorer(edit) else edit for edit in state.edits
    ]


def _needs_restorer(edit: Edit) -> bool:
    if isinstance(edit, RestoreNative) or not hasattr(edit, "owner") or not hasattr(edit, "_old"):
        return False
    old = edit._old  # type: ignore[attr-defined]
    return is_meta(old) or bool(getattr(old, FRESH_MARK, False))


def is_meta(value: Any) -> bool:
    """Whether ``value`` is a meta tensor or a module holding one."""
    if isinstance(value, torch.Tensor):
        return value.is_meta
    if isinstance(value, nn.Module):
        return any(t.is_meta for t in (*value.parameters(), *value.buffers()))
    return False


class RestoreNative(Edit):
    """Stands in for a ``SetAttribute`` edit whose saved native value does not hold real data: on revert the
    value is rebuilt with transformers' own initialisation on the model's current device (a warning names the
    module when it has weights, which then are random), then the wrapped edit reverts as usual."""

    def __init__(self, edit: Edit, model: nn.Module) -> None:
        self.edit, self.model = edit, model
        self.where = edit.where

    def apply(self) -> None:
        self.edit.apply()

    def revert(self) -> None:
        edit: Any = self.edit
        old = edit._old
        path = _qualified_name(self.model, edit.owner, edit.attr)
        if is_meta(old):
            old = rebuild_native(self.model, edit.owner, edit.attr, old)
            edit._old = old
        if getattr(old, FRESH_MARK, False):
            warnings.warn(
                f"{path}: the checkpoint this model was loaded from holds no weights for this native position "
                "module (the swap had replaced it), so it is restored with transformers' initialisation — random "
                f"values, not the original model's. Load the original checkpoint for its trained {path}, or "
                "fine-tune it.",
                NativeWeightsMissingWarning,
                stacklevel=5,
            )
        edit.revert()


def _qualified_name(model: nn.Module, owner: Any, attr: str) -> str:
    for name, module in model.named_modules():
        if module is owner:
            return f"{name}.{attr}" if name else attr
    return attr


def rebuild_native(model: nn.Module, owner: Any, attr: str, old: Any) -> Any:
    """A real value for a meta module or tensor, initialised by ``model._init_weights`` as transformers would."""
    from .families.base import parameter_dtype_device

    dtype, device = parameter_dtype_device(model)
    if isinstance(old, torch.Tensor):
        return _rebuild_tensor(model, owner, attr, old, device)
    old.to_empty(device=device)
    for module in old.modules():  # parameters follow the model's dtype; buffers keep theirs (float32 inv_freq)
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_floating_point() and param.dtype != dtype:
                setattr(module, name, nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad))
    tensors = [*old.parameters(), *old.buffers()]
    with torch.no_grad():
        for tensor in tensors:
            _fill_sentinel(tensor)
        for module in old.modules():
            model._init_weights(module)
    _check_filled(tensors, attr)
    parameters = list(old.parameters())
    if parameters:
        setattr(old, FRESH_MARK, True)
        for param in parameters:  # LearnedConfig(keep_weights=True) copies from the tensor: it warns too
            setattr(param, FRESH_MARK, True)
    return old


def _rebuild_tensor(model: nn.Module, owner: Any, attr: str, old: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A buffer such as BERT's ``position_ids``: put an empty one in place and let ``_init_weights(owner)`` fill it,
    with the owner's other tensors flagged as initialised so they are left alone."""
    fresh = torch.empty(old.shape, dtype=old.dtype, device=device)
    current = getattr(owner, attr)
    others = [t for t in (*owner.parameters(recurse=False), *owner.buffers(recurse=False)) if t is not current]
    flagged = [t for t in others if not getattr(t, "_is_hf_initialized", False)]
    setattr(owner, attr, fresh)
    try:
        for tensor in flagged:
            tensor._is_hf_initialized = True
        with torch.no_grad():
            _fill_sentinel(fresh)
            model._init_weights(owner)
    finally:
        for tensor in flagged:
            del tensor._is_hf_initialized
        setattr(owner, attr, current)
    _check_filled([fresh], attr)
    return fresh


def _sentinel(tensor: torch.Tensor) -> float:
    return math.nan if tensor.is_floating_point() else torch.iinfo(tensor.dtype).min


def _fill_sentinel(tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or (not tensor.is_complex() and tensor.dtype != torch.bool):
        tensor.fill_(_sentinel(tensor))


def _check_filled(tensors: list[torch.Tensor], attr: str) -> None:
    for tensor in tensors:
        if tensor.is_complex() or tensor.dtype == torch.bool:
            continue
        untouched = tensor.isnan() if tensor.is_floating_point() else tensor == _sentinel(tensor)
        if bool(untouched.any()):
            raise PosSwapError(
                f"Cannot rebuild the native '{attr}' this model's swap replaced: transformers' _init_weights does "
                "not initialise it, and the swapped checkpoint does not hold it. Load the original checkpoint "
                "instead of unswapping the reloaded one."
            )


# --- checkpoints loaded as the wrong model ------------------------------------------------------------------


def record_is_native(record: Any, family: Any) -> bool:
    """Whether a ``config.posswap`` record describes a swap transformers loads natively (LLaMA-like RoPE)."""
    if not isinstance(record, dict) or record.get("scheme") != "rope":
        return False
    scaling = record.get("scaling") or {}
    return (
        getattr(family, "rotary_module_path", None) is not None
        and record.get("partial_rotary_factor", 1.0) == 1.0
        and not (isinstance(scaling, dict) and scaling.get("method") == "self_extend")
    )


def check_loaded(model: nn.Module) -> None:
    """Raise when ``model`` carries the ``config.posswap`` record of a swap that transformers cannot express but
    was loaded as the plain architecture (its model_type edited back to the family's): the swap's position
    weights were then dropped and its native ones freshly initialised."""
    from .families.base import FAMILY_REGISTRY

    config = getattr(model, "config", None)
    record = getattr(config, "posswap", None)
    if not record or _state(model) is not None:
        return
    model_type = getattr(config, "model_type", None)
    family = FAMILY_REGISTRY.get(model_type) if model_type in FAMILY_REGISTRY else None
    if record_is_native(record, family):
        return
    scheme = record.get("scheme") if isinstance(record, dict) else record
    raise InvalidConfigError(
        f"This {type(model).__name__} carries config.posswap (scheme {scheme!r}) but was loaded as plain "
        f"'{model_type}', not as the swapped model: the swap's position weights were dropped and its native "
        f"position weights are random. Set \"model_type\": \"{MODEL_TYPE_PREFIX}{model_type}\" in config.json "
        "(as hf_posswap saved it) and load again with hf_posswap imported."
    )


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
