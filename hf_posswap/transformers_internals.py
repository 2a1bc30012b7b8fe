"""Every assumption hf_posswap makes about transformers' internals, and the releases it was checked against.

hf_posswap is a plugin: it reaches into transformers through its extension points (the attention and mask
interfaces), its KV-cache objects and a few helpers. Those are internals, and releases rename them (5.24 renamed
the cache argument of every model and attention layer from ``past_key_values`` to ``cache``; a plugin that read the
old name saw no cache and computed wrong logits without a word). So:

- every name, signature and behaviour hf_posswap relies on is looked up here, with the differences between
  releases handled here and nowhere else: the next rename is a change to this file;
- :func:`check_interfaces` verifies, once per process, that the functions hf_posswap calls still exist with the
  parameters it passes; a release that changed one gets a :class:`TransformersDriftError` naming the release, what
  changed and the newest tested release, never a silent fallback;
- a release newer than :data:`NEWEST_TESTED` gets one warning naming the tested window (:func:`warn_if_untested`);
- the position wrapper checks at run time that it saw the KV cache the model used and that the position context
  reached attention (:mod:`hf_posswap.core.context`), so drift this file cannot foresee raises too.

``hf-posswap doctor`` (:func:`hf_posswap.self_check`) runs the guarantees end to end in the user's environment.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import transformers
from packaging.version import Version

from .errors import PosSwapError

#: the oldest and newest transformers releases the test suite passed on (docs/compatibility.md has the table);
#: pyproject.toml declares the same floor
OLDEST_TESTED = "5.5.0"
NEWEST_TESTED = "5.25.0"

RUNNING = Version(Version(transformers.__version__).base_version)  # "5.25.0.dev0" counts as 5.25.0

#: the keyword under which models and attention layers take the KV cache: ``cache`` from 5.24 on (5.24-5.39 still
#: accept ``past_key_values`` through a deprecation shim), ``past_key_values`` before
CACHE_KWARG = "cache" if RUNNING >= Version("5.24.0") else "past_key_values"
#: every name a tested release used for it; a cache passed under any other keyword means the API moved again
KNOWN_CACHE_KWARGS: tuple[str, ...] = ("cache", "past_key_values")


class TransformersDriftError(PosSwapError, RuntimeError):
    """The installed transformers changed an internal hf_posswap relies on; continuing could compute wrong numbers."""


def drift_error(what_changed: str, fix: str = "") -> TransformersDriftError:
    """An error that names the running release, what changed, the tested window and what to do."""
    advice = fix or (
        f"Install a tested release (pip install 'transformers>={OLDEST_TESTED},<={NEWEST_TESTED}'), or report it "
        "with the output of `hf-posswap doctor`."
    )
    return TransformersDriftError(
        f"transformers {transformers.__version__}: {what_changed} hf_posswap was tested with transformers "
        f"{OLDEST_TESTED} to {NEWEST_TESTED}. {advice}"
    )


def is_untested_release() -> bool:
    """Whether the running transformers is outside the tested window."""
    return not Version(OLDEST_TESTED) <= RUNNING <= Version(NEWEST_TESTED)


@functools.cache
def warn_if_untested() -> None:
    """Warn once per process when the running transformers is outside the tested window."""
    if is_untested_release():
        warnings.warn(
            f"hf_posswap was tested with transformers {OLDEST_TESTED} to {NEWEST_TESTED}; {transformers.__version__} "
            "is installed. It checks the internals it uses and raises if one changed, but run `hf-posswap doctor` "
            "once to check this environment end to end.",
            UntestedTransformersWarning,
            stacklevel=3,
        )


class UntestedTransformersWarning(UserWarning):
    """The installed transformers is outside the window hf_posswap was tested with."""


#: the first release whose ``from_pretrained`` kernelizes by default (``use_kernels=None`` means on)
KERNELS_BY_DEFAULT = Version("5.25.0")


def hub_kernels_state() -> str:
    """What ``from_pretrained`` does with hub kernels in this environment, in words (for the doctor's report).

    From transformers 5.25 ``from_pretrained`` kernelizes by default where the ``kernels`` package is installed
    (hub kernels then replace layers such as LLaMA's rotary application on CUDA), and without a release of it that
    transformers accepts it raises unless the ``USE_HUB_KERNELS`` switch turns them off."""
    if RUNNING < KERNELS_BY_DEFAULT:
        return "off unless asked for (use_kernels=True)"
    switch = os.environ.get("USE_HUB_KERNELS", "YES")
    if switch.lower() not in ("true", "1", "y", "yes", "on"):  # transformers' own reading of the switch
        return f"off (USE_HUB_KERNELS={switch})"
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return "kernels is not installed: from_pretrained raises unless USE_HUB_KERNELS=NO"
    from transformers.utils.import_utils import is_kernels_available

    if not is_kernels_available():
        return (f"kernels {version} is not a release transformers accepts: from_pretrained raises unless "
                "USE_HUB_KERNELS=NO")
    return f"on by default (kernels {version})"


# --- the KV cache -----------------------------------------------------------------------------------------------


def cache_class() -> type:
    """transformers' ``Cache`` base class (every cache a model takes derives from it)."""
    from transformers.cache_utils import Cache

    return Cache


def find_cache(kwargs: dict[str, Any], where: str = "the model's forward") -> Any | None:
    """The KV cache in a forward's keyword arguments (None when there is none).

    Raises :class:`TransformersDriftError` when a cache arrives under a keyword no tested release used: the cache
    API moved, and a scheme that cannot see the cache would place every new token at position 0.
    """
    for name in KNOWN_CACHE_KWARGS:
        value = kwargs.get(name)
        if value is not None:
            return value
    cache_type = cache_class()
    for name, value in kwargs.items():
        if isinstance(value, cache_type):
            raise drift_error(
                f"{where} received its KV cache as '{name}', a keyword hf_posswap does not know (known: "
                f"{', '.join(KNOWN_CACHE_KWARGS)}), so it cannot tell where new tokens are placed."
            )
    return None


def find_cache_in_output(outputs: Any) -> Any | None:
    """The KV cache a model returned (a ``ModelOutput`` field under whatever name, or an element of a tuple)."""
    cache_type = cache_class()
    values: Iterable[Any]
    if isinstance(outputs, dict):  # ModelOutput is an OrderedDict of its non-None fields
        values = outputs.values()
    elif isinstance(outputs, tuple):
        values = outputs
    else:
        return None
    return next((value for value in values if isinstance(value, cache_type)), None)


def cache_length(cache: Any) -> int:
    """How many tokens the cache held before this forward (the first new token's index)."""
    if cache is None:
        return 0
    length = getattr(cache, "get_seq_length", None)
    if length is None:
        raise drift_error(
            f"the KV cache ({type(cache).__name__}) has no get_seq_length(), which hf_posswap reads to place new "
            "tokens."
        )
    return int(length())


def self_attention_layers(cache: Any) -> list[Any]:
    """The per-layer objects of a cache's self-attention part (an encoder-decoder cache's ``self_attention_cache``),
    each with ``keys`` [B, Hkv, slots, D], ``is_sliding`` and ``get_seq_length()``."""
    cache = getattr(cache, "self_attention_cache", cache)
    return list(getattr(cache, "layers", None) or [])


def cache_layer_at(cache: Any, index: int | None) -> Any | None:
    """Layer ``index`` of a cache's self-attention part, or None."""
    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", None)
    if layers is None or not isinstance(index, int) or not 0 <= index < len(layers):
        return None
    return layers[index]


def layer_keys(layer: Any) -> Any | None:
    """A cache layer's key tensor (None before its first update)."""
    return getattr(layer, "keys", None)


def layer_is_sliding(layer: Any) -> bool:
    """Whether a cache layer keeps only a window of recent tokens (its slot index is then not the position)."""
    return bool(getattr(layer, "is_sliding", False))


def layer_length(layer: Any) -> int:
    """Tokens seen by one cache layer (0 when it cannot say)."""
    try:
        return int(layer.get_seq_length())
    except (AttributeError, TypeError):
        return 0


# --- attention functions and masks ------------------------------------------------------------------------------


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a model runs (``config._attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


def set_attention_implementation(model: Any, name: str) -> None:
    """Select a registered attention implementation for ``model`` and its submodels."""
    model.set_attn_implementation(name)


def set_config_attention(config: Any, name: str) -> None:
    """Name the attention implementation a model built from ``config`` will run (before the model exists)."""
    config._attn_implementation = name


def register_attention(name: str, attention: Callable[..., Any], mask: str) -> None:
    """Register ``attention`` under ``name`` with the mask builder transformers uses for ``mask`` ("eager" or
    "sdpa"): a custom name gets no mask at all (padding silently ignored) unless one is registered with it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask_builder(mask))


def mask_builder(name: str) -> Callable[..., Any]:
    """transformers' mask builder for ``name`` ("eager": float mask; "sdpa": bool mask or None)."""
    from transformers import masking_utils

    return {"eager": masking_utils.eager_mask, "sdpa": masking_utils.sdpa_mask}[name]


def sdpa_attention() -> Callable[..., Any]:
    """transformers' sdpa attention function: ``(module, q, k, v, mask, dropout=, scaling=, is_causal=, **kw)``
    returning (output [B, q, H, D], None); it repeats grouped keys itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def repeat_kv(hidden: Any, groups: int) -> Any:
    """[B, Hkv, n, D] -> [B, Hkv * groups, n, D] (grouped-query keys repeated for every query head)."""
    from transformers.integrations.sdpa_attention import repeat_kv as repeat

    return repeat(hidden, groups)


#: parameters hf_posswap passes to the transformers functions it calls (by position up to the first keyword)
_EXPECTED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "sdpa_attention_forward": ("module", "query", "key", "value", "attention_mask", "dropout", "scaling"),
    "repeat_kv": ("hidden_states", "n_rep"),
}


@functools.cache
def check_interfaces() -> None:
    """Verify once per process that the transformers functions hf_posswap calls exist and take the parameters it
    passes (the mask builders it registers are called by transformers itself, with transformers' own arguments)."""
    from transformers.integrations import sdpa_attention as sdpa_module

    for name, expected in _EXPECTED_PARAMETERS.items():
        function = getattr(sdpa_module, name, None)
        if function is None:
            raise drift_error(f"transformers.integrations.sdpa_attention has no {name}.")
        parameters = inspect.signature(function).parameters
        missing = [p for p in expected if p not in parameters]
        if missing:
            raise drift_error(f"{name} no longer takes {', '.join(missing)}.")


# --- initialising weights and renaming checkpoint keys ----------------------------------------------------------

#: the flag on a tensor that makes transformers' weight initialisation leave it alone
INITIALISED_FLAG = "_is_hf_initialized"


def init_weights(model: Any, module: Any) -> None:
    """Fill ``module``'s tensors as ``model`` initialises new weights (``PreTrainedModel._init_weights``), skipping
    tensors flagged with :data:`INITIALISED_FLAG`."""
    model._init_weights(module)


def share_checkpoint_renamings(model_class_name: str, model_type: str) -> None:
    """Apply transformers' checkpoint key renamings for ``model_class_name`` (GPT-NeoX: ``embed_out`` ->
    ``lm_head``) to checkpoints of ``model_type`` too; nothing when the class has none or ``model_type`` has its
    own."""
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    conversions = get_checkpoint_conversion_mapping(model_class_name)
    if conversions and get_checkpoint_conversion_mapping(model_type) is None:
        register_checkpoint_conversion_mapping(model_type, conversions)


# --- config fields, RoPE and the Auto classes -------------------------------------------------------------------

#: the config field with the RoPE settings (``rope_type``, ``rope_theta``, ``factor``, ...; Gemma 3 nests one dict
#: per layer type); 4.x's ``rope_scaling`` is a deprecated alias transformers maps onto it
ROPE_PARAMETERS = "rope_parameters"


def config_rope_parameters(config: Any) -> dict[str, Any]:
    """A config's RoPE settings ({} when it has none)."""
    found = getattr(config, ROPE_PARAMETERS, None)
    return found if isinstance(found, dict) else {}



def rope_init_functions() -> dict[str, Callable[..., Any]]:
    """transformers' ``ROPE_INIT_FUNCTIONS``: rope_type -> fn(config, device, seq_len=) -> (inv_freq, factor)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS


def config_mapping() -> Any:
    """model_type -> config class (``CONFIG_MAPPING``; also where new model types are registered)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING


def config_class_name(model_type: str) -> str | None:
    """The name of ``model_type``'s config class, read without importing its configuration file."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return CONFIG_MAPPING_NAMES.get(model_type)


def register_config_lazily(model_type: str, stand_in: Any) -> bool:
    """Put ``stand_in`` (an object that builds and registers the real config class when first read) in
    ``AutoConfig``'s mapping under ``model_type``; ``AutoConfig.register`` would need the class itself, and building
    it imports the configuration file and with it much of transformers. False when the mapping's layout changed
    (the caller then registers the real class)."""
    extra = getattr(config_mapping(), "_extra_content", None)
    if not isinstance(extra, dict):
        return False
    extra.setdefault(model_type, stand_in)
    return True


def model_class_name(auto: Any, model_type: str) -> str | None:
    """The name of the model class that the Auto class ``auto`` maps ``model_type`` to, read without importing the
    modeling file (None: ``auto`` has no class for it). Tuples of alternatives give their first."""
    names = getattr(getattr(auto, "_model_mapping", None), "_model_mapping", None)
    if not isinstance(names, dict):  # the lazy mapping changed shape: ask the mapping itself (imports the file)
        try:
            return auto._model_mapping[config_mapping()[model_type]].__name__
        except KeyError:
            return None
    name = names.get(model_type)
    return name[0] if isinstance(name, (tuple, list)) else name


def auto_model_class(auto: Any, config_class: type) -> type | None:
    """The model class the Auto class ``auto`` builds for ``config_class`` (None: it has none); imports the
    modeling file."""
    try:
        return auto._model_mapping[config_class]
    except KeyError:
        return None


def causal_lm_class_names() -> dict[str, str]:
    """model_type -> the name of its causal-LM class (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
