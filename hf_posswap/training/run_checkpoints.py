"""Run checkpoints: written atomically, found again by ``--resume``.

Each checkpoint is ``<output>/checkpoints/step-N`` holding accelerate's full state (model, optimizer, scheduler,
RNG of every process) and ``trainer_state.json`` (step, epoch, batches consumed in the epoch, and the number of
processes that wrote it). It is written to a
hidden staging directory and renamed into place, and ``checkpoints/latest`` (a one-line file, also replaced
atomically) points at it: a crash during a save never leaves a half-written checkpoint where a good one was.
``--resume`` does not trust the pointer alone: it takes the newest ``step-N`` whose files are complete (see
:func:`checkpoints_newest_first`), so a deleted pointer or checkpoint falls back to an older one instead of step 0.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PosSwapError, one_line
from ..persistence.saving import write_file_atomic

if TYPE_CHECKING:
    from .config import FinetuneConfig

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
#: the trainer state's count of the processes that wrote the checkpoint: each process's batches, and so the data
#: position (``batches_in_epoch`` counts one process's batches) and the global batch, belong to that count
PROCESS_COUNT = "processes"
#: what accelerate's ``save_state`` writes; a checkpoint without one of each cannot be resumed. Under FSDP the model
#: is ``pytorch_model_fsdp.bin`` (``FULL_STATE_DICT``) or a ``torch.distributed.checkpoint`` folder
#: ``pytorch_model_fsdp_0/`` (``SHARDED_STATE_DICT``, its ``.metadata`` beside the shards), the optimizer
#: ``optimizer.bin`` or ``optimizer_0/`` (accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer``).
REQUIRED_FILES = ("scheduler.bin", "random_states_0.pkl")
MODEL_FILES = ("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp.bin", "pytorch_model_fsdp_0/.metadata")
OPTIMIZER_FILES = ("optimizer.bin", "optimizer_0/.metadata")
#: accelerate's own files beside a DeepSpeed checkpoint (whose model and optimizer files deepspeed_config lists)
DEEPSPEED_FILES = ("scheduler.bin", "random_states_0.pkl")


class TrainingCheckpointError(PosSwapError, ValueError):
    """A checkpoint of a run that cannot be resumed (missing or corrupt files)."""


def staging_dir(output: Path, step: int) -> Path:
    return output / CHECKPOINTS / f".staging-step-{step}"


def publish_checkpoint(output: Path, step: int, trainer_state: dict[str, Any], keep: int = 2) -> Path:
    """Move a fully written staging directory into place, point ``latest`` at it, drop old checkpoints."""
    staging = staging_dir(output, step)
    write_file_atomic(staging / STATE_FILE, json.dumps(trainer_state))
    final = output / CHECKPOINTS / f"step-{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    write_file_atomic(output / CHECKPOINTS / LATEST, final.name)
    finished = sorted(_step_dirs(output), key=_step_number)
    for old in finished[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output: Path) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names, when it still has its trainer state (else ``None``)."""
    pointer = output / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    path = output / CHECKPOINTS / pointer.read_text(encoding="utf-8").strip()
    return path if (path / STATE_FILE).exists() else None


def read_trainer_state(checkpoint: Path) -> dict[str, int]:
    """``trainer_state.json`` of ``checkpoint``, checked; a missing or corrupt file raises
    :class:`TrainingCheckpointError` naming it."""
    path = checkpoint / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TrainingCheckpointError(f"{path} is missing, so {checkpoint.name} cannot be resumed.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TrainingCheckpointError(f"{path} is corrupt ({one_line(error)}); it cannot be resumed.") from None
    keys = ("step", "epoch", "batches_in_epoch")
    if not isinstance(state, dict) or not all(_count(state.get(key)) for key in keys):
        raise TrainingCheckpointError(f"{path} is corrupt: it must hold non-negative integers {', '.join(keys)}.")
    if _step_number(checkpoint) is not None and state["step"] != _step_number(checkpoint):
        raise TrainingCheckpointError(f"{path} says step {state['step']} but sits in {checkpoint.name}; it is corrupt.")
    if PROCESS_COUNT in state and not (_count(state[PROCESS_COUNT]) and state[PROCESS_COUNT] > 0):
        raise TrainingCheckpointError(
            f"{path} is corrupt: {PROCESS_COUNT} is {state[PROCESS_COUNT]!r}, and must be a positive integer (the "
            "number of processes that wrote it); it cannot be resumed."
        )
    return {key: state[key] for key in (*keys, PROCESS_COUNT) if key in state}  # the count: absent in older ones


def checkpoints_newest_first(output: Path) -> tuple[list[tuple[Path, dict[str, int]]], list[str]]:
    """Every complete ``step-N`` checkpoint with its trainer state, newest first, and one reason per checkpoint
    that was passed over (missing or corrupt files)."""
    valid: list[tuple[Path, dict[str, int]]] = []
    rejected: list[str] = []
    for path in sorted(_step_dirs(output), key=_step_number, reverse=True):
        try:
            state = read_trainer_state(path)
            _check_files(path)
        except TrainingCheckpointError as error:
            rejected.append(str(error))
            continue
        valid.append((path, state))
    return valid, rejected


def has_checkpoint_dirs(output: Path) -> bool:
    return bool(_step_dirs(output))


def _check_files(checkpoint: Path) -> None:
    from .deepspeed_config import missing_checkpoint_files  # DeepSpeed writes its own model and optimizer files

    deepspeed_missing = missing_checkpoint_files(checkpoint)
    if deepspeed_missing is not None:
        deepspeed_missing += [name for name in DEEPSPEED_FILES if not _non_empty(checkpoint / name)]
        if deepspeed_missing:
            raise TrainingCheckpointError(f"{checkpoint} lacks {', '.join(deepspeed_missing)}; it cannot be resumed.")
        return
    missing = [name for name in REQUIRED_FILES if not _non_empty(checkpoint / name)]
    for alternatives in (MODEL_FILES, OPTIMIZER_FILES):
        if not any(_non_empty(checkpoint / name) for name in alternatives):
            missing.append(" or ".join(alternatives))
    if missing:
        raise TrainingCheckpointError(f"{checkpoint} lacks {', '.join(missing)}; it cannot be resumed.")


def _step_dirs(output: Path) -> list[Path]:
    root = output / CHECKPOINTS
    if not root.is_dir():
        return []
    return [path for path in root.glob("step-*") if path.is_dir() and _step_number(path) is not None]


def _step_number(path: Path) -> int | None:
    digits = path.name.removeprefix("step-")
    return int(digits) if path.name.startswith("step-") and digits.isdigit() else None


def _non_empty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def save_result(accelerator, model, tokenizer, output: Path, config: FinetuneConfig) -> Path:
    """The final model (or adapter, and with ``merge_lora`` the merged model), written atomically."""
    accelerator.wait_for_everyone()
    final = output / ("adapter" if config.lora else "final")
    # a sharded (FSDP) model is gathered by every process; the main one writes it
    whole = accelerator.get_state_dict(model) if _sharded(accelerator) else None
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        from .deepspeed_config import restore_scalars  # FIRE's scalars, held as [1] for DeepSpeed

        whole = restore_scalars(unwrapped, whole)
        staging = _fresh_staging(final)
        if config.lora:
            from ..persistence.adapters import save_adapter

            save_adapter(unwrapped, staging, state_dict=whole)
        else:
            unwrapped.save_pretrained(staging, state_dict=whole)
        tokenizer.save_pretrained(staging)
        _swap_in(staging, final)
        if config.merge_lora:
            merged_dir = output / "merged"
            staging = _fresh_staging(merged_dir)
            _merged(unwrapped, final, sharded=whole is not None).save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            _swap_in(staging, merged_dir)
    accelerator.wait_for_everyone()
    return final


def _merged(peft_model, adapter_dir: Path, sharded: bool):
    """The adapter folded into its base. A sharded model holds only this process's shards, so its merge is built
    from the adapter just saved, loaded onto its base the way ``hf-posswap eval --model <adapter>`` loads it."""
    if not sharded:
        return copy.deepcopy(peft_model).merge_and_unload()
    from ..persistence.loading import inspect_model_path, load_model

    return load_model(inspect_model_path(adapter_dir), "saved", merge=True)


def _sharded(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)  # ZeRO-3 partitions too


def _fresh_staging(target: Path) -> Path:
    staging = target.with_name(f".{target.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def _swap_in(staging: Path, target: Path) -> None:
    """Replace the directory ``target`` by ``staging``: the old one is renamed aside first and removed last, so a
    crash leaves either the old or the new directory complete."""
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)
