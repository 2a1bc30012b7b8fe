"""Checkpoints of swapped models that reload right.

A swap that transformers cannot express natively changes the class of ``model.config`` to a registered subclass
whose ``model_type`` is ``hf_posswap_<family>`` (e.g. ``hf_posswap_gpt2``), so ``save_pretrained`` writes that
model type plus the ``posswap`` record. Then:

- with hf_posswap imported, ``AutoModelFor*.from_pretrained(dir)`` finds the registered subclasses, whose
  ``__init__`` builds the base architecture and replays the swap before the weights load;
- without hf_posswap, transformers refuses the unknown model type ``hf_posswap_<family>``, an error that names
  hf_posswap, instead of loading the weights silently into the original architecture.

Registration goes through transformers' own ``AutoConfig.register`` / ``AutoModel*.register``.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from ..core.state import MODEL_TYPE_PREFIX, base_model_type, check_record, posswap_config_class  # noqa: F401
from ..errors import InvalidConfigError
from ..transformers_internals import config_mapping

AUTO_CLASSES = (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoModelForQuestionAnswering,
)


@functools.cache
def posswap_model_class(base: type) -> type:
    """``PosSwap<Base>``: builds the base architecture, then replays the swap recorded in ``config.posswap``."""

    def __init__(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
        record = getattr(config, "posswap", None)
        if getattr(type(config), "posswap_base_model_type", None) and not record:
            raise InvalidConfigError(
                f"This config has model_type '{config.model_type}' (a model swapped by hf_posswap) but no "
                f"'posswap' record (got {record!r}), so the swap cannot be rebuilt and the saved position weights "
                "would be dropped. Restore the 'posswap' entry of config.json from the original save, or re-save "
                "the swapped model with save_pretrained."
            )
        _build_at_original_length(config, record)
        base.__init__(self, config, *args, **kwargs)
        if record:
            from .restore import restore_swap

            restore_swap(self, record)

    @classmethod  # type: ignore[misc]
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        """``from_pretrained`` that refuses position weights that are missing or left over, and makes the native
        modules the swap replaced real again (so ``unswap`` and ``swap(replace=True)`` work on the loaded model)."""
        from .restore import after_load

        wants_info = bool(kwargs.pop("output_loading_info", False))
        try:
            model, info = super(new_class, cls).from_pretrained(*args, output_loading_info=True, **kwargs)
        except RuntimeError as error:
            if "mismatched_sizes" not in str(error):
                raise
            raise InvalidConfigError(
                "The checkpoint's weights do not match the swap recorded in its config.posswap (see the loading "
                "report above for the keys): the config or the weight files were changed after saving. Re-save "
                "the model, or pass ignore_mismatched_sizes=True to re-initialise those weights."
            ) from error
        after_load(model, info, args[0] if args else kwargs.get("pretrained_model_name_or_path"))
        return (model, info) if wants_info else model

    new_class = type(
        f"PosSwap{base.__name__}",
        (base,),
        {
            "__init__": __init__,
            "from_pretrained": from_pretrained,
            "config_class": posswap_config_class(base.config_class),
            "__module__": __name__,
        },
    )
    return _publish_model_class(new_class)


def _build_at_original_length(config: Any, record: Any) -> None:
    """An extended model saves its longer ``max_position_embeddings``; the native modules the swap replaces must be
    built at the trained length (as the model was before extending), so ``unswap`` returns that model. The
    replayed extension then sets the longer length again."""
    extension = record.get("extension") if isinstance(record, dict) else None
    original = extension.get("original_max_position_embeddings") if isinstance(extension, dict) else None
    if isinstance(original, int) and not isinstance(original, bool) and original >= 1:
        config.max_position_embeddings = original


def _publish_model_class(cls: type) -> type:
    """Make ``cls`` reachable as ``hf_posswap.autoload.<name>`` (what pickle looks up)."""
    globals().setdefault(cls.__name__, cls)  # a clash of names (never among the built-in families) stays unpicklable
    return cls


def register_auto_classes(model_types: list[str]) -> None:
    """Register the hf_posswap config and model subclasses of each family with transformers' Auto classes."""
    for model_type in model_types:
        base_config = config_mapping()[model_type]
        config_cls = posswap_config_class(base_config)
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        for auto in AUTO_CLASSES:
            try:
                base_model = auto._model_mapping[base_config]
            except KeyError:
                continue
            auto.register(config_cls, posswap_model_class(base_model), exist_ok=True)




@functools.cache
def register() -> None:
    """Make transformers know hf_posswap: the attention functions (``posswap_eager``, ``posswap_sdpa``) and the
    config and model classes of every registered family, so ``AutoModel*.from_pretrained`` loads swapped checkpoints.

    ``import hf_posswap`` calls it, except in the ``hf-posswap`` command's own process, which calls it (through
    :func:`hf_posswap.persistence.loading.load_model` and the training loop) only once a model is about to load, so
    that ``--help`` needs no torch. Idempotent."""
    from ..core.attention import register_attention_functions
    from ..core.swap import supported_families

    register_attention_functions()
    register_auto_classes(supported_families())
