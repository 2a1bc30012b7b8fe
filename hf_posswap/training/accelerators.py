"""The ``Accelerator`` of a ``finetune`` run: its sharding plugin (FSDP2 or DeepSpeed ZeRO, read from the user's
``accelerate config`` file), the model fitted to that sharding, and sharded tensors gathered back whole.

One process, data parallel, FSDP and DeepSpeed all go through :func:`make_accelerator`; the loop
(:mod:`.loop`) does not branch on the kind of sharding except through the helpers here."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidConfigError
from .config import FinetuneConfig


def fresh_accelerate_state() -> None:
    """accelerate keeps one global state per process; a second run in the same (non-distributed) process may ask
    for other settings (mixed precision), so start from a clean one. Launched process groups are left alone."""
    from accelerate.state import AcceleratorState

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        AcceleratorState._reset_state(reset_partial_state=True)


def sharding_plugins(config: FinetuneConfig) -> tuple[Any, Any]:
    """``(fsdp_plugin, deepspeed_plugin)`` from ``config.accelerate_config``; at most one is not ``None`` (both are
    ``None`` without a file, or when the file asks for no sharding)."""
    deepspeed = _deepspeed_plugin(config)  # a DeepSpeed file is read here, an FSDP one by _fsdp_plugin
    fsdp = _fsdp_plugin(config) if deepspeed is None else None
    return fsdp, deepspeed


def make_accelerator(config: FinetuneConfig, fsdp, deepspeed):
    """The run's ``Accelerator``; an FSDP plugin that accelerate would not honour here is refused."""
    from accelerate import Accelerator

    # cpu=True on machines without CUDA makes torchrun-launched processes (`accelerate launch --multi_gpu`,
    # `torchrun`) train data-parallel over gloo instead of each running alone.
    accelerator = Accelerator(
        gradient_accumulation_steps=config.grad_accum,
        mixed_precision=config.mixed_precision,
        cpu=not torch.cuda.is_available() and deepspeed is None,  # DeepSpeed on CPU: its own CPU accelerator
        fsdp_plugin=fsdp,
        # the schedule counts optimizer steps: the loop steps it once per applied update, in any number of
        # processes (accelerate's default steps it once per process per update, so N processes ran it N times
        # too fast)
        step_scheduler_with_optimizer=False,
        **_deepspeed_arguments(deepspeed),
    )
    if config.mixed_precision == "fp16" and accelerator.device.type == "cpu" and deepspeed is None:
        # accelerate leaves fp16 on the CPU without autocast or loss scaling: the run would be fp32 under its name
        raise InvalidConfigError(
            "--mixed-precision fp16 needs a GPU: on the CPU accelerate trains in float32 without autocast or loss "
            "scaling. Pass --mixed-precision bf16 (CPU autocast) or no."
        )
    if fsdp is not None:
        from .accelerate_config import check_sharding

        check_sharding(accelerator, config.accelerate_config)
    return accelerator


def fit_for_sharding(model: torch.nn.Module, accelerator, config: FinetuneConfig) -> None:
    """Ready ``model`` (in place, before ``accelerator.prepare``) for the sharding its accelerator will apply."""
    if getattr(accelerator.state, "fsdp_plugin", None) is not None:  # sharded by accelerate's FSDP
        from .accelerate_config import fit_layers_for_fsdp

        fit_layers_for_fsdp(model, config.mixed_precision, accelerator.state.fsdp_plugin, accelerator.device)
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:  # partitioned by DeepSpeed ZeRO
        from .deepspeed_config import fit_model_for_deepspeed

        fit_model_for_deepspeed(model)


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter sharded by FSDP or DeepSpeed ZeRO-3 gathered from every process (every process must call it);
    others as they are."""
    full_tensor = getattr(tensor, "full_tensor", None)
    if hasattr(tensor, "ds_id"):  # partitioned by DeepSpeed ZeRO-3
        from .deepspeed_config import gathered_copy

        return gathered_copy(tensor)
    return full_tensor() if callable(full_tensor) else tensor


def _fsdp_plugin(config: FinetuneConfig):
    """accelerate's FSDP plugin from ``config.accelerate_config`` (``None`` without one, or when it asks for no
    sharding); refused where accelerate would not shard (see :mod:`.accelerate_config`)."""
    if config.accelerate_config is None:
        return None
    from . import accelerate_config

    return accelerate_config.fsdp_plugin(config.accelerate_config, accelerate_config.accelerate_can_shard(),
                                         config.mixed_precision)


def _deepspeed_plugin(config: FinetuneConfig):
    """accelerate's DeepSpeed plugin from ``config.accelerate_config`` (``None`` without one, or when it does not
    ask for DeepSpeed)."""
    if config.accelerate_config is None:
        return None
    from .deepspeed_config import plugin_from_file

    plugin = plugin_from_file(config.accelerate_config, config.grad_accum, config.max_grad_norm)
    if plugin is not None and config.merge_lora:
        # the merge loads the base model in the main process, which under ZeRO-3 transformers partitions with
        # collectives that the other processes never join
        raise InvalidConfigError("--merge-lora with a DeepSpeed accelerate config is not supported: drop --merge-lora "
                                 "(hf-posswap commands merge a saved adapter when they load it), or train without "
                                 "--accelerate-config.")
    return plugin


def _deepspeed_arguments(plugin) -> dict[str, Any]:
    """``Accelerator`` arguments for ``plugin`` (none without one)."""
    if plugin is None:
        return {}
    from .deepspeed_config import process_group_kwargs

    return {"deepspeed_plugin": plugin, "kwargs_handlers": process_group_kwargs(torch.cuda.is_available())}


def from_main_process(accelerator, value: Any) -> Any:
    """The main process's ``value``, in every process (a barrier as well)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]
