"""Sharded training with PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) for swapped models.

:func:`shard_model` shards each transformer layer as its own unit and everything else (embeddings, final norm,
head, and the position module the swap installed on the base model, ``base.posswap_positions``) as the root unit.
The position parameters (T5 tables, KERPLE / FIRE parameters, learned tables, trainable ALiBi slopes) are then
sharded, gathered and reduce-scattered like any other weight.

Why this works with the swap's ``forward`` wrapper (:class:`~hf_posswap.core.context.PositionForward`, set on the
base model *instance*): ``fully_shard`` registers forward pre/post hooks and changes the module's class, but
``nn.Module.__call__`` still calls the instance's ``forward`` between the hooks, so the position context is built as
before. The root unit is gathered in the root's pre-forward hook, before the base model's wrapper runs, and FSDP2
keeps the root gathered until the end of backward: attention reads the position module by attribute at call time
(also when gradient checkpointing recomputes a layer in backward) and finds the full tensors.

Call the model through its outermost module (``model(...)``, ``generate``): calling ``model.base_model.forward``
directly skips the root's hooks, and the parameters are then still sharded.

accelerate's FSDP plugin needs CUDA (on CPU it silently trains plain data parallel); this function is what runs
everywhere, gloo included. Reference: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) documentation and
torchtitan's ``apply_fsdp`` (a unit per transformer block, then the root).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InvalidConfigError

#: ``mixed_precision`` names: parameters gathered (and computed) in this dtype, gradients reduced in float32
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shard_model(model: nn.Module, mesh: Any = None, reshard_after_forward: bool = True,
                mixed_precision: Any = None) -> nn.Module:
    """Shard ``model`` (swapped or not, a peft wrapper or a transformers model) in place with FSDP2 and return it.

    One ``fully_shard`` unit per transformer layer (the classes transformers names in ``_no_split_modules`` that sit
    in a ``ModuleList``), then the root. ``mesh``: a 1-D device mesh (default: every process of the default group).
    ``reshard_after_forward``: free each layer's gathered weights after its forward (ZeRO-3; ``False``: ZeRO-2).
    ``mixed_precision``: ``None`` (full precision), ``"bf16"``, ``"fp16"`` or a ``MixedPrecisionPolicy``.
    Needs an initialised process group (``torch.distributed.init_process_group``); apply it after the swap and after
    turning gradient checkpointing on, and build the optimizer afterwards (it must hold the sharded parameters)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    _check_distributed(mesh)
    if isinstance(model, FSDPModule):
        raise InvalidConfigError("The model is sharded already: call shard_model once, after swapping.")
    layers = transformer_layers(model)
    if not layers:
        raise InvalidConfigError(
            f"{type(model).__name__} names no transformer layer class (_no_split_modules): cannot shard it by layer."
        )
    mesh = mesh if mesh is not None else _default_mesh()
    scalars = replicate_scalars(model, mesh)
    policy = _precision_policy(mixed_precision)
    # FSDP's own input cast rebuilds every dataclass in a layer's arguments (torch's _apply_to_tensors), the position
    # context included: attention would then fill a copy's memo and mark a copy as reached. Layers cast their
    # top-level tensor arguments with CastInputs instead.
    layer_policy = dataclasses.replace(policy, cast_forward_inputs=False)
    for layer in layers:
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            layer.register_forward_pre_hook(CastInputs(policy.param_dtype), with_kwargs=True)
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=layer_policy,
                    ignored_params=scalars)
    # the root without reshard_after_forward: FSDP2 then keeps it gathered from its forward to the end of backward
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=scalars)
    return model


class CastInputs:
    """A forward pre-hook casting a layer's floating-point tensor arguments (and tuples of them, such as LLaMA's
    ``position_embeddings``) to ``dtype``; other objects, the position context among them, pass untouched."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return tuple(map(self._cast, args)), {key: self._cast(value) for key, value in kwargs.items()}

    def _cast(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.dtype) if value.is_floating_point() else value
        if type(value) in (tuple, list):
            return type(value)(self._cast(item) for item in value)
        return value


def replicate_scalars(model: nn.Module, mesh: Any) -> set[nn.Parameter]:
    """The 0-dim parameters of ``model`` (FIRE's ``c`` and threshold scale), which ``fully_shard`` cannot shard:
    kept whole in every process (moved to the mesh's device) and their gradients averaged over the mesh after each
    backward, as data parallel does. Returns them, for ``fully_shard(ignored_params=...)``."""
    device = _mesh_device(mesh)
    group = mesh.get_group()
    scalars = {param for param in model.parameters() if param.ndim == 0}
    for param in scalars:
        param.data = param.data.to(device)
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: _average(p.grad, group))
    return scalars


def _average(grad: torch.Tensor | None, group: Any) -> None:
    """Replace ``grad`` by its mean over ``group`` (in place)."""
    import torch.distributed as dist

    if grad is not None:
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        grad.div_(dist.get_world_size(group))


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer layers of ``model``: modules of a ``_no_split_modules`` class held in a
    ``ModuleList`` (``BertEmbeddings`` is also listed by BERT but is not a layer)."""
    names = set(getattr(_transformers_model(model), "_no_split_modules", None) or ())
    layers = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            # fully_shard renames a sharded layer's class FSDP<name>
            layers.extend(child for child in module if type(child).__name__.removeprefix("FSDP") in names)
    return layers


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on the CPU of rank 0 (every process must call it; the others get ``{}``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_full_model(model: nn.Module, directory: str | Path, tokenizer: Any = None) -> Path:
    """Gather the sharded ``model`` and write it with ``save_pretrained`` from rank 0 (with the swap's ``posswap``
    config record, so it reloads through the Auto classes), atomically: a staging directory renamed into place.
    Every process must call it."""
    import torch.distributed as dist

    from .run_checkpoints import _fresh_staging, _swap_in

    state = full_state_dict(model)
    target = Path(directory)
    if dist.get_rank() == 0:
        staging = _fresh_staging(target)
        _transformers_model(model).save_pretrained(staging, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        _swap_in(staging, target)
    dist.barrier()
    return target


def _transformers_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # peft
    return get_base() if callable(get_base) else model


def _precision_policy(mixed_precision: Any) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if mixed_precision not in PRECISIONS:
        raise InvalidConfigError(
            f"mixed_precision={mixed_precision!r}: choose None, {', '.join(map(repr, PRECISIONS))} or a "
            "torch.distributed.fsdp.MixedPrecisionPolicy."
        )
    return MixedPrecisionPolicy(param_dtype=PRECISIONS[mixed_precision], reduce_dtype=torch.float32)


def _default_mesh() -> Any:
    """Every process of the default group, on CUDA when there is one (``fully_shard``'s own default)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))


def _mesh_device(mesh: Any) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _check_distributed(mesh: Any) -> None:
    import torch.distributed as dist

    if mesh is None and not (dist.is_available() and dist.is_initialized()):
        raise InvalidConfigError(
            "shard_model needs a process group: launch with torchrun (or accelerate launch) and call "
            "torch.distributed.init_process_group(), or pass a device mesh."
        )
