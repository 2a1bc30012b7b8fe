"""``finetune(config)``: the accelerate training loop for swapped models (one process or many)."""

from __future__ import annotations

import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

from ..persistence.quiet import LOSS_TYPE_NOTE, SHARED_TENSOR_NOTE, hidden_logs
from ..progress import Progress, is_terminal, library_bars
from .accelerate_config import accelerate_environment_kept
from .accelerators import (
    fit_for_sharding,
    fresh_accelerate_state,
    from_main_process,
    make_accelerator,
    sharding_plugins,
    whole_tensor,
)
from .config import FinetuneConfig
from .data import expand_paths, pack, read_documents, train_eval_split
from .guards import (
    OutputLock,
    all_finite,
    check_model_path,
    check_output,
    check_positions,
    check_same_settings,
    check_sequence_length,
    check_vocabulary,
    diverged,
    remove_previous_run,
    resolve_objective,
)
from .losses import batch_loss as _loss  # the name tests patch to inject a diverging step
from .losses import collator, held_out_loss
from .model import enable_checkpointing, prepare_positions, teacher_copy, with_lora
from .model import load_model as _load_model  # the name tests patch to prove nothing loads before a refusal
from .resume import (
    CONFIG_FILE,
    LOSS_LOG,
    load_checkpoint,
    logged_loss,
    plan_resume,
    record_settings,
    say,
    truncate_loss_log,
)
from .run_checkpoints import CHECKPOINTS, PROCESS_COUNT, latest_checkpoint, publish_checkpoint, save_result, staging_dir


class EpochShuffle(Sampler[int]):
    """A permutation per epoch from ``seed + epoch``: the same order in every process and after a resume.

    Each epoch is a whole number of global batches (``global_batch`` = rows per batch x processes): the last one is
    completed with the epoch's first rows. accelerate does that itself in several processes (its ``even_batches``)
    but not in one, where the last batch would be short; doing it here for every process count makes one process
    and N read the same rows at every step, past the end of an epoch too."""

    def __init__(self, size: int, seed: int, global_batch: int = 1) -> None:
        self.size, self.seed, self.global_batch, self.epoch = size, seed, global_batch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()
        return iter((order * math.ceil(len(self) / self.size))[: len(self)])

    def __len__(self) -> int:
        return math.ceil(self.size / self.global_batch) * self.global_batch


def finetune(config: FinetuneConfig) -> dict[str, Any]:
    """Run ``config``; returns the final train / eval losses, where the result was written, the last step and
    ``first_step`` (0, or the step a resumed run continued from).

    Every check that needs no model runs first (data files, ``--model`` path, objective, ``--output``); then the
    output directory is locked for the run. Errors are :class:`~hf_posswap.errors.PosSwapError` subclasses."""
    from ..persistence.autoload import register

    register()  # swapped checkpoints' configs are read below (the hf-posswap command registers only when it runs)
    fresh_accelerate_state()
    documents = read_documents(expand_paths(config.data), config.text_field)  # bad data fails before any loading
    check_model_path(config.model)
    check_positions(config)
    objective = resolve_objective(config)
    check_output(config)
    with accelerate_environment_kept():  # accelerate's plugins and Accelerator set process-wide variables
        fsdp, deepspeed = sharding_plugins(config)
        return _accelerated(config, fsdp, deepspeed, documents, objective)


def _accelerated(config: FinetuneConfig, fsdp, deepspeed, documents: list[str], objective: str) -> dict[str, Any]:
    """The checked run under its accelerator: output locked, trained, saved."""
    from accelerate.utils import set_seed

    accelerator = make_accelerator(config, fsdp, deepspeed)
    check_same_settings(accelerator, config)
    set_seed(config.seed)
    output = Path(config.output).expanduser()
    lock = _own_output(output, accelerator, config)
    try:
        with library_bars(config.progress and is_terminal(sys.stderr)):  # no loading / saving bars in a log
            return _run(config, accelerator, output, documents, objective)
    except BaseException:
        lock.discard_if_unused()  # a run refused after loading leaves no empty output folder behind
        raise
    finally:
        lock.release()


def _own_output(output: Path, accelerator, config: FinetuneConfig) -> OutputLock:
    """Create and lock ``output`` (main process), checking again under the lock; all processes wait for it. A
    refusal there (another run holds the folder, say) is raised in every process, not only in the main one (where
    the others would fail on its closed connection instead)."""
    lock = OutputLock(output)
    refusal: Exception | None = None
    if accelerator.is_main_process:
        try:
            lock.create_folder()
            lock.acquire()
            check_output(config)  # again, under the lock: another run may have finished in between
        except BaseException as error:
            lock.discard_if_unused()
            lock.release()
            if not isinstance(error, Exception):  # Ctrl-C ends every process anyway
                raise
            refusal = error  # a refusal, or a folder that cannot be made (permissions): every process raises it
    refusal = from_main_process(accelerator, refusal)
    if refusal is not None:
        raise refusal
    return lock


class RunPosition(TypedDict):
    """Where a run stands (saved with every checkpoint): optimizer steps done, the epoch, batches read in it."""

    step: int
    epoch: int
    batches_in_epoch: int


@dataclass
class TrainingParts:
    """What the loop trains with, each passed through ``accelerator.prepare``."""

    model: nn.Module
    teacher: nn.Module | None  # distillation: the model before the swap / extension, frozen
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: DataLoader
    eval_loader: DataLoader | None
    trainable: list[nn.Parameter]  # after prepare: FSDP replaces parameters by shards
    train_batches: Any  # the training collator, told each epoch (masked LM draws its masks from it)


def _run(config: FinetuneConfig, accelerator, output: Path, documents: list[str], objective: str) -> dict[str, Any]:
    """Load and prepare the model, train it from the start or the resumed checkpoint, save the result."""
    resume = plan_resume(config, output, accelerator) if config.resume else None
    model, tokenizer, teacher = _prepared_model(config, objective, accelerator)
    parts = _training_parts(config, accelerator, model, teacher, tokenizer, documents, objective)
    position: RunPosition = {"step": 0, "epoch": 0, "batches_in_epoch": 0}
    checkpoint = None
    if resume is not None:
        checkpoint, position = load_checkpoint(accelerator, resume, config)
    first_step = position["step"]  # 0, or the step a resumed run continues from
    _start_record(config, accelerator, output, position["step"], resume)
    with hidden_logs("transformers.modeling_utils", LOSS_TYPE_NOTE):  # GPT-2's head has the usual loss all the same
        last_loss, eval_loss = _train(config, accelerator, output, objective, parts, position, checkpoint)
        if parts.eval_loader is not None:
            eval_loss = held_out_loss(parts.model, parts.eval_loader, objective, accelerator)
    if not all_finite(parts.trainable):
        raise diverged(position["step"], "final weights' value", math.nan, config, _last_saved(output))
    result_dir = save_result(accelerator, parts.model, tokenizer, output, config)
    checksum = float(sum(whole_tensor(p).detach().double().sum() for p in parts.trainable))  # equal in every process
    return {
        "train_loss": last_loss,
        "eval_loss": eval_loss,
        "output": str(result_dir),
        "steps": position["step"],
        "first_step": first_step,
        "parameter_checksum": checksum,
    }


def _prepared_model(config: FinetuneConfig, objective: str, accelerator) -> tuple[nn.Module, Any, nn.Module | None]:
    """The model to train (loaded, swapped or extended as asked, LoRA-wrapped, fit for sharding), its tokenizer,
    and the distillation teacher (the model as loaded; None without ``distill``)."""
    model, tokenizer = _load_model(config, objective, accelerator)
    check_vocabulary(model, tokenizer, config.model)
    if config.distill and config.distill_weight > 0 and (config.scheme or config.extend_to):
        check_sequence_length(model, config, teacher=True)  # the teacher: this model before the swap / extension
    teacher = teacher_copy(model, accelerator) if config.distill else None
    prepare_positions(model, config)
    check_sequence_length(model, config)
    if config.gradient_checkpointing:
        enable_checkpointing(model)
    if config.lora:
        model = with_lora(model, config)
    fit_for_sharding(model, accelerator, config)
    return model, tokenizer, teacher


def _training_parts(config: FinetuneConfig, accelerator, model: nn.Module, teacher: nn.Module | None, tokenizer,
                    documents: list[str], objective: str) -> TrainingParts:
    """The data packed into loaders, AdamW over the trainable parameters and the learning-rate schedule, prepared."""
    from transformers import get_scheduler

    token_ids = pack(documents, tokenizer, config.seq_len)
    train_set, eval_set = train_eval_split(token_ids, config.seq_len, config.eval_fraction)
    sampler = EpochShuffle(len(train_set), config.seed, config.batch_size * accelerator.num_processes)
    train_batches = collator(tokenizer, objective, config)
    train_loader = DataLoader(train_set, batch_size=config.batch_size, sampler=sampler, collate_fn=train_batches)
    eval_loader = None
    if eval_set:
        eval_batches = collator(tokenizer, objective, config, held_out=True)
        eval_loader = DataLoader(eval_set, batch_size=config.batch_size, collate_fn=eval_batches)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = get_scheduler(config.lr_schedule, optimizer, config.warmup_steps, config.steps)
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)
    trainable = [p for p in model.parameters() if p.requires_grad]  # FSDP's prepare replaces them by shards
    return TrainingParts(model, teacher, optimizer, scheduler, train_loader, eval_loader, trainable, train_batches)


def _train(config, accelerator, output: Path, objective: str, parts: TrainingParts, position: RunPosition,
           checkpoint: Path | None) -> tuple[float, float | None]:
    """The optimisation loop from ``position`` to ``config.steps``; stops before applying or saving a non-finite
    state."""
    progress = _progress(config, position["step"], accelerator)
    try:
        return _steps(config, accelerator, output, objective, parts, position, checkpoint, progress)
    finally:
        progress.close()  # also before an error, so that its message starts on a line of its own


def _steps(config, accelerator, output: Path, objective: str, parts: TrainingParts, position: RunPosition,
           checkpoint: Path | None, progress) -> tuple[float, float | None]:
    """Step until ``config.steps``: each update checked, logged and (every ``save_every``) checkpointed; an epoch
    that runs out of batches starts the next one."""
    model, optimizer, scheduler = parts.model, parts.optimizer, parts.scheduler
    train_loader, eval_loader, trainable = parts.train_loader, parts.eval_loader, parts.trainable
    last_loss, eval_loss = logged_loss(output, position["step"]) if position["step"] else math.nan, None
    micro_losses: list[torch.Tensor] = []  # of the micro-batches accumulated into the coming update
    while position["step"] < config.steps:
        train_loader.set_epoch(position["epoch"])
        parts.train_batches.set_epoch(position["epoch"])
        batches = accelerator.skip_first_batches(train_loader, position["batches_in_epoch"])
        for batch in batches:
            position["batches_in_epoch"] += 1
            with accelerator.accumulate(model):
                loss = _loss(model, parts.teacher, batch, objective, config, _pose_generator(config, position),
                             (accelerator.process_index, accelerator.num_processes),
                             _global_masked(accelerator, batch) if objective == "mlm" else None)
                micro_losses.append(loss.detach())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    _check_gradients(accelerator, trainable, config, position["step"] + 1, checkpoint)
                optimizer.step()
                if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    scheduler.step()  # once per update (see finetune's Accelerator)
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            position["step"] += 1
            # the update's loss: its micro-batches' mean (what the accumulated gradient is the gradient of), averaged
            # over the processes
            last_loss = accelerator.gather(torch.stack(micro_losses).mean()[None]).mean().item()
            micro_losses.clear()
            if not math.isfinite(last_loss):
                raise diverged(position["step"], "training loss", last_loss, config, checkpoint)
            record: dict[str, Any] = {"step": position["step"], "loss": last_loss, "lr": scheduler.get_last_lr()[0]}
            if eval_loader is not None and config.eval_every and position["step"] % config.eval_every == 0:
                eval_loss = record["eval_loss"] = held_out_loss(model, eval_loader, objective, accelerator)
            _log(output, record, accelerator)
            progress.step(_losses_note(last_loss, eval_loss))
            if (config.save_every and position["step"] % config.save_every == 0) or position["step"] == config.steps:
                if not all_finite(trainable):
                    raise diverged(position["step"], "weights' value", math.nan, config, checkpoint)
                checkpoint = _save_checkpoint(accelerator, output, position)
            if position["step"] >= config.steps:
                break
        else:
            position["epoch"] += 1
            position["batches_in_epoch"] = 0
    return last_loss, eval_loss


def _global_masked(accelerator, batch: dict[str, torch.Tensor]) -> int:
    """The masked tokens of the global batch: this process's, summed over the processes."""
    return int(accelerator.reduce((batch["labels"] != -100).sum(), reduction="sum"))


def _pose_generator(config: FinetuneConfig, position: RunPosition) -> torch.Generator:
    """The PoSE skips of a batch drawn from (seed, epoch, batch in the epoch) alone, so a resumed run draws the same
    position ids as one that never stopped."""
    seed = config.seed + 1_000_003 * position["epoch"] + 7919 * position["batches_in_epoch"]
    return torch.Generator().manual_seed(seed)


def _check_gradients(accelerator, trainable, config: FinetuneConfig, step: int, checkpoint: Path | None) -> None:
    """Clip (when asked) and stop on a non-finite gradient norm before the optimizer applies it. With fp16 the
    gradient scaler skips such steps itself, so only the loss and the weights are checked there."""
    norm = accelerator.clip_grad_norm_(trainable, config.max_grad_norm if config.max_grad_norm > 0 else math.inf)
    if config.mixed_precision == "fp16" or norm is None:
        return
    value = float(norm)
    if not math.isfinite(value):
        raise diverged(step, "gradient norm", value, config, checkpoint)


# --- progress, log and checkpoints ------------------------------------------------------------------------


def _progress(config: FinetuneConfig, initial: int, accelerator) -> Progress:
    """Optimizer steps on stderr, reported by the local main process only: a bar on a terminal, plain lines with
    the elapsed time and an ETA in a log (``config.progress=False`` or ``TQDM_DISABLE=1``: nothing)."""
    return Progress("finetune", config.steps, start=initial, min_gap=10.0,
                    enabled=config.progress and accelerator.is_local_main_process)


def _losses_note(loss: float, eval_loss: float | None) -> str:
    """``loss 5.522, eval loss 5.61``: 4 significant digits, as the closing summary."""
    held_out = f", eval loss {eval_loss:.4g}" if eval_loss is not None else ""
    return f"loss {loss:.4g}{held_out}"


def _log(output: Path, record: dict[str, Any], accelerator) -> None:
    if accelerator.is_main_process:
        with open(output / LOSS_LOG, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def _save_checkpoint(accelerator, output: Path, position: RunPosition) -> Path:
    staging = staging_dir(output, position["step"])
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    with hidden_logs("accelerate.utils.other", SHARED_TENSOR_NOTE):  # tied weights: the tie is rebuilt on load
        accelerator.save_state(str(staging))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        publish_checkpoint(output, position["step"], {**position, PROCESS_COUNT: accelerator.num_processes})
    accelerator.wait_for_everyone()
    return output / CHECKPOINTS / f"step-{position['step']}"


def _start_record(config: FinetuneConfig, accelerator, output: Path, step: int, resume: dict[str, Any] | None) -> None:
    """Right before training: clear a replaced run, cut the loss log back to the resumed step, record settings."""
    if accelerator.is_main_process:
        if config.overwrite_output_dir and (removed := remove_previous_run(output)):
            say(f"Replacing the previous run: removed its {', '.join(removed)} in {output}.")
        if config.resume:
            truncate_loss_log(output, step)
        changes = resume["changes"] if resume else {}
        if not (output / CONFIG_FILE).exists() or not config.resume or changes:
            record_settings(output, config, changes, step)
    accelerator.wait_for_everyone()


def _last_saved(output: Path) -> Path | None:
    return latest_checkpoint(output)


