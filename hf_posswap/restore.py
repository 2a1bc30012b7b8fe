"""Replay a swap (and context extension) recorded in ``config.posswap`` on a freshly built model."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from torch import nn

from .autoload import check_record
from .errors import InvalidConfigError, PosSwapError
from .schemes.base import SCHEME_REGISTRY, SchemeConfig
from .schemes.rope_scaling import SCALING_REGISTRY

BOOKKEEPING = ("version", "family", "scheme", "extension")


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
    from .swap import swap

    record = check_record(record)
    config = scheme_from_record(record)
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
