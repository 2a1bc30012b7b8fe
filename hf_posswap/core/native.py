"""The native position modules a swap replaced, when they hold no real data.

A checkpoint swapped by hf_posswap is rebuilt on the meta device and never holds the native modules the swap
replaced (GPT-2's ``wpe``, LLaMA's ``rotary_emb``, BERT's position buffers). :func:`install_native_restorers` wraps
those edits so that ``unswap`` / ``swap(replace=True)`` rebuild them the way transformers initialises them: a rotary
module or a position buffer is deterministic and comes back exactly; a learned table comes back freshly
initialised with a :class:`NativeWeightsMissingWarning` naming it. :func:`check_loaded` refuses a swapped
checkpoint that was loaded as the plain architecture.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from ..edits import Edit
from ..errors import InvalidConfigError, NotSwappedError, PosSwapError
from ..schemes.base import FRESH_MARK, NativeWeightsMissingWarning
from ..transformers_internals import INITIALISED_FLAG, init_weights
from .state import MODEL_TYPE_PREFIX, swap_state

#: the attribute of peft's ModulesToSaveWrapper: it stands for a module the adapter trains and saves a copy of
PEFT_SAVED_COPIES = "modules_to_save"


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def install_native_restorers(model: nn.Module) -> None:
    """Wrap every edit of the swap whose saved native value is a meta tensor/module (replayed on the meta device)
    or a freshly initialised stand-in, so reverting it rebuilds or flags the native value (see module doc)."""
    state = swap_state(model)
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
    """A real value for a meta module or tensor, initialised as transformers initialises new weights."""
    from ..families.base import parameter_dtype_device

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
            init_weights(model, module)
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
    flagged = [t for t in others if not getattr(t, INITIALISED_FLAG, False)]
    setattr(owner, attr, fresh)
    try:
        for tensor in flagged:
            setattr(tensor, INITIALISED_FLAG, True)
        with torch.no_grad():
            _fill_sentinel(fresh)
            init_weights(model, owner)
    finally:
        for tensor in flagged:
            delattr(tensor, INITIALISED_FLAG)
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


def record_is_native(record: Any, family: Any) -> bool:
    """Whether a ``config.posswap`` record describes a swap transformers loads natively (a RoPE the family's own
    rotary class expresses). Swaps record ``"native": true`` when they went native; records written before that
    key existed were native exactly for whole-head RoPE without Self-Extend on a rotary family."""
    if not isinstance(record, dict):
        return False
    if "native" in record:
        return record["native"] is True and getattr(family, "rotary_module_path", None) is not None
    if record.get("scheme") != "rope":
        return False
    scaling = record.get("scaling") or {}
    return (
        getattr(family, "rotary_module_path", None) is not None
        and record.get("partial_rotary_factor", 1.0) == 1.0
        and not (isinstance(scaling, dict) and scaling.get("method") in ("self_extend", "rerope"))
    )


def check_loaded(model: nn.Module) -> None:
    """Raise when ``model`` carries the ``config.posswap`` record of a swap that transformers cannot express but
    was loaded as the plain architecture (its model_type edited back to the family's): the swap's position
    weights were then dropped and its native ones freshly initialised."""
    from ..families.base import FAMILY_REGISTRY

    config = getattr(model, "config", None)
    record = getattr(config, "posswap", None)
    if not record or swap_state(model) is not None:
        return
    if getattr(type(config), "posswap_base_model_type", None):
        # the config is a swapped model's (PosSwap<Config>) but the swap belongs to the module that holds it: this is
        # a part of a swapped model, e.g. ``model.base_model``, shared config and all
        raise NotSwappedError(
            f"This {type(model).__name__} is a part of a model that hf_posswap swapped (it shares that model's "
            "config), and the swap belongs to the whole model: call hf_posswap's swap / unswap / extend_context / "
            "describe on the model you swapped or loaded (e.g. the *ForMaskedLM / *ForCausalLM), not on its "
            "base_model."
        )
    model_type = getattr(config, "model_type", None)
    family = FAMILY_REGISTRY.get(model_type) if model_type in FAMILY_REGISTRY else None
    if record_is_native(record, family):
        return
    scheme = record.get("scheme") if isinstance(record, dict) else record
    if isinstance(model_type, str) and model_type.startswith(MODEL_TYPE_PREFIX):  # config.json is as saved
        raise InvalidConfigError(
            f"This {type(model).__name__} was loaded from a checkpoint that hf_posswap swapped to {scheme!r} "
            f"(model_type '{model_type}') by the plain class's {type(model).__name__}.from_pretrained, which does not "
            "rebuild the swap (its position weights may have been dropped). Load it with an Auto class "
            "(AutoModelForCausalLM.from_pretrained, AutoModelForMaskedLM.from_pretrained) with hf_posswap imported."
        )
    raise InvalidConfigError(
        f"This {type(model).__name__} carries config.posswap (scheme {scheme!r}) but was loaded as plain "
        f"'{model_type}', not as the swapped model: the swap's position weights were dropped and its native "
        f"position weights are random. Set \"model_type\": \"{MODEL_TYPE_PREFIX}{model_type}\" in config.json "
        "(as hf_posswap saved it) and load again with hf_posswap imported."
    )
