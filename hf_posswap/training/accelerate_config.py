"""A user's own ``accelerate config`` file (yaml or json) read for its FSDP settings, which ``finetune`` passes to
``Accelerator(fsdp_plugin=...)``.

accelerate's FSDP needs CUDA: on a machine without it accelerate silently trains plain multi-CPU data parallel
(``DistributedType.MULTI_CPU``), so a run asked to shard is refused there with one line that points to
:func:`hf_posswap.training.sharding.shard_model` (FSDP2 that also runs over gloo on CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidConfigError, one_line
from .sharding import PRECISIONS

#: ``fsdp_config`` keys whose plugin argument is not the key without its ``fsdp_`` prefix (accelerate's launcher
#: maps them the same way, through its ``FSDP_*`` environment variables)
RENAMED = {"offload_params": "cpu_offload", "transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap"}
CPU_ADVICE = ("FSDP through accelerate needs CUDA (without it accelerate trains plain data parallel, unsharded); on "
              "CPU shard with hf_posswap.training.sharding.shard_model (FSDP2 over gloo) in your own loop.")


def read_accelerate_config(path: str | Path) -> dict[str, Any]:
    """The settings of an ``accelerate config`` file (yaml, or json which yaml also reads)."""
    import yaml

    source = Path(path).expanduser()
    try:
        settings = yaml.safe_load(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise InvalidConfigError(f"accelerate config {str(path)!r} cannot be read: {one_line(error)}.") from None
    if not isinstance(settings, dict):
        raise InvalidConfigError(f"accelerate config {str(path)!r} must be a mapping of settings (accelerate config).")
    return settings


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


def fit_layers_for_fsdp(model: Any, mixed_precision: str) -> None:
    """Before accelerate shards ``model``: refuse 0-dim parameters (FIRE's; accelerate's ``fully_shard`` cannot
    shard them and would leave them unsynchronised if ignored) and, in mixed precision, let each transformer layer
    cast its own tensor arguments (see :func:`fsdp_plugin`)."""
    from .sharding import CastInputs, transformer_layers

    scalars = [name for name, param in model.named_parameters() if param.ndim == 0]
    if scalars:
        raise InvalidConfigError(
            f"accelerate's FSDP cannot shard the 0-dim parameters {', '.join(scalars[:3])} (FIRE's); train this model "
            "with hf_posswap.training.sharding.shard_model, which replicates them, or without --accelerate-config."
        )
    if mixed_precision in PRECISIONS:
        for layer in transformer_layers(model):
            layer.register_forward_pre_hook(CastInputs(PRECISIONS[mixed_precision]), with_kwargs=True)


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
    return options


def _file_key(name: str) -> str:
    """The ``fsdp_config`` key of the plugin argument ``name``."""
    renamed = {argument: key for key, argument in RENAMED.items()}
    return name if name.startswith("fsdp_") else f"fsdp_{renamed.get(name, name)}"
