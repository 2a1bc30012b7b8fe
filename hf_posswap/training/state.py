"""Run checkpoints: written atomically, found again by ``--resume``.

Each checkpoint is ``<output>/checkpoints/step-N`` holding accelerate's full state (model, optimizer, scheduler,
RNG of every process) and ``trainer_state.json`` (step, epoch, batches consumed in the epoch). It is written to a
hidden staging directory and renamed into place, and ``checkpoints/latest`` (a one-line file, also replaced
atomically) points at it: a crash during a save never leaves a half-written checkpoint where a good one was.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE_FILE = "trainer_state.json"


def write_text_atomic(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


def staging_dir(output: Path, step: int) -> Path:
    return output / CHECKPOINTS / f".staging-step-{step}"


def publish_checkpoint(output: Path, step: int, trainer_state: dict[str, Any], keep: int = 2) -> Path:
    """Move a fully written staging directory into place, point ``latest`` at it, drop old checkpoints."""
    staging = staging_dir(output, step)
    write_text_atomic(staging / STATE_FILE, json.dumps(trainer_state))
    final = output / CHECKPOINTS / f"step-{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    write_text_atomic(output / CHECKPOINTS / LATEST, final.name)
    finished = sorted((p for p in (output / CHECKPOINTS).glob("step-*")), key=lambda p: int(p.name.split("-")[1]))
    for old in finished[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output: Path) -> Path | None:
    pointer = output / CHECKPOINTS / LATEST
    if not pointer.exists():
        return None
    path = output / CHECKPOINTS / pointer.read_text(encoding="utf-8").strip()
    return path if (path / STATE_FILE).exists() else None


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))
