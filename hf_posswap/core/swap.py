"""``swap`` and ``unswap``: install a position scheme into a model, or restore the original mechanism.

A swap is planned as a list of reversible edits (``hf_posswap.edits``) from two independent parts: the scheme's
config (what) and the family adapter (where). Everything that can fail is checked before the first edit, and
the edits apply as one transaction.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from torch import nn

from ..edits import (
    Edit,
    OwnConfig,
    SetAttentionImplementation,
    SetAttribute,
    SetConfigClass,
    WrapForward,
    apply_all,
    revert_all,
)
from ..errors import (
    AlreadySwappedError,
    IncompatibleAttentionError,
    InvalidConfigError,
    InvalidOptionError,
    NotSwappedError,
)
from ..families.base import FamilyAdapter, get_family
from ..schemes.base import SCHEME_REGISTRY, ModelSpec, NativeWeightsMissingWarning, SchemeConfig
from ..schemes.mix import LayerMix
from ..schemes.rope import RopeConfig
from ..schemes.two_pass import TwoPassScaling, TwoPassSettings
from ..transformers_internals import attention_implementation
from .attention import CARRIERS, register_attention_functions
from .context import POSITIONS_ATTR, PositionForward, PositionInputs
from .layer_plan import as_layer_mix, layer_plan, mix_on_layers, own_theta_per_layer_type, with_own_scaling
from .native import PEFT_SAVED_COPIES, check_loaded, install_native_restorers, unwrap_peft
from .state import (
    CONFIG_RECORD,
    RECORD_VERSION,
    STATE_ATTR,
    SwapState,
    base_model_type,
    family_used,
    posswap_config_class,
)


def available_schemes() -> list[str]:
    """Names of the registered position schemes, usable as ``swap(model, name)``."""
    return SCHEME_REGISTRY.names()


def supported_families() -> list[str]:
    """``config.model_type`` values that ``swap`` supports."""
    from ..families.base import FAMILY_REGISTRY

    return FAMILY_REGISTRY.names()


def resolve_scheme(scheme: str | SchemeConfig, options: dict[str, Any]) -> SchemeConfig:
    """A registered name plus options, or a config object (options then override its fields)."""
    if isinstance(scheme, SchemeConfig):
        if not options:
            return scheme
        return type(scheme).from_options(**{**dataclasses.asdict(scheme), **options})
    if isinstance(scheme, str):
        return SCHEME_REGISTRY.get(scheme).from_options(**options)
    raise InvalidOptionError(
        f"scheme must be a registered name ({', '.join(available_schemes())}) or a SchemeConfig such as "
        f"hf_posswap.AlibiConfig(), got {type(scheme).__name__}: {scheme!r}."
    )


def swap(
    model: nn.Module,
    scheme: str | SchemeConfig,
    *,
    replace: bool = False,
    layers: Sequence[int] | None = None,
    **options: Any,
) -> nn.Module:
    """Replace the position mechanism of ``model`` in place and return the same model object.

    Args:
        model: a transformers model of a supported family (``supported_families()``).
        scheme: a registered scheme name (``available_schemes()``) or a config such as ``RopeConfig(...)``; a
            ``LayerMix`` gives each layer its own scheme.
        replace: when the model is already swapped, undo that swap first instead of raising.
        layers: only these layers get ``scheme``; the others keep the model's own RoPE (LLaMA-like models). The
            same as ``LayerMix(default=<native RoPE>, overrides=[(scheme, layers)])``.
        **options: fields of the scheme's config (``swap(model, "t5", num_buckets=64)``).

    The model gets its own copy of its config (transformers lets several models share one config object, and the
    swap must change only this one): while it is swapped, change settings through ``model.config``. ``unswap`` puts
    the original object back, with those changes.

    Raises:
        UnknownSchemeError, InvalidOptionError, InvalidConfigError, UnsupportedFamilyError,
        IncompatibleAttentionError, AlreadySwappedError. On any error the model is left exactly as it was.
    """
    wrapper, model = model, unwrap_peft(model)  # a peft model: swap the transformers model inside
    adapter = get_family(model)
    check_loaded(model)
    register_attention_functions()  # registered on first use: it imports transformers' modeling utilities
    adapter.prepare_checkpoints()
    family_used(base_model_type(model.config))  # runs the callbacks persistence.autoload registered for families
    config = _requested_config(model, adapter, scheme, options, layers)
    previous: SwapState | None = getattr(model, STATE_ATTR, None)
    if previous is not None and not replace:
        raise AlreadySwappedError(
            f"This model already carries the '{previous.config.name}' scheme from hf_posswap. Call "
            "hf_posswap.unswap(model) first, or swap(model, ..., replace=True) to replace it cleanly."
        )
    under_peft = wrapper is not model
    if under_peft and previous is not None:
        refuse_dropping_adapter_copies(model, previous)
    setattr(model, STATE_ATTR, _install_in_place_of(model, adapter, config, previous, under_peft))
    install_native_restorers(model)  # native weights a reloaded checkpoint never held stay flagged for unswap
    return wrapper


def _requested_config(model: nn.Module, adapter: FamilyAdapter, scheme: str | SchemeConfig, options: dict[str, Any],
                      layers: Sequence[int] | None) -> SchemeConfig:
    """The scheme config ``swap`` was asked for, checked against the model; changes nothing."""
    config = resolve_scheme(scheme, options)
    if layers is not None:
        config = mix_on_layers(model, adapter, config, layers)
    config = as_layer_mix(config)  # a HeadMix alone: the same on every layer
    if isinstance(config, LayerMix):
        config.check_layers(adapter.spec(model).num_layers)  # before unswapping an earlier swap
        config = own_theta_per_layer_type(model, config)  # Gemma 3: "its own θ" differs by layer type
    return config


def _install_in_place_of(model: nn.Module, adapter: FamilyAdapter, config: SchemeConfig,
                         previous: SwapState | None, under_peft: bool) -> SwapState:
    """Undo ``previous`` (an earlier swap, or None), then install ``config``; if anything after the undo fails,
    the earlier swap is put back exactly as it was."""
    if previous is not None:
        with warnings.catch_warnings():  # a re-created native table is flagged again by the caller, when it matters
            warnings.simplefilter("ignore", NativeWeightsMissingWarning)
            unswap(model)
    state = None
    try:
        config = with_own_scaling(model, adapter, config)  # read after unswapping: the model's own rope_parameters
        state = _install(model, adapter, config)
        if under_peft:
            _refuse_parameters_no_adapter_saves(state)
        return state
    except BaseException:
        if state is not None:
            revert_all(state.edits)
        if previous is not None:
            apply_all(previous.edits)
            setattr(model, STATE_ATTR, previous)
        raise


def refuse_dropping_adapter_copies(model: nn.Module, previous: SwapState) -> None:
    """A peft adapter that trains the earlier swap's position module (``modules_to_save``) holds its copy in a
    wrapper that undoing the swap would throw away."""
    wrapped = [name for name, module in model.named_modules() if hasattr(module, PEFT_SAVED_COPIES)]
    held = sorted({path for path in wrapped for name, _, _ in previous.new_parameters
                   if name == path or name.startswith(path + ".")})
    if held:
        raise InvalidConfigError(
            f"The '{previous.config.name}' position module(s) {', '.join(held)} are trained by the peft adapter "
            "(modules_to_save); replacing the swap would drop the adapter's copy. Merge the adapter first "
            "(model = model.merge_and_unload()), or swap the base model before get_peft_model."
        )


def _refuse_parameters_no_adapter_saves(state: SwapState) -> None:
    """Position parameters added under a peft adapter would train but never be saved with it."""
    trainable = [name for name, _, requires_grad in state.new_parameters if requires_grad]
    if trainable:
        raise InvalidConfigError(
            f"Swapping a peft model to '{state.config.name}' adds trainable position parameters "
            f"({', '.join(trainable)}) that the adapter would neither hold nor save. Swap the base model before "
            "get_peft_model (hf_posswap.lora_config then puts them in modules_to_save), or merge the adapter first "
            "(model = model.merge_and_unload())."
        )


def unswap(model: nn.Module) -> nn.Module:
    """Restore the model's original position mechanism exactly (modules, config, attention implementation)."""
    wrapper, model = model, unwrap_peft(model)
    check_loaded(model)
    state: SwapState | None = getattr(model, STATE_ATTR, None)
    if state is None:
        raise NotSwappedError(_not_swapped_message(model))
    revert_all(state.edits)
    delattr(model, STATE_ATTR)
    return wrapper


def _not_swapped_message(model: nn.Module) -> str:
    """Why ``unswap`` has nothing to undo; a checkpoint saved after a native swap says what it carries."""
    record = getattr(model.config, CONFIG_RECORD, None)
    if isinstance(record, dict) and record.get("scheme"):
        return (
            f"{type(model).__name__} was loaded from a checkpoint that hf_posswap had swapped to '{record['scheme']}' "
            "in transformers' own format (config.rope_parameters), which does not keep the original position "
            "settings, so there is nothing to undo here. Load the original checkpoint for the native model, or "
            "hf_posswap.swap(model, ...) to install another scheme."
        )
    return (
        f"{type(model).__name__} was not swapped by hf_posswap, so there is nothing to undo. "
        "hf_posswap.describe(model) shows what a model carries."
    )


def _install(model: nn.Module, adapter: FamilyAdapter, config: SchemeConfig) -> SwapState:
    own_config = OwnConfig(model)  # first, and before planning: the edits planned next change the model's own copy
    own_config.apply()
    try:
        spec = adapter.spec(model)
        config = config.resolve(spec)
        edits, native = _plan(model, adapter, config, spec)
        before = {id(p) for p in model.parameters()}
        apply_all(edits)
    except BaseException:
        own_config.revert()
        raise
    edits.insert(0, own_config)
    new_parameters = [
        (name, tuple(param.shape), param.requires_grad)
        for name, param in model.named_parameters()
        if id(param) not in before
    ]
    return SwapState(config, adapter.name, native, edits, new_parameters)


def _plan(model: nn.Module, adapter: FamilyAdapter, config: SchemeConfig, spec: ModelSpec) -> tuple[list[Edit], bool]:
    """The edits that install ``config`` in ``model``, and whether the result is native transformers."""
    if isinstance(config, RopeConfig):
        native_edits = adapter.native_rope_edits(model, config)
        if native_edits is not None:  # the record says so: a plain reload then knows it lost nothing
            return [*native_edits, _record_edit(model, adapter, config, native=True)], True
    if isinstance(config, LayerMix):
        edits = _mix_edits(model, adapter, config, spec)
    else:
        edits = _scheme_edits(model, adapter, config, spec)
    return [*edits, _record_edit(model, adapter, config, native=False), _config_class_edit(model.config)], False


def _record_edit(model: nn.Module, adapter: FamilyAdapter, config: SchemeConfig, native: bool) -> Edit:
    """``config.posswap``: the swap as saved with the checkpoint. ``native`` tells a plain reload whether it lost
    anything (:func:`~hf_posswap.core.native.record_is_native`)."""
    record = {"version": RECORD_VERSION, "family": adapter.name, **config.to_dict(), "native": native}
    return SetAttribute(model.config, CONFIG_RECORD, lambda: dict(record), where=f"config.{CONFIG_RECORD} = {record}")


def _scheme_edits(model: nn.Module, adapter: FamilyAdapter, config: SchemeConfig, spec: ModelSpec) -> list[Edit]:
    """One scheme on every layer: its module in the family's table slot (absolute schemes) or on the base model,
    the family's own positions silenced, the carriers selected for in-attention schemes, the forward wrapped."""
    base = adapter.base_model(model)
    in_attention = config.kind in ("rotary", "bias")
    if in_attention:
        _check_attention(model, config)
    module = config.build(spec)
    if module is not None:
        module = module.to(device=spec.device)
    combine = getattr(config, "combine", "add")  # "concat" widens the embeddings: done by the wrapper, not the slot
    slot = adapter.absolute_slot(base) if combine == "add" else None
    edits: list[Edit] = []
    if config.kind == "absolute" and slot is not None:
        parent, attr = slot
        edits.append(SetAttribute(parent, attr, lambda: module, where=f"{attr} <- {_short(module)}"))
        edits += adapter.removal_edits(model, spec, keep_absolute_slot=True)
    else:
        edits += adapter.removal_edits(model, spec)
        if module is not None:
            where = f"{POSITIONS_ATTR} <- {_short(module)}"
            edits.append(SetAttribute(base, POSITIONS_ATTR, lambda: module, where=where))
    if in_attention:
        edits.append(SetAttentionImplementation(model, CARRIERS[attention_implementation(model.config)]))
    inputs = PositionInputs(
        adapter,
        config.kind,
        adds_absolute=config.kind == "absolute" and slot is None,
        combine=combine,
        feeds_attention=in_attention,
        layer_shared=config.layer_shared,
        two_pass=_two_pass_settings(config),
        carriers=CARRIERS,
    )
    return [*edits, _wrap_forward_edit(base, inputs)]


def _mix_edits(model: nn.Module, adapter: FamilyAdapter, config: LayerMix, spec: ModelSpec) -> list[Edit]:
    """A layer mix: the family's positions removed, the mix's modules installed, every layer through the carriers
    with a per-layer plan (see :mod:`hf_posswap.core.layer_plan`)."""
    _check_attention(model, config)
    plan = layer_plan(config, spec, _two_pass_settings)
    module = config.build(spec).to(device=spec.device)
    base = adapter.base_model(model)
    where = f"{POSITIONS_ATTR} <- {_short(module)} (layers per scheme: see 'layers' above)"
    inputs = PositionInputs(adapter, "mix", adds_absolute=False, feeds_attention=True, layer_shared=False,
                        carriers=CARRIERS, layers=plan)
    return [
        *adapter.removal_edits(model, spec),
        SetAttribute(base, POSITIONS_ATTR, lambda: module, where=where),
        SetAttentionImplementation(model, CARRIERS[attention_implementation(model.config)]),
        _wrap_forward_edit(base, inputs),
    ]


def _wrap_forward_edit(base: nn.Module, inputs: PositionInputs) -> Edit:
    """The base model's ``forward`` wrapped on the instance, so every call path builds the position context."""
    return WrapForward(
        base,
        lambda previous: PositionForward(base, inputs, previous),
        where=f"{type(base).__name__}.forward wrapped (position context for every call path)",
    )


def _config_class_edit(config: Any) -> Edit:
    """Non-native swaps save as model_type ``hf_posswap_<type>`` (see ``hf_posswap.persistence.autoload``)."""
    base_class = getattr(type(config), "posswap_base_config_class", type(config))
    return SetConfigClass(config, posswap_config_class(base_class), base_class)


def _two_pass_settings(config: SchemeConfig) -> TwoPassSettings | None:
    """Two-pass attention settings of Self-Extend and ReRoPE, or None for other schemes."""
    scaling = getattr(config, "scaling", None)
    return scaling.attention_settings() if isinstance(scaling, TwoPassScaling) else None


def _short(module: nn.Module) -> str:
    return f"{type(module).__name__}({module.extra_repr()})"


def _check_attention(model: nn.Module, config: SchemeConfig) -> None:
    current = attention_implementation(model.config)
    if current not in CARRIERS:
        raise IncompatibleAttentionError(
            f"The '{config.name}' scheme works inside attention, and attention implementation '{current}' cannot "
            f"carry it (supported: eager, sdpa). Call model.set_attn_implementation('sdpa') before swapping, "
            "or load the model with attn_implementation='sdpa'."
        )
