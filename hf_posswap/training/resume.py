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
import sys
from pathlib import Path
from typing import Any

from ..errors import PosSwapError
from ..persistence.saving import write_file_atomic
from .config import RESUME_SAFE, RUN_CONTROL, FinetuneConfig
from .guards import previous_run_files
from .run_checkpoints import (
    PROCESS_COUNT,
    TrainingCheckpointError,
    checkpoints_newest_first,
    has_checkpoint_dirs,
)

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
    record = _anchored(dataclasses.asdict(config))
    if history:
        record[HISTORY_KEY] = history
    write_file_atomic(output / CONFIG_FILE, json.dumps(record, indent=2))


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
    write_file_atomic(path, "".join(f"{line}\n" for line in kept))


def logged_loss(output: Path, step: int) -> float:
    """The training loss the loss log holds for ``step`` (NaN when it holds none): what a resumed run that has no
    step left to train reports."""
    path = output / LOSS_LOG
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step") == step and isinstance(record.get("loss"), (int, float)):
            return float(record["loss"])
    return float("nan")


def plan_resume(config: FinetuneConfig, output: Path, accelerator) -> dict[str, Any] | None:
    """What ``--resume`` will do, decided from files alone: the checkpoints to try (newest valid first) and the
    safe setting changes. ``None``: nothing to resume (a fresh directory), the run starts at step 0."""
    if not previous_run_files(output):
        say(f"--resume: no previous run in {output}; starting at step 0.", accelerator)
        return None
    changes = check_changes(output, config)
    valid, rejected = checkpoints_newest_first(output)
    if not valid and has_checkpoint_dirs(output):
        raise TrainingCheckpointError(
            f"--resume found no usable checkpoint in {output}: {' '.join(rejected)} Start a new run with "
            "--overwrite-output-dir."
        )
    finished = [name for name in ("final", "adapter") if (output / name).exists()]
    if not valid and finished:
        raise TrainingCheckpointError(
            f"--resume: the run in {output} has {finished[0]}/ but no checkpoint to continue from; start a new run "
            "with --overwrite-output-dir (or in another --output)."
        )
    if not valid:
        say(f"--resume: the run in {output} stopped before its first checkpoint; starting at step 0.", accelerator)
    else:
        check_process_count(*valid[0], accelerator.num_processes)
    return {"candidates": valid, "rejected": rejected, "changes": changes}


def check_process_count(checkpoint: Path, state: dict[str, int], processes: int) -> None:
    """A checkpoint continues only in as many processes as wrote it: each process's batches, the global batch
    (``batch_size`` x processes) and the data position (``batches_in_epoch``, one process's count) belong to them."""
    written_by = state.get(PROCESS_COUNT, processes)  # checkpoints from before the count was kept: not checked
    if written_by != processes:
        raise ResumeError(
            f"--resume: {checkpoint} was written by {written_by} process(es) and this run has {processes}; the global "
            f"batch and the data position belong to {written_by}. Resume with `accelerate launch --num_processes "
            f"{written_by}`, or start a new run in another --output (or with --overwrite-output-dir)."
        )


def load_checkpoint(accelerator, resume: dict[str, Any], config: FinetuneConfig):
    """Load the newest checkpoint that loads, saying which ones were passed over and why."""
    passed_over = list(resume["rejected"])
    for path, state in resume["candidates"]:
        check_steps(config, state["step"], path)
        try:
            check_process_count(path, state, accelerator.num_processes)
        except ResumeError as refused:
            if passed_over:  # reached after others were passed over: say why those were
                raise ResumeError(f"{refused} It was tried because of: {' '.join(passed_over)}") from None
            raise
        try:
            accelerator.load_state(str(path))
        except Exception as error:  # noqa: BLE001  (any failure to load means: try the next older checkpoint)
            passed_over.append(f"{path} does not load ({type(error).__name__}: {' '.join(str(error).split())[:200]}).")
            continue
        if passed_over:
            say(f"--resume: passed over {' '.join(passed_over)} Resuming from the older {path}.", accelerator)
        say(f"Resumed from {path} at step {state['step']}.", accelerator)
        return path, {key: value for key, value in state.items() if key != PROCESS_COUNT}
    if passed_over:
        raise TrainingCheckpointError(
            f"--resume: no checkpoint loads: {' '.join(passed_over)} Start a new run with --overwrite-output-dir."
        )
    return None, {"step": 0, "epoch": 0, "batches_in_epoch": 0}


def say(message: str, accelerator=None) -> None:
    if accelerator is None or accelerator.is_main_process:
        print(message, file=sys.stderr, flush=True)


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _anchored(record: dict[str, Any]) -> dict[str, Any]:
    """The settings with their local paths made absolute: a relative path means nothing once the working directory
    changes, so a resume from elsewhere compares with where the run's files really were. A model name that is no
    local path (a hub id) stays as given."""
    model = os.path.expanduser(record["model"])
    if os.path.exists(model):
        record["model"] = os.path.abspath(model)
    record["data"] = [os.path.abspath(os.path.expanduser(item)) for item in record["data"]]
    if record.get("accelerate_config") is not None:
        record["accelerate_config"] = os.path.abspath(os.path.expanduser(record["accelerate_config"]))
    return record


def _normalised(name: str, value: Any) -> Any:
    """Paths compare by where they point (a resume from another working directory is the same run)."""
    if name in ("model", "accelerate_config") and isinstance(value, str):
        return os.path.realpath(os.path.expanduser(value))
    if name == "data" and isinstance(value, (list, tuple)):
        return [os.path.realpath(os.path.expanduser(item)) if isinstance(item, str) else item for item in value]
    if name == "output":
        return None  # the record sits in the output directory itself
    return value
