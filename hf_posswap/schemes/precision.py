"""How position numbers keep their precision in any dtype: the dtype a fused form computes its bias in, and fixed
buffers (RoPE's frequencies, xPos's decay rates, fixed ALiBi slopes) read back exactly after a cast rounded them.

A model cast after the swap (``model.to(torch.bfloat16)``) rounds every buffer it holds; a position whose angle
or bias is its index times a rounded number drifts with the index, so these helpers give the schemes the numbers
as they were meant to be.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

#: half-precision dtypes the fused forms take on CPU (sdpa's CPU flash kernel runs them with float32 logits,
#: softmax and accumulation); their bias numbers stay float32 (:func:`bias_dtype`)
HALF_PRECISION = (torch.bfloat16, torch.float16)


def bias_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a fused form computes bias numbers in for q/k/v of ``dtype``: float32 for half precision (sdpa's
    CPU kernel adds a float32 mask to its float32 logits, so the bias is not rounded to 8 or 11 bits, as the dense
    path's mask in the model's dtype is), else ``dtype`` itself."""
    return torch.float32 if dtype in HALF_PRECISION else dtype


def exact_buffer(module: nn.Module, name: str, recompute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``module``'s fixed buffer ``name`` (RoPE's frequencies, xPos's decay rates, fixed ALiBi slopes) in float32
    (float64 when the buffer is float64), with every value that is the exact one rounded to bfloat16, float16 or
    float32 replaced by the exact one (``recompute()``, made once per device). A cast after the swap
    (``model.to(torch.bfloat16)``) rounds the buffer to 8 bits, and a checkpoint saved from such a model holds the
    rounded values even when reloaded in float32: read as they are, they would move the angle of position p by p
    times the rounding (0.36 rad at 2,047). Values changed on purpose (``inv_freq.mul_(0.5)``) are used as they
    are. Elementwise, so no device sync."""
    buffer = getattr(module, name)
    dtype = torch.float64 if buffer.dtype == torch.float64 else torch.float32
    memo = module.__dict__.setdefault("_posswap_exact_buffers", {})
    key = (name, buffer.device, dtype)
    if key not in memo:
        exact = recompute().to(buffer.device, dtype)
        memo[key] = exact, [exact.to(narrow).to(dtype) for narrow in (torch.bfloat16, torch.float16, torch.float32)]
    exact, roundings = memo[key]
    stored = buffer.to(dtype)
    if stored.shape != exact.shape:
        return stored
    rounded = (stored == roundings[0]) | (stored == roundings[1]) | (stored == roundings[2])
    return torch.where(rounded, exact, stored)
