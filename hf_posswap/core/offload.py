"""accelerate's offloading (``cpu_offload``, ``disk_offload``, ``device_map`` with offloaded layers) for the position
modules: accelerate keeps an offloaded module's weights on the meta device and brings them in from its hook's
``pre_forward``, which runs only when that module is *called*. Schemes read their submodules' weights directly (T5's
tables, FIRE's MLP layers, trainable ALiBi slopes in a fused kernel), so the base model's forward brings every
offloaded position weight in around the whole forward and sends it back afterwards (position modules are small).

accelerate 1.0 (the floor) has no ``align_module_device``; the hooks' own ``pre_forward`` / ``post_forward`` are
what it calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def onloaded(positions: nn.Module | None) -> Iterator[None]:
    """Within the block, the weights of ``positions``' offloaded submodules are on their execution device."""
    hooked = []
    if positions is not None and not torch.compiler.is_compiling():  # a plain loop: dynamo traces through it whole
        for module in positions.modules():
            hook = getattr(module, "_hf_hook", None)
            if hook is not None and _offloads(hook):
                hooked.append((module, hook))
    if not hooked:
        yield
        return
    done = []
    try:
        for module, hook in hooked:
            hook.pre_forward(module)
            done.append((module, hook))
        yield
    finally:
        for module, hook in reversed(done):
            hook.post_forward(module, None)


def _offloads(hook: Any) -> bool:
    """An AlignDevicesHook that offloads, alone or inside a SequentialHook."""
    return bool(getattr(hook, "offload", False)) or any(_offloads(inner) for inner in getattr(hook, "hooks", ()))
