"""Checks a fine-tuning run makes before it loads anything, and while it trains.

Before loading: the ``--model`` path, the objective against the model's config, the ``--output`` directory (not a
file; not a previous run unless ``resume`` or ``overwrite_output_dir``). While training: the output directory is
locked (``fcntl.flock``, released by the kernel even when the process dies), and a non-finite loss, gradient or
weight stops the run before anything of that state is saved.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidConfigError, PosSwapError, closest_hint, one_line
from ..families.base import FAMILY_REGISTRY
from .config import FinetuneConfig

#: what a run writes into its output directory (``--overwrite-output-dir`` removes these and nothing else)
RUN_FILES = ("finetune_config.json", "loss_log.jsonl", "checkpoints", "final", "adapter", "merged",
             ".final.staging", ".adapter.staging", ".merged.staging", ".final.old", ".adapter.old", ".merged.old")
LOCK_FILE = ".finetune.lock"


class OutputDirError(PosSwapError, ValueError):
    """An ``--output`` that cannot take this run (a file, a previous run, a directory in use)."""


class TrainingDivergedError(PosSwapError, RuntimeError):
    """The loss, a gradient or a weight became NaN or infinite; the run stopped without saving that state."""


# --- before loading ----------------------------------------------------------------------------------------------


def check_model_path(model: str) -> None:
    """``model`` is a complete checkpoint (``hf_posswap.persistence.loading.inspect_model_path`` reads its small
    files: a missing path, a corrupt config or a truncated safetensors file is one line naming it); an adapter
    directory is refused, since training starts from full weights."""
    from ..persistence.loading import inspect_model_path

    if inspect_model_path(model).kind == "adapter":
        raise InvalidConfigError(
            f"--model {model!r} is a LoRA adapter directory, not a full checkpoint; pass its base model (with --lora "
            "to train a new adapter), or a merged model (finetune --merge-lora writes <output>/merged)."
        )


def check_positions(config: FinetuneConfig) -> None:
    """The scheme name and options and the extension method are valid before any model is loaded."""
    from ..core.extend import available_extension_methods
    from ..core.swap import resolve_scheme

    if config.scheme is not None:
        resolve_scheme(config.scheme, dict(config.scheme_options))  # unknown names and bad options raise here
    methods = available_extension_methods()
    if config.extend_method is not None and config.extend_method not in methods:
        raise InvalidConfigError(
            f"Unknown extension method {config.extend_method!r}; choose one of {', '.join(methods)}."
            f"{closest_hint(config.extend_method, methods)}"
        )


def resolve_objective(config: FinetuneConfig) -> str:
    """``causal`` or ``mlm`` from the model's config alone; impossible pairs are refused before loading weights."""
    from transformers import AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(config.model)
    except Exception as error:  # noqa: BLE001  (any parse failure of a user's file becomes one line)
        raise InvalidConfigError(
            f"--model {config.model!r}: its config.json cannot be read ({one_line(error)}); pass a valid checkpoint."
        ) from None
    base_type = getattr(model_config, "posswap_base_model_type", None) or model_config.model_type
    encoder = base_type in FAMILY_REGISTRY and not FAMILY_REGISTRY.get(base_type).is_causal(model_config)
    objective = config.objective if config.objective != "auto" else ("mlm" if encoder else "causal")
    if objective == "mlm" and not encoder:
        raise InvalidConfigError(
            f"--objective mlm needs a masked-LM encoder, but {config.model!r} is a '{base_type}' decoder; use "
            "--objective causal (or auto)."
        )
    if objective == "causal" and encoder:
        raise InvalidConfigError(
            f"--objective causal on {config.model!r}, a bidirectional '{base_type}' encoder, would let every token "
            "see the token it predicts; use --objective mlm (or auto)."
        )
    if objective == "causal" and config.seq_len < 2:
        raise InvalidConfigError(
            f"--seq-len {config.seq_len} leaves nothing to predict for a causal LM (each token predicts the next); "
            "pass --seq-len 2 or more."
        )
    return objective


def check_output(config: FinetuneConfig) -> None:
    """``--output`` is a directory (or does not exist yet) and holds no previous run unless asked for."""
    output = Path(config.output).expanduser()
    if output.is_symlink() and not output.exists():
        raise OutputDirError(f"--output {config.output!r} is a symlink to nothing; pass a directory for the run.")
    if output.exists() and not output.is_dir():
        raise OutputDirError(f"--output {config.output!r} is a file; pass a directory for the run.")
    previous = previous_run_files(output)
    if previous and not (config.resume or config.overwrite_output_dir):
        raise OutputDirError(
            f"--output {config.output!r} holds a previous run ({', '.join(previous)}); pass --resume to continue it, "
            "--overwrite-output-dir to replace it, or another --output."
        )
    if previous and config.overwrite_output_dir:
        _check_overwrite(output, previous, config)


#: result directories a user may also have made by that name; a run records its settings before writing any of them
RESULT_DIRS = ("final", "adapter", "merged")


def _check_overwrite(output: Path, previous: list[str], config: FinetuneConfig) -> None:
    """``--overwrite-output-dir`` removes only what a run wrote, and never the model this run is to load."""
    unrecorded = [name for name in previous if name in RESULT_DIRS]
    if unrecorded and "finetune_config.json" not in previous:
        raise OutputDirError(
            f"--output {config.output!r} holds {', '.join(f'{name}/' for name in unrecorded)} but no "
            "finetune_config.json, so no finetune run wrote it, and --overwrite-output-dir removes only what a run "
            "wrote; move it away, or pass another --output."
        )
    model = Path(config.model).expanduser()
    if not model.exists():
        return
    for name in previous:
        if model.resolve().is_relative_to((output / name).resolve()):
            raise OutputDirError(
                f"--model {config.model!r} lies inside {output / name}, which --overwrite-output-dir removes before "
                "training; copy the model elsewhere first, or pass another --output."
            )


def previous_run_files(output: Path) -> list[str]:
    return [name for name in RUN_FILES if (output / name).exists() or (output / name).is_symlink()]


# --- owning the output directory ---------------------------------------------------------------------------------


class OutputLock:
    """An exclusive ``flock`` on ``<output>/.finetune.lock`` for the life of a run (the kernel drops it when the
    process ends, however it ends)."""

    def __init__(self, output: Path) -> None:
        self.path = output / LOCK_FILE
        self.handle: Any = None
        self.created_folders: list[Path] = []  # the folders create_folder made, outermost first
        self.created_file = False

    def create_folder(self) -> None:
        """Make the output folder and its missing parents, remembering which ones this run made."""
        folder = self.path.parent
        missing = [path for path in (folder, *folder.parents) if not path.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        self.created_folders = missing[::-1]

    def acquire(self) -> OutputLock:
        import fcntl

        self.created_file = not self.path.exists()
        self.handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115  (held open for the whole run)
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.seek(0)
            owner = self.handle.read().strip() or "unknown"
            self.handle.close()
            self.handle = None
            raise OutputDirError(
                f"--output '{self.path.parent}' is in use by another finetune run (pid {owner}); wait for it to "
                "finish or pass another --output."
            ) from None
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(str(os.getpid()))
        self.handle.flush()
        return self

    def discard_if_unused(self) -> None:
        """Remove the lock file if this run created it, and the folders this run created if that leaves them empty,
        so a run refused after loading its model leaves the file system as it found it. Called while the lock is
        held: a run that opened the file meanwhile fails its ``flock`` instead of sharing a deleted one."""
        if self.handle is None:
            return
        if self.created_file:
            self.path.unlink(missing_ok=True)
        for path in reversed(self.created_folders):  # innermost first; rmdir refuses a folder that is not empty
            try:
                path.rmdir()
            except OSError:
                break

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the descriptor releases the lock
            self.handle = None


def remove_previous_run(output: Path) -> list[str]:
    """Remove what a previous run wrote (``RUN_FILES``; inside ``checkpoints/`` only its ``step-N`` directories,
    staging directories and ``latest``) and nothing else; returns the names removed."""
    removed = previous_run_files(output)
    for name in removed:
        path = output / name
        if name == "checkpoints" and path.is_dir() and not path.is_symlink():
            _remove_checkpoints(path)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return removed


def _remove_checkpoints(root: Path) -> None:
    for path in root.iterdir():
        written = path.name == "latest" or path.name.startswith((".latest.tmp-", ".staging-step-"))
        written = written or (path.name.startswith("step-") and path.name[5:].isdigit())
        if not written:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if not any(root.iterdir()):
        root.rmdir()


# --- after loading, while training -------------------------------------------------------------------------------


def check_sequence_length(model: torch.nn.Module, config: FinetuneConfig, teacher: bool = False) -> None:
    """A learned absolute table (native or swapped) has a fixed number of positions; positions past it fail mid-run.
    Refuse ``seq_len`` (or ``pose_target``) beyond it before any data is prepared. ``teacher``: ``model`` is the
    distillation teacher, the model as loaded, which sees the student's positions but keeps its own table."""
    needed = max(config.seq_len, config.pose_target or 0)
    table = learned_table_length(model)
    if table is not None and needed > table:
        flag = "pose-target" if needed != config.seq_len else "seq-len"
        if teacher:
            raise InvalidConfigError(
                f"--distill: the teacher is the model as loaded, before --scheme / --extend-to, and its learned "
                f"position table has {table} positions, so it cannot read --{flag} {needed}; pass --{flag} {table} "
                "or less, or train without --distill."
            )
        raise InvalidConfigError(
            f"--{flag} {needed} is past the model's learned position table ({table} positions); pass --{flag} "
            f"{table} or less, or grow the table first (--extend-to {needed}, or --scheme alibi/rope/...)."
        )


def check_vocabulary(model: torch.nn.Module, tokenizer, path: str) -> None:
    """Every id the tokenizer can give has a row in the model's input embeddings; otherwise the first batch holding
    such an id fails deep in the forward with an ``IndexError``. Refused before any data is tokenized."""
    rows = embedding_rows(model)
    if rows is not None and len(tokenizer) > rows:
        raise InvalidConfigError(
            f"--model {path!r}: its tokenizer has {len(tokenizer)} tokens but the model's input embeddings have "
            f"{rows} rows, so token ids >= {rows} have no embedding. Use the checkpoint's own tokenizer, or resize "
            "the embeddings with model.resize_token_embeddings(len(tokenizer)) before saving the checkpoint."
        )


def embedding_rows(model: torch.nn.Module) -> int | None:
    """Rows of the model's input embedding table, or ``None`` when it has no ``nn.Embedding`` input table."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    return embeddings.num_embeddings if isinstance(embeddings, torch.nn.Embedding) else None


def learned_table_length(model: torch.nn.Module) -> int | None:
    """Positions of the model's learned absolute table, or ``None`` when its positions are not a fixed table."""
    from ..core.describe import describe
    from ..families.base import FAMILY_REGISTRY

    description = describe(model)
    if description.scheme == "learned":
        length = description.settings.get("max_positions")
        return length if isinstance(length, int) else None
    if description.scheme != "native" or description.family not in FAMILY_REGISTRY:
        return None
    adapter = FAMILY_REGISTRY.get(description.family)
    slot = adapter.absolute_slot(adapter.base_model(model))
    table = getattr(*slot) if slot is not None else None
    return table.num_embeddings if isinstance(table, torch.nn.Embedding) else None


def all_finite(parameters: list[torch.nn.Parameter]) -> bool:
    """Whether every value of ``parameters`` is finite, in every process. FSDP's parameters are DTensors (their
    check spans the processes); DeepSpeed ZeRO-3 leaves an empty placeholder in the parameter and this process's
    partition in ``ds_tensor``, so those partitions are checked and the answer agreed over the processes."""
    partitioned = any(hasattr(p, "ds_tensor") for p in parameters)
    local = [getattr(p, "ds_tensor", p) for p in parameters]
    finite_here = all(bool(torch.isfinite(t.detach()).all()) for t in local)
    if not (partitioned and torch.distributed.is_available() and torch.distributed.is_initialized()):
        return finite_here
    flag = torch.tensor([0.0 if finite_here else 1.0], device=local[0].device)
    torch.distributed.all_reduce(flag)  # every process must stop together, or the others would wait forever
    return float(flag) == 0.0


def diverged(step: int, what: str, value: float, config: FinetuneConfig, last_good: Path | None) -> PosSwapError:
    """The error for a non-finite loss / gradient norm / weight at ``step``."""
    kept = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint had been written yet"
    return TrainingDivergedError(
        f"Training diverged at step {step}: the {what} is {value}; the run stopped and saved nothing of this state "
        f"({kept}). Lower --lr (now {config.lr:g}) or check the data and settings, then start again with "
        "--overwrite-output-dir."
    )


def finite(value: float) -> bool:
    return math.isfinite(value)


def check_same_settings(accelerator, config: FinetuneConfig) -> None:
    """Every process must run the same settings: one started with others (another ``--lr`` in a per-node launch
    file, say) trains a replica that drifts apart while the run reports success. Refused in every process, naming
    each setting that differs and its value in each process."""
    if accelerator.num_processes == 1:
        return
    from accelerate.utils import gather_object

    mine = dataclasses.asdict(config)
    everyone = gather_object([mine])  # one dict per process, in process order
    differing = [name for name in mine if any(settings[name] != mine[name] for settings in everyone)]
    if differing:
        described = "; ".join(
            f"{name} " + ", ".join(f"{settings[name]!r} in process {rank}" for rank, settings in enumerate(everyone))
            for name in differing
        )
        raise InvalidConfigError(f"The processes of this run were started with different settings ({described}); "
                                 "start every process with the same arguments.")
