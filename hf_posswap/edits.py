"""Reversible edits to a model, applied as one transaction.

A swap is a list of edits (replace a module, set a config value, switch the attention implementation, wrap
the base model's forward). Either all of them apply or none does: on failure the applied ones are reverted in reverse
order, so a failed swap leaves the model as it was. ``unswap`` reverts them all.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .transformers_internals import attention_implementation, set_attention_implementation


class _Missing:
    """"No value was there": one instance that survives ``copy.deepcopy`` and pickling (a copied model's edits
    must still recognise it, or unswap of the copy would set a stray object)."""

    def __repr__(self) -> str:
        return "<missing>"

    def __deepcopy__(self, memo: dict) -> _Missing:
        return self

    def __copy__(self) -> _Missing:
        return self

    def __reduce__(self) -> str:
        return "_MISSING"


_MISSING = _Missing()


class Edit:
    """One reversible change. ``where`` says in words what it changes (shown by ``describe``)."""

    where: str = ""

    def apply(self) -> None:
        raise NotImplementedError

    def revert(self) -> None:
        raise NotImplementedError


class SetAttribute(Edit):
    """``setattr(owner, attr, value)``; the value may be built lazily by ``make`` at apply time (after earlier
    edits, e.g. a rotary module built from an edited config). The built value is kept, so re-applying after a
    revert installs the very same object."""

    def __init__(self, owner: Any, attr: str, make: Callable[[], Any], where: str) -> None:
        self.owner, self.attr, self._make, self.where = owner, attr, make, where
        self._value: Any = _MISSING
        self._old: Any = _MISSING

    def apply(self) -> None:
        self._old = getattr(self.owner, self.attr, _MISSING)
        if self._value is _MISSING:
            self._value = self._make()
            self._make = None  # built once; dropping the closure keeps the model picklable (torch.save(model))
        setattr(self.owner, self.attr, self._value)

    def revert(self) -> None:
        if self._old is _MISSING:
            delattr(self.owner, self.attr)
        else:
            setattr(self.owner, self.attr, _follow_owner(self._old, self.owner))


class OwnConfig(Edit):
    """Give ``model``, and each of its submodules that holds the same config object, a copy of that config, so
    the edits after it change this model's config and not an object shared with other models (transformers
    models built from one config object share it). Revert hands back to the original object what changed on the
    copy in between (the user's own settings such as ``use_cache``; the swap's edits are reverted by then) and puts
    the original back in place."""

    where = ""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.original = model.config
        self.own = copy.copy(self.original)  # the same class; apply gives it deep copies of the values
        self._applied_values: dict[str, Any] = {}

    def apply(self) -> None:
        self.own.__class__ = type(self.original)  # on a re-apply after a revert: the very same object, refreshed
        self.own.__dict__.clear()
        self.own.__dict__.update(copy.deepcopy(self.original.__dict__))
        self._applied_values = copy.deepcopy(self.original.__dict__)
        self._point(self.original, self.own)

    def revert(self) -> None:
        before, after = self._applied_values, self.own.__dict__
        for name in before.keys() - after.keys():
            self.original.__dict__.pop(name, None)
        for name, value in after.items():
            if name not in before or not _same(before[name], value):
                self.original.__dict__[name] = value
        if type(self.own) is not type(self.original):  # a reloaded model's PosSwap<Config>, reverted to the family's
            self.original.__class__ = type(self.own)
        self._point(self.own, self.original)

    def _point(self, old: Any, new: Any) -> None:
        for module in self.model.modules():
            if vars(module).get("config") is old:
                module.config = new


def _same(first: Any, second: Any) -> bool:
    try:
        return bool(first == second)
    except Exception:  # values whose == is not a truth value (arrays): treat as changed
        return False


class SetConfigClass(Edit):
    """Give ``config`` the hf_posswap subclass of its class (so it saves as ``hf_posswap_<type>``); revert to the
    family's own class (also for a config that was loaded as the hf_posswap subclass)."""

    def __init__(self, config: Any, new_class: type, base_class: type) -> None:
        self.config, self.new_class, self.base_class = config, new_class, base_class
        self.where = f"config class {base_class.__name__} -> {new_class.__name__} (model_type {new_class.model_type})"

    def apply(self) -> None:
        self.config.__class__ = self.new_class

    def revert(self) -> None:
        self.config.__class__ = self.base_class


class SetAttentionImplementation(Edit):
    """Switch ``model.set_attn_implementation`` to a registered implementation, and back."""

    def __init__(self, model: Any, name: str) -> None:
        self.model, self.name = model, name
        self._old: str | None = None
        self.where = ""

    def apply(self) -> None:
        self._old = attention_implementation(self.model.config)
        self.where = f"attention implementation: {self._old} -> {self.name}"
        set_attention_implementation(self.model, self.name)

    def revert(self) -> None:
        if self._old is not None:
            set_attention_implementation(self.model, self._old)


class WrapForward(Edit):
    """Replace ``module.forward`` on the instance by ``make(previous)``, where ``previous`` is the instance-level
    forward another library installed (or ``None``: the class's own). On revert, the previous forward comes back;
    if something wrapped ours in the meantime (accelerate's hooks), ours is switched to pass-through instead, so
    the outer wrapper keeps working. Under an accelerate hook the forward it wraps is replaced (see
    :func:`_forward_slot`)."""

    def __init__(self, module: nn.Module, make: Callable[[Callable[..., Any] | None], Any], where: str) -> None:
        self.module, self._make, self.where = module, make, where
        self._wrapper: Any = None  # the installed wrapper while applied
        self._built: Any = None  # the wrapper object, reused when re-applied after a revert
        self._previous: Any = _MISSING
        self._slot = "forward"  # the attribute apply replaced: forward, or accelerate's _old_forward

    def apply(self) -> None:
        self._slot = slot = _forward_slot(self.module)
        self._previous = self.module.__dict__.get(slot, _MISSING)
        previous = None if self._previous is _MISSING else self._previous
        if self._built is None:
            self._built = self._make(previous)
            self._make = None  # built once; dropping the closure keeps the model picklable (torch.save(model))
        self._built.previous, self._built.active = previous, True
        self._wrapper = self._built
        setattr(self.module, slot, self._wrapper)

    def revert(self) -> None:
        if self._wrapper is None:
            return
        # where apply put it, or `forward` once accelerate's hook was removed (it moved `_old_forward` there)
        slots = (getattr(self, "_slot", "forward"), "forward")  # getattr: models pickled before `_slot` existed
        slot = next((s for s in slots if self.module.__dict__.get(s) is self._wrapper), None)
        if slot is None:
            self._wrapper.active = False
        elif self._previous is _MISSING:
            delattr(self.module, slot)
        else:
            setattr(self.module, slot, self._previous)
        self._wrapper = None


def _forward_slot(module: nn.Module) -> str:
    """Where the instance's forward lives. Under an accelerate hook, ``module.forward`` is accelerate's wrapper and
    the real one is ``module._old_forward``, which ``remove_hook_from_module`` puts back as ``forward``: wrapping
    that one keeps the swap when the hook is removed (wrapping accelerate's would silently drop the positions)."""
    if "_old_forward" in module.__dict__ and getattr(module, "_hf_hook", None) is not None:
        return "_old_forward"
    return "forward"


def _follow_owner(old: Any, owner: Any) -> Any:
    """A module put back into ``owner`` moves to the device and floating dtype the owner has now: the model may
    have been moved or cast (``.to``, ``.half()``) while the swap was on."""
    if not isinstance(old, nn.Module) or not isinstance(owner, nn.Module):
        return old
    reference = next((t for t in (*owner.parameters(), *owner.buffers()) if t.is_floating_point()), None)
    if reference is None:
        return old
    return old.to(device=reference.device, dtype=reference.dtype)


def apply_all(edits: Sequence[Edit]) -> None:
    """Apply ``edits`` in order; if one fails, revert those already applied and re-raise."""
    applied: list[Edit] = []
    try:
        for edit in edits:
            edit.apply()
            applied.append(edit)
    except BaseException:
        revert_all(applied)
        raise


def revert_all(edits: Sequence[Edit]) -> None:
    """Revert ``edits`` in reverse order."""
    for edit in reversed(edits):
        edit.revert()
