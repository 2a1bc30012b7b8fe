"""A user's ``accelerate config`` file that asks for DeepSpeed (``distributed_type: DEEPSPEED``), turned into the
``DeepSpeedPlugin`` that ``finetune`` passes to ``Accelerator(deepspeed_plugin=...)``.

The file's ``deepspeed_config`` section holds accelerate's own keys (``zero_stage``, ``offload_optimizer_device``,
``zero3_init_flag``, ``deepspeed_config_file``...); each is checked here and an unknown key or a bad value is refused
in one line that names it. Two settings are always made, because ``finetune`` needs them:

* ``zero3_save_16bit_model`` (DeepSpeed's ``stage3_gather_16bit_weights_on_model_save``) is on: the final model is
  gathered from the ZeRO-3 shards and written whole (in the dtype it trained in; "16bit" is DeepSpeed's name).
* ``zero_force_ds_cpu_optimizer`` is off: ``finetune`` builds a ``torch.optim.AdamW``, which DeepSpeed then partitions;
  DeepSpeed's own CPU Adam needs compiled ops (``DS_BUILD_OPS``), which a plain ``pip install deepspeed`` lacks.

On a machine without CUDA DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``, detected by itself) over
gloo when oneCCL's bindings are absent; accelerate then has to be told the backend (:func:`process_group_kwargs`),
or it counts one process per process group.

DeepSpeed cannot take 0-dim parameters (FIRE's ``c`` and threshold scale): it broadcasts each parameter as
``p.data.view(torch.uint8)``, which PyTorch refuses for a 0-dim float tensor ("self.dim() cannot be 0 to view Float
as Byte"; ``deepspeed/runtime/engine.py`` ``_broadcast_model``, and ``zero/partition_parameters.py``
``_zero_init_param`` under ``zero3_init_flag``). :func:`hold_scalars_as_vectors` gives them the shape [1] for the
run (FIRE reads them as scalars either way) and :func:`restore_scalars` writes them back 0-dim in the final model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InvalidConfigError

#: ``deepspeed_config`` keys and the ``DeepSpeedPlugin`` argument each one sets (accelerate's launcher maps them the
#: same way, through its ``ACCELERATE_DEEPSPEED_*`` environment variables)
PLUGIN_KEYS = {
    "zero_stage": "zero_stage",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "offload_optimizer_device": "offload_optimizer_device",
    "offload_param_device": "offload_param_device",
    "offload_optimizer_nvme_path": "offload_optimizer_nvme_path",
    "offload_param_nvme_path": "offload_param_nvme_path",
    "zero3_init_flag": "zero3_init_flag",
    "zero3_save_16bit_model": "zero3_save_16bit_model",
    "deepspeed_config_file": "hf_ds_config",
}
#: keys only ``accelerate launch`` reads (how to start processes on several machines): accepted and left alone
LAUNCHER_KEYS = {"deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_inclusion_filter",
                 "deepspeed_exclusion_filter"}
STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
FLAGS = ("zero3_init_flag", "zero3_save_16bit_model")
#: the files DeepSpeed's ``save_checkpoint`` writes per process under accelerate's ``save_state`` (tag
#: ``pytorch_model``); optimizer states carry a ``bf16_`` prefix when training in bf16
MODEL_STATES = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
OPTIM_STATES = "zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
REPLICATED_MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO stages 0-2: the model is whole in every process
CHECKPOINT_TAG = "pytorch_model"
#: the attribute that marks a 0-dim parameter held as shape [1] during a DeepSpeed run
SCALAR_MARK = "posswap_held_scalar"


def asks_for_deepspeed(settings: dict[str, Any]) -> bool:
    """Whether the settings of an ``accelerate config`` file ask for DeepSpeed."""
    return str(settings.get("distributed_type", "")).upper() == "DEEPSPEED" or bool(settings.get("deepspeed_config"))


def deepspeed_plugin_options(settings: dict[str, Any], grad_accum: int, max_grad_norm: float) -> dict[str, Any]:
    """``DeepSpeedPlugin`` arguments from the ``deepspeed_config`` section, checked; ``grad_accum`` and
    ``max_grad_norm`` are ``finetune``'s own (``--grad-accum``, ``--max-grad-norm``) and fill what the file leaves
    out (a file that sets another accumulation than ``--grad-accum`` is refused: one of them would be ignored)."""
    if str(settings.get("distributed_type", "DEEPSPEED")).upper() != "DEEPSPEED":
        raise InvalidConfigError(f"The accelerate config has deepspeed_config but distributed_type "
                                 f"{settings.get('distributed_type')}; set distributed_type: DEEPSPEED to use it.")
    section = settings.get("deepspeed_config") or {}
    if not isinstance(section, dict):
        raise InvalidConfigError(f"deepspeed_config must be a mapping of settings, got {section!r}.")
    options: dict[str, Any] = {}
    for key, value in section.items():
        if key in LAUNCHER_KEYS:
            continue
        if key not in PLUGIN_KEYS:
            raise InvalidConfigError(f"deepspeed_config key {key!r} is not a DeepSpeed setting of accelerate (known: "
                                     f"{', '.join(sorted([*PLUGIN_KEYS, *LAUNCHER_KEYS]))}).")
        options[PLUGIN_KEYS[key]] = _checked(key, value)
    if "hf_ds_config" in options:  # a DeepSpeed json holds every setting; accelerate refuses others beside it
        if len(options) > 1:
            raise InvalidConfigError("deepspeed_config sets deepspeed_config_file and "
                                     f"{', '.join(sorted(set(section) - {'deepspeed_config_file'}))}: put those "
                                     "settings in the DeepSpeed json file instead.")
        return options
    _check_accumulation(options, grad_accum)
    options.setdefault("zero_stage", 3)
    options.setdefault("gradient_clipping", max_grad_norm if max_grad_norm > 0 else "auto")
    return options


def deepspeed_plugin(settings: dict[str, Any], grad_accum: int, max_grad_norm: float) -> Any:
    """The ``DeepSpeedPlugin`` the file's settings ask for, set to train ``finetune``'s torch optimizer."""
    from accelerate.utils import DeepSpeedPlugin

    options = deepspeed_plugin_options(settings, grad_accum, max_grad_norm)
    if not deepspeed_installed():
        raise InvalidConfigError("The accelerate config asks for DeepSpeed, which is not installed: pip install "
                                 "deepspeed (DS_BUILD_OPS=0 is enough: finetune needs none of its compiled ops).")
    plugin = DeepSpeedPlugin(**options)
    # finetune writes the whole model gathered from the shards
    plugin.deepspeed_config.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    plugin.deepspeed_config["zero_force_ds_cpu_optimizer"] = False
    plugin.deepspeed_config.setdefault("zero_allow_untested_optimizer", True)
    return plugin


def deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def process_group_kwargs(cuda: bool) -> list[Any]:
    """accelerate's ``kwargs_handlers`` for a DeepSpeed run: without CUDA, the gloo backend (accelerate picks no
    backend for DeepSpeed on CPU and would count one process per group, so the batch sizes it hands DeepSpeed are
    wrong)."""
    if cuda:
        return []
    from accelerate.utils import InitProcessGroupKwargs

    return [InitProcessGroupKwargs(backend="gloo")]


def hold_scalars_as_vectors(model: Any) -> list[str]:
    """Give each 0-dim parameter of ``model`` (FIRE's) the shape [1] in place, and mark it, so DeepSpeed can
    broadcast and partition it (see the module doc); :func:`restore_scalars` turns the saved state back. Returns
    their names. Apply before the optimizer is built."""
    names = []
    for name, param in model.named_parameters():
        if param.ndim == 0:
            param.data = param.data.reshape(1)  # [] -> [1]
            setattr(param, SCALAR_MARK, True)
            names.append(name)
    return names


def restore_scalars(model: Any, state_dict: dict[str, Any] | None) -> dict[str, Any] | None:
    """``state_dict`` of ``model`` (gathered from ZeRO-3) with the parameters :func:`hold_scalars_as_vectors` gave
    the shape [1] back to 0-dim, as the model's own checkpoints hold them."""
    if state_dict is None:
        return None
    held = {name for name, param in model.named_parameters() if getattr(param, SCALAR_MARK, False)}
    return {key: value.reshape(()) if key in held else value for key, value in state_dict.items()}


def missing_checkpoint_files(checkpoint: Path, processes: int | None = None) -> list[str] | None:
    """``None`` when ``checkpoint`` is not a DeepSpeed one (no ``pytorch_model`` folder); else the DeepSpeed files
    it lacks, of every process (``processes``: how many wrote it; default: as many as left any file of their own).
    ZeRO-3 writes model states per process; stages 0-2 one ``mp_rank_00_model_states.pt``, and stages 1-2 (any
    optimizer states file) optimizer states per process."""
    folder = checkpoint / CHECKPOINT_TAG
    if not folder.is_dir():
        return None
    if processes is None:
        patterns = [(folder, MODEL_STATES), (folder, OPTIM_STATES), (folder, "bf16_" + OPTIM_STATES),
                    (checkpoint, "random_states_{rank}.pkl")]  # accelerate writes one RNG file per process
        processes = max(1, *(len(list(where.glob(name.format(rank="*")))) for where, name in patterns))
    if _non_empty(folder / REPLICATED_MODEL_STATES):  # ZeRO stages 0-2
        missing = []
        optimizer_files = any(folder.glob("*" + OPTIM_STATES.format(rank="*")))
    else:
        missing = [f"{CHECKPOINT_TAG}/{MODEL_STATES.format(rank=rank)}" for rank in range(processes)
                   if not _non_empty(folder / MODEL_STATES.format(rank=rank))]
        optimizer_files = True
    for rank in range(processes if optimizer_files else 0):
        name = OPTIM_STATES.format(rank=rank)
        if not any(_non_empty(folder / f"{prefix}{name}") for prefix in ("", "bf16_")):
            missing.append(f"{CHECKPOINT_TAG}/{name}")
    if not _non_empty(checkpoint / "latest"):
        missing.append("latest")
    return missing


def _checked(key: str, value: Any) -> Any:
    """The value of one ``deepspeed_config`` key, or an error that names it and what is allowed."""
    if key == "zero_stage" and value not in STAGES:
        raise InvalidConfigError(f"deepspeed_config zero_stage {value!r}: choose one of {STAGES}.")
    if key.endswith("_device") and str(value).lower() not in OFFLOAD_DEVICES:
        raise InvalidConfigError(f"deepspeed_config {key} {value!r}: choose one of {', '.join(OFFLOAD_DEVICES)}.")
    if key in FLAGS and not isinstance(value, bool):
        raise InvalidConfigError(f"deepspeed_config {key} {value!r}: write true or false.")
    if key == "gradient_accumulation_steps" and value != "auto" and not _positive_int(value):
        raise InvalidConfigError(f"deepspeed_config gradient_accumulation_steps {value!r}: a positive integer or auto.")
    if key == "gradient_clipping" and value != "auto" and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise InvalidConfigError(f"deepspeed_config gradient_clipping {value!r}: a positive number or auto.")
    if key == "deepspeed_config_file":
        path = Path(str(value)).expanduser()
        if not path.is_file():
            raise InvalidConfigError(f"deepspeed_config deepspeed_config_file {str(value)!r} is not a file.")
        return str(path)
    return str(value).lower() if key.endswith("_device") else value


def _check_accumulation(options: dict[str, Any], grad_accum: int) -> None:
    steps = options.get("gradient_accumulation_steps", "auto")
    if steps == "auto":
        options["gradient_accumulation_steps"] = grad_accum
    elif steps != grad_accum:
        raise InvalidConfigError(f"deepspeed_config gradient_accumulation_steps {steps} differs from --grad-accum "
                                 f"{grad_accum}: set them equal (or drop the key from the file).")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _non_empty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def plugin_from_file(path: str | Path, grad_accum: int, max_grad_norm: float) -> Any:
    """The ``DeepSpeedPlugin`` the ``accelerate config`` file at ``path`` asks for; ``None`` when it does not ask
    for DeepSpeed (an FSDP file, or one that asks for no sharding)."""
    from .accelerate_file import read_accelerate_config

    settings = read_accelerate_config(path)
    return deepspeed_plugin(settings, grad_accum, max_grad_norm) if asks_for_deepspeed(settings) else None


def fit_model_for_deepspeed(model: Any) -> None:
    """Before DeepSpeed partitions ``model``: hold its 0-dim parameters as shape [1]
    (:func:`hold_scalars_as_vectors`)."""
    hold_scalars_as_vectors(model)


def gathered_copy(param: Any) -> Any:
    """A copy of the whole of ``param``, a parameter partitioned by ZeRO-3 (every process must call it)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.detach().clone()
