"""Periodic sharded checkpoints of an FSDP2 run with ``torch.distributed.checkpoint`` (DCP).

Each process writes its own shards of the model and optimizer state (``get_state_dict`` gives the sharded views,
``set_state_dict`` puts them back); no process ever holds the whole model. The layout and the atomicity are those of
the accelerate checkpoints (:mod:`hf_posswap.training.run_checkpoints`): everything is written to
``<output>/checkpoints/.staging-step-N``, then rank 0 writes ``trainer_state.json``, renames the directory to
``step-N`` and points ``checkpoints/latest`` at it. A run killed during a save leaves the previous checkpoint and
the pointer as they were. Reference: PyTorch "Getting started with Distributed Checkpoint (DCP)".

Any number of processes can load a checkpoint (DCP reshards on load), also a different number than wrote it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from .run_checkpoints import CHECKPOINTS, STATE_FILE, publish_checkpoint, staging_dir

#: the file DCP writes last (the index of every shard); a directory without it is not a checkpoint
DCP_METADATA = ".metadata"


def save_sharded_checkpoint(output: str | Path, step: int, model: nn.Module, optimizer: Any,
                            trainer_state: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                            keep: int = 2) -> Path:
    """Write ``<output>/checkpoints/step-<step>`` (model and optimizer shards, ``extra`` objects with
    ``state_dict``/``load_state_dict`` such as an LR scheduler, and ``trainer_state`` as JSON). Every process must
    call it; the ``keep`` newest checkpoints are kept. Returns the checkpoint's path."""
    import torch.distributed.checkpoint as dcp

    output = Path(output)
    staging = staging_dir(output, step)
    if _is_main():
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save left behind
        staging.mkdir(parents=True)
    _barrier()
    with _single_process_note_hidden():
        dcp.save(_state(model, optimizer, extra), checkpoint_id=str(staging), no_dist=not _distributed())
    _barrier()
    if _is_main():
        publish_checkpoint(output, step, {"step": step, **(trainer_state or {})}, keep=keep)
    _barrier()
    return output / CHECKPOINTS / f"step-{step}"


def load_sharded_checkpoint(checkpoint: str | Path, model: nn.Module, optimizer: Any,
                            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load ``checkpoint`` into the (sharded) ``model``, ``optimizer`` and ``extra`` objects; returns its trainer
    state. Every process must call it, after :func:`~hf_posswap.training.sharding.shard_model` and after building
    the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    checkpoint = Path(checkpoint)
    state = _state(model, optimizer, extra)
    with _single_process_note_hidden():
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=not _distributed())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))


def latest_sharded_checkpoint(output: str | Path) -> Path | None:
    """The newest complete ``step-N`` under ``<output>/checkpoints`` (trainer state and DCP index present)."""
    root = Path(output) / CHECKPOINTS
    complete = [path for path in root.glob("step-*")
                if path.name.removeprefix("step-").isdigit() and (path / STATE_FILE).is_file()
                and (path / DCP_METADATA).is_file()]
    return max(complete, key=lambda path: int(path.name.removeprefix("step-")), default=None)


def _state(model: nn.Module, optimizer: Any, extra: dict[str, Any] | None) -> dict[str, Any]:
    """What DCP saves and loads: the sharded model and optimizer state dicts (fully-qualified parameter names, so
    the optimizer state does not depend on parameter order), plus ``extra`` (DCP calls their ``state_dict``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state, **(extra or {})}


@contextlib.contextmanager
def _single_process_note_hidden():
    """DCP warns on every single-process save and load ("assuming the intent is to save in a single process"): here
    one process is what was asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _distributed() -> bool:
    """A process group is running (else the checkpoint is one process's, written without collectives)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _is_main() -> bool:
    import torch.distributed as dist

    return not _distributed() or dist.get_rank() == 0


def _barrier() -> None:
    import torch.distributed as dist

    if _distributed():
        dist.barrier()
