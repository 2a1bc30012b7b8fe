"""``extend_context``: run a checkpoint at a longer context than it was trained for.

- RoPE models (LLaMA-like natively, or any model swapped to ``rope``): a RoPE scaling (``linear``, ``ntk``,
  ``dynamic``, ``yarn``, ``longrope``, ``llama3``) written as a ``rope`` swap, so LLaMA-like checkpoints stay plain
  transformers; or two-pass attention with RoPE inside attention (``self_extend``, ``rerope``: exact distances
  within a window, grouped or clamped beyond it, see :mod:`hf_posswap.core.self_extend`).
- Learned absolute tables (GPT-2, BERT, or a ``learned`` swap): the table grows by ``interpolate`` (linear
  interpolation of the trained vectors) or ``copy`` (the trained table repeated, as Longformer did).
- ALiBi, T5, NoPE and sinusoidal have no length limit: ``lift`` only records the new length.

Extending twice composes from the *original* length: the factor is always new length / original length.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ..edits import Edit, SetAttribute, apply_all
from ..errors import InvalidConfigError, InvalidOptionError, PosSwapError
from ..families.base import FamilyAdapter, get_family
from ..schemes.base import NativeWeightsMissingWarning, SchemeConfig
from ..schemes.learned import LearnedConfig
from ..schemes.mix import LayerMix
from ..schemes.proportional import ProportionalRopeConfig
from ..schemes.rope import RopeConfig
from ..schemes.rope_scaling import SCALING_REGISTRY
from ..transformers_internals import config_rope_parameters
from .context import POSITIONS_ATTR
from .layer_plan import scale_rope_parts
from .learned_tables import grow_table, trained_rows
from .native import PEFT_SAVED_COPIES, check_loaded, install_native_restorers, record_is_native, unwrap_peft
from .state import CONFIG_RECORD, SwapState, swap_state
from .swap import refuse_dropping_adapter_copies, swap

TABLE_METHODS = ("interpolate", "copy")
#: 2^24: float32 represents every integer position up to here, and no further
MAX_POSITIONS_LIMIT = 2**24
LIFT = "lift"


def available_extension_methods() -> list[str]:
    """Every ``method`` name ``extend_context`` accepts (which one a model takes depends on its scheme)."""
    return [*SCALING_REGISTRY.names(), *TABLE_METHODS, LIFT]


def extend_context(model: nn.Module, max_positions: int, method: str | None = None, **options: Any) -> nn.Module:
    """Let ``model`` run at ``max_positions`` tokens; returns the same model object, changed in place.

    Args:
        model: a model of a supported family, swapped or not.
        max_positions: the new context length; must not be shorter than the current one.
        method: a RoPE scaling for RoPE models (default ``yarn``), ``interpolate`` / ``copy`` for learned tables
            (default ``interpolate``), ``lift`` for schemes without a length limit (their default).
        **options: the scaling's options (``factor`` defaults to max_positions / original length; ``beta_fast``,
            ``short_factor``, ...).
    """
    wrapper, model = model, unwrap_peft(model)
    plan = _extension_plan(model, max_positions, method, options)
    adapter, state, method, original = plan.adapter, plan.state, plan.method, plan.original
    new_config, fill_table = plan.scheme, plan.fill_table
    record = {"method": method, "original_max_position_embeddings": original, "max_position_embeddings": max_positions}
    rope = new_config.rope_parts()[0] if isinstance(new_config, LayerMix) and new_config.rope_parts() else new_config
    if isinstance(rope, RopeConfig) and rope.scaling is not None:
        record["scaling"] = rope.scaling.to_dict()
    if new_config is not None:  # lift keeps the installed modules (and their trained weights) as they are
        if state is not None and wrapper is not model:
            refuse_dropping_adapter_copies(model, state)  # re-installing would throw the adapter's copies away
        kept = _position_parameters(model, state)
        _reswap(model, new_config, replace=state is not None)
        _restore_position_parameters(model, kept, freeze_new=wrapper is not model)
    if fill_table is not None:
        fill_table()
    _apply_length_edits(model, adapter, method, original, max_positions, record)
    return wrapper


def check_extension(model: nn.Module, max_positions: int, method: str | None = None, **options: Any) -> None:
    """Raise what ``extend_context(model, max_positions, method, **options)`` would raise, changing nothing: a
    command checks its extension before hours of other work."""
    _extension_plan(unwrap_peft(model), max_positions, method, options)


class _ExtensionPlan(NamedTuple):
    adapter: FamilyAdapter
    state: SwapState | None
    method: str
    original: int
    scheme: SchemeConfig | None  # the scheme to swap in (None: ``lift`` keeps the installed modules)
    fill_table: Callable[[], None] | None  # fills a grown learned table once it is swapped in


def _extension_plan(model: nn.Module, max_positions: int, method: str | None, options: dict) -> _ExtensionPlan:
    """Every check of ``extend_context`` and what it will change; nothing is changed yet."""
    check_loaded(model)
    adapter = get_family(model)
    state = swap_state(model)
    reloaded = _reloaded_native_rope(model, adapter) if state is None else None
    scheme = reloaded.rope if reloaded else _current_scheme(model, adapter, state)
    original, current = (reloaded.original, reloaded.current) if reloaded else _lengths(model, state)
    if not _positive_lengths(original, current):
        raise InvalidConfigError(
            f"This model's trained length is {original!r} (current {current!r}); extending needs positive integers. "
            "Restore max_position_embeddings in its config (config.json) to the length it was trained at."
        )
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise InvalidConfigError(f"max_positions must be a positive integer, got {max_positions!r}.")
    _check_length_limit(max_positions)
    if max_positions < current:
        raise InvalidConfigError(
            f"max_positions={max_positions} is shorter than the model's current length {current}; extend_context "
            "only lengthens. Pass a value >= the current length."
        )
    method = method or default_method(scheme)
    if method in SCALING_REGISTRY:
        new_config, fill_table = _rope_plan(model, scheme, method, original, max_positions, options)
    elif method in TABLE_METHODS:
        new_config, fill_table = _table_plan(model, adapter, scheme, method, original, max_positions, options)
    elif method == LIFT:
        new_config, fill_table = _lift_plan(scheme, options)
    else:
        raise InvalidOptionError(
            f"Unknown extension method '{method}'. Methods: {', '.join(available_extension_methods())}."
        )
    return _ExtensionPlan(adapter, state, method, original, new_config, fill_table)


def _position_parameters(model: nn.Module, state: SwapState | None) -> dict[str, nn.Parameter]:
    """The swap's own parameters by name (a mix's T5 tables, ALiBi slopes, FIRE's MLP): a RoPE scaling re-installs
    the whole scheme, and only its RoPE parts may change."""
    names = {name for name, _, _ in state.new_parameters} if state is not None else set()
    return {name: param for name, param in model.named_parameters() if name in names}


def _restore_position_parameters(model: nn.Module, kept: dict[str, nn.Parameter], freeze_new: bool) -> None:
    """Give the re-installed modules the trained values (and trainability) of ``kept``, matched by name and shape;
    under a peft adapter (``freeze_new``) a parameter with no counterpart (a grown learned table, rebuilt from the
    base's own) is frozen like every base weight, as the adapter neither trains nor saves it."""
    installed = {name for name, _, _ in swap_state(model).new_parameters}  # type: ignore[union-attr]
    with torch.no_grad():
        for name, param in model.named_parameters():
            old = kept.get(name)
            if name not in installed or old is param:  # not the swap's, or the very parameter kept in place
                continue
            if old is not None and old.shape == param.shape:
                param.copy_(old)
                param.requires_grad_(old.requires_grad)
            elif freeze_new:
                param.requires_grad_(False)


def _reswap(model: nn.Module, config: SchemeConfig, replace: bool) -> None:
    """``swap(model, config, replace=...)`` for a new length. A reloaded model's native modules come back freshly
    initialised on the way (``hf_posswap.persistence.restore``); they are not used here, so their warning waits for the
    user's own ``unswap``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NativeWeightsMissingWarning)
        swap(model, config, replace=replace)
    install_native_restorers(model)


# --- what the model carries ---------------------------------------------------------------------------------


def _current_scheme(model: nn.Module, adapter: FamilyAdapter, state: SwapState | None) -> SchemeConfig | None:
    """The scheme config the model carries; for an unswapped model, its native one (RoPE or learned)."""
    if state is not None:
        return state.config
    if adapter.rotary_module_path is not None:
        rope = config_rope_parameters(model.config)
        fraction = rope.get("partial_rotary_factor", 1.0)  # Phi-3 and GPT-NeoX rotate part of each head
        if rope.get("rope_type") == "proportional":  # p-RoPE keeps whole heads with its lowest frequencies at 0
            return ProportionalRopeConfig(rope_theta=rope.get("rope_theta"), partial_rotary_factor=fraction)
        return RopeConfig(rope_theta=rope.get("rope_theta"), partial_rotary_factor=fraction)
    if adapter.absolute_table_path is not None:
        return LearnedConfig()
    return None


class _ReloadedRope(NamedTuple):
    rope: RopeConfig
    original: int  # the trained length
    current: int  # the length it was extended to


def _reloaded_native_rope(model: nn.Module, adapter: FamilyAdapter) -> _ReloadedRope | None:
    """(the RoPE, the original trained length, the current length) of a native RoPE checkpoint that was extended,
    saved and loaded back by plain transformers (it has no swap state). Its ``rope_parameters`` do not always say
    where it came from: ``linear`` keeps no original length and static NTK only a raised base, so a second
    extension would start from the extended length and raise the base again. The ``config.posswap`` record holds
    both; it is read only while it still describes the config (its RoPE gives the config's ``rope_parameters`` and
    its extension the config's length), so a config edited after saving is taken as it stands."""
    record = getattr(model.config, CONFIG_RECORD, None)
    if not record_is_native(record, adapter) or record.get("scheme") != "rope":
        return None
    extension = record.get("extension") if isinstance(record.get("extension"), dict) else {}
    method = extension.get("method")
    original, current = extension.get("original_max_position_embeddings"), extension.get("max_position_embeddings")
    if not _positive_lengths(original, current):
        return None
    if _config_length(method, original, current) != model.config.max_position_embeddings:
        return None
    try:
        rope = RopeConfig.from_options(rope_theta=record.get("rope_theta"), scaling=record.get("scaling"),
                                       partial_rotary_factor=record.get("partial_rotary_factor", 1.0))
        written = rope.rope_parameters(adapter.spec(model).head_dim)
    except (PosSwapError, TypeError, ValueError):
        return None
    return _ReloadedRope(rope, original, current) if written == config_rope_parameters(model.config) else None


def _positive_lengths(*lengths: Any) -> bool:
    """Whether every length is a positive int (a bool is not one)."""
    return all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)


def _lengths(model: nn.Module, state: SwapState | None) -> tuple[int, int]:
    """(original trained length, current length)."""
    extension = getattr(state, "extension", None)
    if extension:
        return extension["original_max_position_embeddings"], extension["max_position_embeddings"]
    rope = config_rope_parameters(model.config)
    length = model.config.max_position_embeddings
    return rope.get("original_max_position_embeddings", length), length


def has_rope(scheme: SchemeConfig | None) -> bool:
    """RoPE, or a layer mix with RoPE layers: what a RoPE scaling applies to."""
    return isinstance(scheme, RopeConfig) or (isinstance(scheme, LayerMix) and bool(scheme.rope_parts()))


def default_method(scheme: SchemeConfig | None) -> str:
    """The extension method for ``scheme`` when none is named: YaRN for RoPE, interpolation for a learned table,
    ``lift`` for schemes without a length limit."""
    if has_rope(scheme):
        return "yarn"
    if isinstance(scheme, LearnedConfig):
        return "interpolate"
    return LIFT


# --- plans: (the scheme config to swap in, an optional step after the swap) ------------------------------------


def _rope_plan(
    model: nn.Module, scheme: SchemeConfig | None, method: str, original: int, max_positions: int, options: dict
) -> tuple[SchemeConfig, None]:
    if isinstance(scheme, LayerMix) and scheme.rope_parts():  # a layer mix: only its RoPE layers are scaled
        scaled, _ = _rope_plan(model, scheme.rope_parts()[0], method, original, max_positions, options)
        scaling = scaled.scaling  # type: ignore[attr-defined]
        return scale_rope_parts(scheme, lambda part: dataclasses.replace(part, scaling=scaling)), None
    if not isinstance(scheme, RopeConfig):
        carried = scheme.name if scheme is not None else "no position scheme"
        raise InvalidConfigError(
            f"RoPE scaling '{method}' needs a model with RoPE, and this {type(model).__name__} carries "
            f"{carried}. Swap to RoPE first: hf_posswap.swap(model, 'rope', replace=True), then extend."
        )
    given = dict(options)
    options = {"factor": max_positions / original, "original_max_position_embeddings": original, **options}
    scaling = SCALING_REGISTRY.get(method).from_options(**options)  # validates the values first
    _check_consistent(method, original, max_positions, given)
    return dataclasses.replace(scheme, scaling=scaling), None


def _check_consistent(method: str, original: int, max_positions: int, options: dict) -> None:
    """``factor`` and ``original_max_position_embeddings`` are derived from the lengths; given ones must agree,
    or the saved record would claim a length the scaling was not set up for."""
    given = options.get("original_max_position_embeddings")
    if given is not None and given != original:
        raise InvalidConfigError(
            f"original_max_position_embeddings={given!r} differs from this model's trained length {original}; "
            f"'{method}' always scales from the trained length. Leave the option out."
        )
    factor = options.get("factor")
    if isinstance(factor, (int, float)) and not isinstance(factor, bool):
        expected = max_positions / original
        if not math.isclose(factor, expected, rel_tol=1e-9):
            raise InvalidConfigError(
                f"factor={factor!r} does not match max_positions={max_positions} over the trained length "
                f"{original} (= {expected:g}). Leave factor out (it is max_positions / {original}), or pass "
                f"max_positions={round(factor * original)} for factor {factor!r}."
            )


def _table_plan(
    model: nn.Module,
    adapter: FamilyAdapter,
    scheme: SchemeConfig | None,
    method: str,
    original: int,
    max_positions: int,
    options: dict,
) -> tuple[SchemeConfig, Any]:
    if not isinstance(scheme, LearnedConfig):
        carried = scheme.name if scheme is not None else "no position scheme"
        raise InvalidConfigError(
            f"'{method}' grows a learned position table, and this {type(model).__name__} carries {carried}. "
            f"Use a RoPE scaling ({', '.join(SCALING_REGISTRY.names())}) for RoPE models, or 'lift' for schemes "
            "without a length limit."
        )
    if options:
        raise InvalidOptionError(f"Method '{method}' takes no options, got {sorted(options)}.")
    if scheme.combine != "add":
        raise InvalidConfigError(
            f"'{method}' grows a learned table joined by combine={scheme.combine!r}, which extend_context does not "
            "support yet (the trained projection would be lost). Extend before swapping: hf_posswap.extend_context "
            "on the model with its own table (or swap with combine='add'), then swap to combine='concat'."
        )
    table = _learned_table(model, adapter)
    if hasattr(table, PEFT_SAVED_COPIES):
        raise InvalidConfigError(
            f"The learned position table ({type(table).__name__}) is trained by a peft adapter "
            "(modules_to_save); growing it would replace the module peft saves and lose the adapter's copy. "
            "Extend the model before get_peft_model, or merge first: model = model.merge_and_unload()."
        )
    state = swap_state(model)
    trained = getattr(state, "original_table", None)  # kept in memory; a reloaded model has only the grown table
    if trained is None:
        grown_by = (getattr(state, "extension", None) or {}).get("method")
        trained = trained_rows(table.weight.detach(), original, grown_by)  # [original, hidden]

    def fill_table() -> None:
        with torch.no_grad():
            table = _learned_table(model, adapter).weight
            table.copy_(grow_table(trained, max_positions, method).to(table.dtype))
        swap_state(model).original_table = trained  # type: ignore[union-attr]

    return LearnedConfig(max_positions=max_positions, keep_weights=True), fill_table


def _learned_table(model: nn.Module, adapter: FamilyAdapter) -> nn.Module:
    """The module holding the learned table: the family's slot, or the swapped-in module for slot-less families."""
    base = adapter.base_model(model)
    slot = adapter.absolute_slot(base)
    return getattr(slot[0], slot[1]) if slot is not None else getattr(base, POSITIONS_ATTR)


def _lift_plan(scheme: SchemeConfig | None, options: dict) -> tuple[None, None]:
    """Nothing to rebuild: the scheme's modules (and trained T5 tables or ALiBi slopes) stay; only lengths change."""
    if has_rope(scheme) or isinstance(scheme, LearnedConfig) or scheme is None:
        kind = "RoPE" if has_rope(scheme) else "a learned table"
        raise InvalidConfigError(
            f"'lift' only records a longer length for schemes without a limit (alibi, t5, none, sinusoidal); this "
            f"model has {kind}. Use {'a RoPE scaling such as yarn' if kind == 'RoPE' else 'interpolate or copy'}."
        )
    if options:
        raise InvalidOptionError(f"Method 'lift' takes no options, got {sorted(options)}.")
    return None, None


def _apply_length_edits(
    model: nn.Module, adapter: FamilyAdapter, method: str, original: int, max_positions: int, record: dict
) -> None:
    state = swap_state(model)
    edits: list[Edit] = adapter.length_edits(model, _config_length(method, original, max_positions))
    posswap_record = {**getattr(model.config, CONFIG_RECORD, {}), "extension": record}
    shown = {key: value for key, value in record.items() if key != "scaling"}  # the scaling is in the record above
    edits.append(SetAttribute(model.config, CONFIG_RECORD, lambda: posswap_record,
                              where=f"config.{CONFIG_RECORD}.extension = {shown}"))
    apply_all(edits)
    state.edits.extend(edits)  # type: ignore[union-attr]
    state.extension = record  # type: ignore[union-attr]


def _config_length(method: str, original: int, max_positions: int) -> int:
    """The ``max_position_embeddings`` an extension writes: transformers' dynamic NTK measures lengths against it, so
    ``dynamic`` keeps the original there; every other method the new length."""
    return original if method == "dynamic" else max_positions


def replay_extension(model: nn.Module, record: dict[str, Any]) -> None:
    """Re-apply a recorded extension's lengths on a model whose scheme was just restored (scaling and table sizes
    are in the scheme record itself)."""
    method = record.get("method") if isinstance(record, dict) else None
    original = record.get("original_max_position_embeddings") if isinstance(record, dict) else None
    max_positions = record.get("max_position_embeddings") if isinstance(record, dict) else None
    lengths_ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (original, max_positions))
    if method not in available_extension_methods() or not lengths_ok or not 1 <= original <= max_positions:
        raise InvalidConfigError(
            f"The checkpoint's config.posswap.extension record is malformed: {record!r}. It needs 'method' (one of "
            f"{', '.join(available_extension_methods())}) and integer lengths with 1 <= "
            "original_max_position_embeddings <= max_position_embeddings. Restore config.json as it was saved."
        )
    _check_length_limit(max_positions)
    _apply_length_edits(model, get_family(model), method, original, max_positions, dict(record))


def _check_length_limit(max_positions: int) -> None:
    if max_positions > MAX_POSITIONS_LIMIT:
        raise InvalidConfigError(
            f"max_positions={max_positions} is past {MAX_POSITIONS_LIMIT} (2^24), the last position float32 holds "
            "exactly (positions and angles are computed in float32, and position-sized tables and buffers would "
            "need that much memory). Pass a smaller length."
        )
