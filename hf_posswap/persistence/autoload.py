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
from ..transformers_internals import (
    auto_model_class,
    config_class_name,
    config_mapping,
    model_class_name,
    register_config_lazily,
)

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
    """Make ``cls`` reachable as ``hf_posswap.persistence.autoload.<name>`` (what pickle looks up)."""
    globals().setdefault(cls.__name__, cls)  # a clash of names (never among the built-in families) stays unpicklable
    return cls


class LazyModelClass:
    """Stands in the Auto classes' registry for ``PosSwap<Base>`` until transformers first uses it: reading any
    attribute (``from_pretrained``, ``_from_config``, ``__name__``) imports the family's modeling file, builds the
    real class and reads it there. Registering the real classes at ``import hf_posswap`` would import the modeling
    files of every family (and transformers' model-loading machinery) into every process that imports hf_posswap.

    transformers keeps registered model classes as plain values of its mapping and only reads attributes of them;
    ``config_class`` is known without building anything (the registration checks it)."""

    def __init__(self, auto: Any, base_config: type, config_class: type, family: str) -> None:
        self.config_class = config_class
        self._auto, self._base_config, self._family = auto, base_config, family

    @functools.cached_property
    def real(self) -> type:
        from ..families.base import FAMILY_REGISTRY

        FAMILY_REGISTRY.get(self._family).prepare_checkpoints()
        return posswap_model_class(auto_model_class(self._auto, self._base_config))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name not in ("__name__", "__qualname__", "__module__", "__doc__"):
            raise AttributeError(name)  # copy, pickle and friends probe dunders: no import for them
        return getattr(self.real, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.real(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<hf_posswap model class for {self.config_class.__name__} in {self._auto.__name__} (not built yet)>"


#: lazily built model classes by the name their real class will have (what pickle looks up on this module)
_LAZY_BY_NAME: dict[str, LazyModelClass] = {}


def __getattr__(name: str) -> Any:
    """PEP 562: ``PosSwap<Base>`` classes that pickle asks for before anything built them."""
    lazy = _LAZY_BY_NAME.get(name)
    if lazy is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return lazy.real


def register_auto_classes(model_types: list[str]) -> None:
    """Register the hf_posswap config classes of each family with ``AutoConfig`` and stand-ins of its model classes
    (:class:`LazyModelClass`) with each Auto model class that knows the family; the modeling files load only when a
    swapped checkpoint of that family loads."""
    for model_type in model_types:
        base_config = config_mapping()[model_type]
        config_cls = posswap_config_class(base_config)
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        for auto in AUTO_CLASSES:
            base_name = model_class_name(auto, model_type)
            if base_name is None:
                continue
            lazy = LazyModelClass(auto, base_config, config_cls, model_type)
            _LAZY_BY_NAME.setdefault(f"PosSwap{base_name}", lazy)
            auto.register(config_cls, lazy, exist_ok=True)


@functools.cache
def register() -> None:
    """Make transformers know hf_posswap: the attention functions (``posswap_eager``, ``posswap_sdpa``) and the
    config and model classes of every registered family, so ``AutoModel*.from_pretrained`` loads swapped checkpoints.

    ``import hf_posswap`` registers the same lazily (:func:`register_config_classes`: nothing is imported until a
    family is used); the ``hf-posswap`` command and the training loop call this once a model is about to load.
    Idempotent."""
    from ..core.attention import register_attention_functions
    from ..core.swap import supported_families

    register_attention_functions()
    register_auto_classes(supported_families())


@functools.cache
def _register_family_once(model_type: str) -> None:
    """A model of ``model_type`` is being swapped: register its family's classes now (its modeling file is loaded
    anyway), so ``AutoModel*.from_config(model.config)`` knows the swapped config class."""
    if model_type in config_mapping():
        register_auto_classes([model_type])


class LazyConfigClass:
    """Stands in ``AutoConfig``'s mapping for ``PosSwap<Config>`` of one family until transformers first reads it
    (a swapped checkpoint's config.json names ``hf_posswap_<family>``): then the family's classes are built and
    registered (:func:`register_auto_classes`) and the attribute is read from the real class."""

    def __init__(self, family: str, name: str) -> None:
        self.__name__ = self.__qualname__ = name  # read by transformers without building anything
        self.model_type = MODEL_TYPE_PREFIX + family
        self._family = family

    @functools.cached_property
    def real(self) -> type:
        register_auto_classes([self._family])
        return posswap_config_class(config_mapping()[self._family])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name not in ("__module__", "__doc__"):
            raise AttributeError(name)
        return getattr(self.real, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.real(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<hf_posswap config class {self.__name__} (not built yet)>"


@functools.cache
def register_config_classes() -> None:
    """What ``import hf_posswap`` registers: stand-ins of every family's config class in ``AutoConfig``'s mapping
    (no configuration or modeling file is imported; each family's real classes are built when a swapped checkpoint
    of it first loads). The attention functions are registered on first use too (a swap, a swapped checkpoint
    loading); :func:`register` registers everything at once."""
    from ..core.state import FAMILY_USED_HOOKS, LAZY_CLASSES
    from ..core.swap import supported_families

    FAMILY_USED_HOOKS.append(_register_family_once)

    for family in supported_families():
        base_name = config_class_name(family)
        lazy = LazyConfigClass(family, f"PosSwap{base_name}")
        if base_name is None or not register_config_lazily(lazy.model_type, lazy):
            register_auto_classes([family])
            continue
        LAZY_CLASSES.setdefault(lazy.__name__, lambda lazy=lazy: lazy.real)
