"""Layer mixes of published designs, for a model's layer count (pass the model, its config, or the count).

- :func:`smollm3_nope`: SmolLM3 — NoPE on every ``no_rope_layer_interval``-th layer, RoPE elsewhere. transformers'
  ``SmolLM3Config``: ``no_rope_layers[i] = int((i + 1) % no_rope_layer_interval != 0)``, 1 = RoPE, so layers
  3, 7, 11, ... are NoPE for the default interval 4.
- :func:`llama4_irope`: Llama 4 iRoPE — the same NoPE layers (``Llama4TextConfig.no_rope_layers``, same rule) plus
  the attention temperature on them (``attn_temperature_tuning``, ``floor_scale`` 8192, ``attn_scale`` 0.1).
- :func:`cohere2_sliding_rope`: Cohere2 — RoPE only on the sliding-window layers (``Cohere2Attention`` rotates
  only where ``layer_types[i] == "sliding_attention"``), NoPE on the full-attention ones. Read from the model's
  ``config.layer_types`` when it has them; otherwise Cohere2's default pattern (``sliding_window_pattern`` 4:
  layer i slides when (i + 1) % 4 != 0), which on a model without sliding windows gives the SmolLM3 layout.
  The preset mixes the positions only; it does not add sliding windows.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidConfigError
from .base import SchemeConfig, require_int_at_least
from .mix import LLAMA4_ATTN_SCALE, LLAMA4_FLOOR_SCALE, LayerMix


def num_layers_of(model_or_layers: Any) -> int:
    """The layer count of a model, a config or an int."""
    if isinstance(model_or_layers, int) and not isinstance(model_or_layers, bool):
        count = model_or_layers
    else:
        config = getattr(model_or_layers, "config", model_or_layers)
        count = getattr(config, "num_hidden_layers", None)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidConfigError(
            f"A preset needs a model, a config with num_hidden_layers, or a layer count >= 1; got {model_or_layers!r}."
        )
    return count


def nope_layers(num_layers: int, no_rope_layer_interval: int) -> list[int]:
    """Layers without RoPE under transformers' SmolLM3 / Llama 4 rule: (i + 1) % interval == 0."""
    require_int_at_least("preset", "no_rope_layer_interval", no_rope_layer_interval, 1)
    return [i for i in range(num_layers) if (i + 1) % no_rope_layer_interval == 0]


def _mix(num_layers: int, nope: list[int], rope: str | SchemeConfig, **options: Any) -> LayerMix:
    if not nope:
        raise InvalidConfigError(
            f"The preset puts no NoPE layer in a {num_layers}-layer model (the first NoPE layer would be past the "
            "last layer). Use a smaller no_rope_layer_interval, or swap to plain RoPE."
        )
    return LayerMix(default=rope, overrides=[("none", nope)], **options)


def smollm3_nope(model_or_layers: Any, no_rope_layer_interval: int = 4, rope: str | SchemeConfig = "rope") -> LayerMix:
    """SmolLM3's layout: NoPE on layers i with (i + 1) % no_rope_layer_interval == 0, ``rope`` on the others."""
    count = num_layers_of(model_or_layers)
    return _mix(count, nope_layers(count, no_rope_layer_interval), rope)


def llama4_irope(
    model_or_layers: Any,
    no_rope_layer_interval: int = 4,
    floor_scale: float = LLAMA4_FLOOR_SCALE,
    attn_scale: float = LLAMA4_ATTN_SCALE,
    rope: str | SchemeConfig = "rope",
) -> LayerMix:
    """Llama 4's iRoPE: SmolLM3's NoPE layers plus the query temperature on them (Llama 4's defaults)."""
    count = num_layers_of(model_or_layers)
    nope = nope_layers(count, no_rope_layer_interval)
    return _mix(count, nope, rope, attn_temperature_tuning=True, floor_scale=floor_scale, attn_scale=attn_scale)


def cohere2_sliding_rope(
    model_or_layers: Any, sliding_window_pattern: int = 4, rope: str | SchemeConfig = "rope"
) -> LayerMix:
    """Cohere2's layout: RoPE on sliding-window layers, NoPE on full-attention layers (``config.layer_types`` when
    the model has them, else every ``sliding_window_pattern``-th layer is full attention)."""
    count = num_layers_of(model_or_layers)
    config = getattr(model_or_layers, "config", model_or_layers)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) == count and "sliding_attention" in layer_types:
        nope = [i for i, kind in enumerate(layer_types) if kind != "sliding_attention"]
    else:
        nope = nope_layers(count, sliding_window_pattern)
    return _mix(count, nope, rope)
