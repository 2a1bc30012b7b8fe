"""A user's own ``accelerate config`` file (yaml or json) read for its FSDP settings, which ``finetune`` passes to
``Accelerator(fsdp_plugin=...)``.

accelerate's FSDP needs CUDA: on a machine without it accelerate silently trains plain multi-CPU data parallel
(``DistributedType.MULTI_CPU``), so a run asked to shard is refused there with one line that points to
:func:`hf_posswap.training.sharding.shard_model` (FSDP2 that also runs over gloo on CPU).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidConfigError
from .accelerate_file import read_accelerate_config
from .sharding import PRECISIONS

#: ``fsdp_config`` keys whose plugin argument is not the key without its ``fsdp_`` prefix (accelerate's launcher
#: maps them the same way, through its ``FSDP_*`` environment variables)
RENAMED = {"offload_params": "cpu_offload", "transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap"}
#: prefixes of the environment variables accelerate reads and sets (see :func:`accelerate_environment_kept`)
ACCELERATE_VARIABLES = ("ACCELERATE_", "FSDP_")
CPU_ADVICE = ("FSDP through accelerate needs CUDA (without it accelerate trains plain data parallel, unsharded); on "
              "CPU shard with hf_posswap.training.sharding.shard_model (FSDP2 over gloo) in your own loop.")


def fsdp_plugin_options(settings: dict[str, Any]) -> dict[str, Any] | None:
    """``FullyShardedDataParallelPlugin`` arguments from the ``fsdp_config`` section (``None`` when the file does not
    ask for FSDP). DeepSpeed files are refused here: :mod:`.deepspeed_config` reads them (``finetune`` does so
    itself)."""
    kind = str(settings.get("distributed_type", "")).upper()
    if kind == "DEEPSPEED" or settings.get("deepspeed_config"):
        raise InvalidConfigError("The accelerate config asks for DeepSpeed, and this reads FSDP settings only: read "
                                 "it with hf_posswap.training.deepspeed_config.plugin_from_file (finetune does).")
    section = settings.get("fsdp_config") or {}
    if kind != "FSDP":
        if section:
            raise InvalidConfigError(f"The accelerate config has fsdp_config but distributed_type {kind or 'unset'}; "
                                     "set distributed_type: FSDP to shard.")
        return None
    return _plugin_arguments(section)


def fsdp_plugin(path: str | Path, cuda: bool, mixed_precision: str = "no") -> Any:
    """The ``FullyShardedDataParallelPlugin`` the file at ``path`` asks for (``None``: it asks for no sharding).
    Without CUDA a file that asks for FSDP is refused (see the module doc). With ``mixed_precision`` (``bf16`` /
    ``fp16``) its policy leaves the layers' inputs uncast: :func:`fit_layers_for_fsdp` casts them instead (accelerate's
    own policy casts through torch's ``_apply_to_tensors``, which rebuilds the position context dataclass per layer)."""
    options = fsdp_plugin_options(read_accelerate_config(path))
    if options is None:
        return None
    if not cuda:
        raise InvalidConfigError(f"accelerate config {str(path)!r} asks for FSDP: {CPU_ADVICE}")
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(**options)
    if mixed_precision in PRECISIONS and plugin.fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=PRECISIONS[mixed_precision],
                                                             reduce_dtype=torch.float32, cast_forward_inputs=False)
    return plugin


@contextlib.contextmanager
def accelerate_environment_kept() -> Iterator[None]:
    """Undo, when the run ends, the environment variables accelerate sets for the whole process
    (``Accelerator(fsdp_plugin=...)`` sets ``ACCELERATE_USE_FSDP=true``, which later runs in the same process, and
    transformers' loading, would read as a request for FSDP). Variables the launcher set are kept as they were."""
    before = {name: value for name, value in os.environ.items() if name.startswith(ACCELERATE_VARIABLES)}
    try:
        yield
    finally:
        for name in [name for name in os.environ if name.startswith(ACCELERATE_VARIABLES) and name not in before]:
            del os.environ[name]
        os.environ.update(before)


def accelerate_can_shard() -> bool:
    """Whether accelerate shards on this machine at all: its FSDP needs an accelerator (CUDA here)."""
    return torch.cuda.is_available()


def check_sharding(accelerator: Any, path: str | Path) -> None:
    """Refuse a run whose FSDP plugin accelerate did not take up: a single process started without a launcher
    (plain ``python`` or ``hf-posswap finetune``) gets ``DistributedType.NO`` and would train unsharded."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        raise InvalidConfigError(
            f"accelerate config {str(path)!r} asks for FSDP, but this process runs "
            f"{accelerator.distributed_type.value} (unsharded): start it with `accelerate launch --config_file "
            f"{path} -m hf_posswap.cli.finetune ...` (or torchrun), also for a single GPU."
        )


def fit_layers_for_fsdp(model: Any, mixed_precision: str, plugin: Any, device: torch.device) -> None:
    """Before accelerate shards ``model``: keep the modules holding 0-dim parameters (FIRE's) out of the shards
    (see :func:`replicate_scalar_holders`) and, in mixed precision, let each transformer layer cast its own tensor
    arguments (see :func:`fsdp_plugin`)."""
    from .sharding import CastInputs, transformer_layers

    if getattr(plugin, "cpu_ram_efficient_loading", False):
        _check_efficient_loading(model)
    replicate_scalar_holders(model, plugin, device)
    if mixed_precision in PRECISIONS:
        for layer in transformer_layers(model):
            layer.register_forward_pre_hook(CastInputs(PRECISIONS[mixed_precision]), with_kwargs=True)


def _check_efficient_loading(model: Any) -> None:
    """accelerate's ``cpu_ram_efficient_loading`` moves the model to the meta device and refills it from process 0's
    state dict, shard by shard: a state entry that is not a sharded parameter (a persistent buffer: fixed ALiBi
    slopes, xPos's tables) stops it, and parameters it was told to ignore (FIRE's modules) are replaced on the way,
    so ``fully_shard`` then meets FIRE's 0-dim parameters. Refused before training, with the setting to change."""
    parameters = {name for name, _ in model.named_parameters()}
    buffers = [name for name in model.state_dict() if name not in parameters]
    scalars = [name for name, param in model.named_parameters() if param.ndim == 0]
    if buffers or scalars:
        held = ", ".join((buffers or scalars)[:2])
        raise InvalidConfigError(
            f"fsdp_cpu_ram_efficient_loading: true cannot load this model's position state ({held}: "
            f"{'persistent buffers' if buffers else '0-dim parameters'}) through accelerate's meta-device refill; "
            "set fsdp_cpu_ram_efficient_loading: false in the accelerate config."
        )


def replicate_scalar_holders(model: Any, plugin: Any, device: torch.device) -> None:
    """``fully_shard`` cannot shard a 0-dim parameter (FIRE's ``c`` and threshold scale), and accelerate ignores
    whole modules only: the modules holding one join the plugin's ``ignored_modules``, stay whole on ``device`` in
    every process, and their gradients are averaged over the processes after each backward, as data parallel does
    (what :func:`~hf_posswap.training.sharding.shard_model` does for the scalars alone)."""
    import torch.distributed as dist

    holders = [module for module in model.modules() if any(p.ndim == 0 for p in module.parameters(recurse=False))]
    if not holders:
        return
    if isinstance(plugin.ignored_modules, str):
        raise InvalidConfigError(
            f"fsdp_ignored_modules {plugin.ignored_modules!r} is a pattern, and this model's FIRE modules must be "
            "ignored too: drop the setting, or list modules in Python (FullyShardedDataParallelPlugin)."
        )
    plugin.ignored_modules = [*(plugin.ignored_modules or ()), *holders]
    world = dist.get_world_size() if dist.is_initialized() else 1
    for module in holders:
        module.to(device)
        for param in module.parameters():
            if param.requires_grad and world > 1:
                param.register_post_accumulate_grad_hook(_averaged_over_processes)


def _averaged_over_processes(param: torch.nn.Parameter) -> None:
    import torch.distributed as dist

    if param.grad is not None:
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad.div_(dist.get_world_size())


def accelerate_has_fsdp2() -> bool:
    """Whether the installed accelerate builds FSDP2 plugins (its ``fsdp_version`` setting; accelerate 1.6 on)."""
    import dataclasses

    from accelerate.utils import FullyShardedDataParallelPlugin

    return "fsdp_version" in {field.name for field in dataclasses.fields(FullyShardedDataParallelPlugin)}


def _plugin_arguments(section: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    import accelerate
    from accelerate.utils import FullyShardedDataParallelPlugin

    if not accelerate_has_fsdp2():
        raise InvalidConfigError(
            f"The accelerate config asks for FSDP, and the installed accelerate {accelerate.__version__} has no FSDP2 "
            "(fsdp_version: 2, from accelerate 1.6): upgrade it (pip install -U accelerate), or shard with "
            "hf_posswap.training.sharding.shard_model (FSDP2 straight from PyTorch) in your own loop."
        )
    known = {field.name for field in dataclasses.fields(FullyShardedDataParallelPlugin)}
    options: dict[str, Any] = {}
    for key, value in section.items():
        name = key if key in known else RENAMED.get(key.removeprefix("fsdp_"), key.removeprefix("fsdp_"))
        if name not in known:
            raise InvalidConfigError(f"fsdp_config key {key!r} is not an FSDP plugin setting of accelerate (known: "
                                     f"{', '.join(sorted(map(_file_key, known)))}).")
        if name == "transformer_cls_names_to_wrap" and isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        options[name] = value
    options.setdefault("fsdp_version", 2)
    if str(options["fsdp_version"]) != "2":
        raise InvalidConfigError(
            f"fsdp_version {options['fsdp_version']!r}: hf-posswap finetune shards with FSDP2 only (the version its "
            "position modules are tested under; accelerate's FSDP1 path is its legacy one): set fsdp_version: 2."
        )
    options["fsdp_version"] = 2
    return options


def _file_key(name: str) -> str:
    """The ``fsdp_config`` key of the plugin argument ``name``."""
    renamed = {argument: key for key, argument in RENAMED.items()}
    return name if name.startswith("fsdp_") else f"fsdp_{renamed.get(name, name)}"
