"""Denormal flushing around sdpa on CPU, for attention whose far logits underflow.

Denormals: far keys' logits lie 87-103 below the row's maximum, where exp() gives float32 denormals, and CPU
arithmetic on denormals is ~100x slower (measured, 2 threads: the fused kernel 1.66x native at 2k and 8k, 4.5x in
the 2k backward; 1.13x, 1.19x with denormals flushed). Their weights are below 1e-38 of the largest, so flushing
them to zero changes no float32 result that matters. The flag is per thread; it is set around the kernel (and its
backward) and restored. torch's worker threads keep their own flag (they inherit it when created), so only the
calling thread's share of the kernel is flushed (2 threads, batch 1: the first half of the heads, the steepest
slopes, where most denormals are up to 8k tokens); a program that calls torch.set_flush_denormal(True) before its
first parallel op has it in every thread.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def _flushing_now() -> bool:
    return bool(torch.tensor(1e-39, dtype=torch.float32).item() == 0.0)


def _flush_on() -> bool:
    """Turn flushing on; True when this call turned it on (so the caller turns it off again)."""
    return not _flushing_now() and torch.set_flush_denormal(True)


def sdpa_flushing_denormals(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """``scaled_dot_product_attention`` with denormals flushed to zero in its forward and backward (CPU only)."""
    if query.device.type != "cpu" or torch.compiler.is_compiling():  # the flag is no graph op: leave it alone
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
    turned_on = _flush_on()
    try:
        output = F.scaled_dot_product_attention(query, key, value, **kwargs)
    finally:
        if turned_on:
            torch.set_flush_denormal(False)
    if output.requires_grad:  # the mask too: a trainable bias with frozen q, k, v is the only input with a grad
        inputs = (query, key, value, kwargs.get("attn_mask"))
        _flush_in_backward(output, [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad])
    return output


def _flush_in_backward(output: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """Hooks: flushing on when the output's gradient reaches the attention backward, off when its inputs' come out
    (both run on the thread that runs the backward, right before and right after the attention's backward node)."""
    state = {"turned_on": False}

    def before(grad: torch.Tensor) -> None:
        state["turned_on"] = _flush_on()

    def after(grad: torch.Tensor) -> None:
        if state["turned_on"]:
            state["turned_on"] = False
            torch.set_flush_denormal(False)

    output.register_hook(before)
    for tensor in inputs:
        tensor.register_hook(after)
