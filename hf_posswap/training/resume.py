"""``--resume``: the settings recorded by the run being continued, what may change, and the loss log.

A resumed run must be the same run: every setting except those in ``RESUME_SAFE`` (how long to train, how often to
evaluate and save) must equal the one recorded in ``finetune_config.json``; otherwise the run is refused with the
list of differences, because the checkpoint's optimizer, scheduler and weights belong to the old settings. Safe
changes are applied and recorded truthfully: the record keeps a ``resumed`` list of ``{"at_step", "changed"}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from ..errors import PosSwapError
from .config import RESUME_SAFE, RUN_CONTROL, FinetuneConfig
from .state import write_text_atomic

CONFIG_FILE = "finetune_config.json"
LOSS_LOG = "loss_log.jsonl"
HISTORY_KEY = "resumed"


class ResumeError(PosSwapError, ValueError):
    """``--resume`` that cannot continue the recorded run as it was."""


def recorded_settings(output: Path) -> dict[str, Any]:
    """The settings in ``<output>/finetune_config.json``; a missing or corrupt record raises :class:`ResumeError`."""
    path = output / CONFIG_FILE
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResumeError(
            f"{path} is missing, so the settings of the run to resume are unknown; restore it, or start a new run "
            "with --overwrite-output-dir."
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ResumeError(
            f"{path} is corrupt ({' '.join(str(error).split())}); restore it, or start a new run with "
            "--overwrite-output-dir."
        ) from None
    if not isinstance(recorded, dict):
        raise ResumeError(f"{path} is corrupt: it must hold a JSON object of settings.")
    return recorded


def setting_changes(recorded: dict[str, Any], config: FinetuneConfig) -> dict[str, tuple[Any, Any]]:
    """``{name: (recorded, now)}`` for every setting that differs (run-control flags are not settings). A setting
    the record lacks (written by an older version) counts as its default."""
    changes: dict[str, tuple[Any, Any]] = {}
    for field in dataclasses.fields(FinetuneConfig):
        if field.name in RUN_CONTROL:
            continue
        old, new = recorded.get(field.name, _default(field)), getattr(config, field.name)
        if _normalised(field.name, old) != _normalised(field.name, new):
            changes[field.name] = (old, new)
    return changes


def check_changes(output: Path, config: FinetuneConfig) -> dict[str, tuple[Any, Any]]:
    """The safe changes of a resume; any other change raises :class:`ResumeError` naming each (old -> new)."""
    changes = setting_changes(recorded_settings(output), config)
    unsafe = {name: values for name, values in changes.items() if name not in RESUME_SAFE}
    if unsafe:
        listed = "; ".join(f"{name}: {old!r} -> {new!r}" for name, (old, new) in unsafe.items())
        raise ResumeError(
            f"--resume would continue the run in {output} with other settings ({listed}); the checkpoint belongs to "
            f"the recorded ones. Resume with the recorded settings (only {', '.join(RESUME_SAFE)} may change), or "
            "start a new run in another --output (or with --overwrite-output-dir)."
        )
    return changes


def check_steps(config: FinetuneConfig, step: int, checkpoint: Path) -> None:
    if config.steps < step:
        raise ResumeError(
            f"steps={config.steps} is below the step of the checkpoint to resume ({checkpoint}: step {step}); "
            f"pass --steps {step} or more."
        )


def record_settings(output: Path, config: FinetuneConfig, changes: dict[str, tuple[Any, Any]], step: int) -> None:
    """Write ``finetune_config.json``: the settings now in force and, after a resume with safe changes, when and
    what changed."""
    history: list[dict[str, Any]] = []
    if config.resume and (output / CONFIG_FILE).exists():
        history = list(recorded_settings(output).get(HISTORY_KEY, []))
        if changes:
            history.append({"at_step": step, "changed": {name: list(pair) for name, pair in changes.items()}})
    record = dataclasses.asdict(config)
    if history:
        record[HISTORY_KEY] = history
    write_text_atomic(output / CONFIG_FILE, json.dumps(record, indent=2))


def truncate_loss_log(output: Path, step: int) -> None:
    """Keep the loss records up to ``step`` (a run killed after its last checkpoint logged steps that the resumed
    run repeats); a half-written last line is dropped."""
    path = output / LOSS_LOG
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
    write_text_atomic(path, "".join(f"{line}\n" for line in kept))


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _normalised(name: str, value: Any) -> Any:
    """Paths compare by where they point (a resume from another working directory is the same run)."""
    if name == "model" and isinstance(value, str):
        return os.path.realpath(os.path.expanduser(value))
    if name == "data" and isinstance(value, (list, tuple)):
        return [os.path.realpath(os.path.expanduser(item)) if isinstance(item, str) else item for item in value]
    if name == "output":
        return None  # the record sits in the output directory itself
    return value
