"""``finetune(config)``: the accelerate training loop for swapped models (one process or many)."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from .config import FinetuneConfig
from .data import expand_paths, pack, read_documents, train_eval_split
from .losses import distillation_kl, hidden_state_matching, pose_position_ids
from .state import latest_checkpoint, publish_checkpoint, read_trainer_state, staging_dir

LOSS_LOG = "loss_log.jsonl"


class EpochShuffle(Sampler[int]):
    """A permutation per epoch from ``seed + epoch``: the same order in every process and after a resume."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())

    def __len__(self) -> int:
        return self.size


def finetune(config: FinetuneConfig) -> dict[str, Any]:
    """Run ``config``; returns the final train / eval losses and where the result was written."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    _fresh_accelerate_state()
    # cpu=True on machines without CUDA makes torchrun-launched processes (`accelerate launch --multi_gpu`,
    # `torchrun`) train data-parallel over gloo instead of each running alone.
    accelerator = Accelerator(
        gradient_accumulation_steps=config.grad_accum,
        mixed_precision=config.mixed_precision,
        cpu=not torch.cuda.is_available(),
    )
    set_seed(config.seed)
    output = Path(config.output)
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        (output / "finetune_config.json").write_text(config.to_json(), encoding="utf-8")

    documents = read_documents(expand_paths(config.data), config.text_field)  # bad paths fail before any loading
    model, tokenizer, objective = _load_model(config)
    teacher = _teacher(model, accelerator) if config.distill else None
    _prepare_positions(model, config)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.lora:
        from peft import get_peft_model

        from ..peft_utils import lora_config

        model = get_peft_model(model, lora_config(model, config.lora_r, config.lora_alpha, config.lora_dropout))

    token_ids = pack(documents, tokenizer, config.seq_len)
    train_set, eval_set = train_eval_split(token_ids, config.seq_len, config.eval_fraction)
    sampler = EpochShuffle(len(train_set), config.seed)
    collate = _collator(tokenizer, objective, config)
    train_loader = DataLoader(train_set, batch_size=config.batch_size, sampler=sampler, collate_fn=collate)
    eval_loader = DataLoader(eval_set, batch_size=config.batch_size, collate_fn=collate) if eval_set else None

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = get_scheduler(config.lr_schedule, optimizer, config.warmup_steps, config.steps)
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)

    position = {"step": 0, "epoch": 0, "batches_in_epoch": 0}
    if config.resume and (checkpoint := latest_checkpoint(output)) is not None:
        accelerator.load_state(str(checkpoint))
        position = read_trainer_state(checkpoint)
        accelerator.print(f"Resumed from {checkpoint} at step {position['step']}.")
    pose_generator = torch.Generator().manual_seed(config.seed + 7919 * position["step"])

    progress = _progress(config.steps, position["step"], accelerator)
    last_loss, eval_loss = float("nan"), None
    while position["step"] < config.steps:
        train_loader.set_epoch(position["epoch"])
        batches = accelerator.skip_first_batches(train_loader, position["batches_in_epoch"])
        for batch in batches:
            position["batches_in_epoch"] += 1
            with accelerator.accumulate(model):
                loss = _loss(model, teacher, batch, objective, config, pose_generator)
                accelerator.backward(loss)
                if accelerator.sync_gradients and config.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(trainable, config.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            position["step"] += 1
            last_loss = accelerator.gather(loss.detach()[None]).mean().item()
            record: dict[str, Any] = {"step": position["step"], "loss": last_loss, "lr": scheduler.get_last_lr()[0]}
            if eval_loader is not None and config.eval_every and position["step"] % config.eval_every == 0:
                eval_loss = record["eval_loss"] = _evaluate(model, eval_loader, objective, accelerator)
            _log(output, record, accelerator)
            progress.update(1)
            progress.set_postfix(loss=f"{last_loss:.4f}", **({"eval": f"{eval_loss:.4f}"} if eval_loss else {}))
            if (config.save_every and position["step"] % config.save_every == 0) or position["step"] == config.steps:
                _save_checkpoint(accelerator, output, position)
            if position["step"] >= config.steps:
                break
        else:
            position["epoch"] += 1
            position["batches_in_epoch"] = 0
    progress.close()
    if eval_loader is not None:
        eval_loss = _evaluate(model, eval_loader, objective, accelerator)
    result_dir = _save_result(accelerator, model, tokenizer, output, config)
    checksum = float(sum(p.detach().double().sum() for p in trainable))  # equal in every process after DDP
    return {
        "train_loss": last_loss,
        "eval_loss": eval_loss,
        "output": str(result_dir),
        "steps": position["step"],
        "parameter_checksum": checksum,
    }


# --- pieces ---------------------------------------------------------------------------------------------------


def _fresh_accelerate_state() -> None:
    """accelerate keeps one global state per process; a second run in the same (non-distributed) process may ask
    for other settings (mixed precision), so start from a clean one. Launched process groups are left alone."""
    from accelerate.state import AcceleratorState

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        AcceleratorState._reset_state(reset_partial_state=True)


def _load_model(config: FinetuneConfig):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    import hf_posswap  # noqa: F401  (registers hf_posswap checkpoints with the Auto classes)

    model_config = AutoConfig.from_pretrained(config.model)
    objective = config.objective
    if objective == "auto":
        base_type = getattr(model_config, "posswap_base_model_type", model_config.model_type)
        objective = "mlm" if base_type == "bert" and not getattr(model_config, "is_decoder", False) else "causal"
    auto = AutoModelForCausalLM if objective == "causal" else AutoModelForMaskedLM
    model = auto.from_pretrained(config.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, objective


def _teacher(model: torch.nn.Module, accelerator) -> torch.nn.Module:
    teacher = copy.deepcopy(model).eval().to(accelerator.device)
    teacher.requires_grad_(False)
    return teacher


def _prepare_positions(model: torch.nn.Module, config: FinetuneConfig) -> None:
    from ..extend import extend_context
    from ..swap import swap, swap_state

    if config.scheme is not None:
        swap(model, config.scheme, replace=swap_state(model) is not None, **config.scheme_options)
    if config.extend_to is not None:
        extend_context(model, config.extend_to, config.extend_method)


def _collator(tokenizer, objective: str, config: FinetuneConfig):
    if objective == "mlm":
        from transformers import DataCollatorForLanguageModeling

        masker = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=config.mlm_probability)
        return lambda examples: masker([{"input_ids": e["input_ids"]} for e in examples])

    def causal(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        input_ids = torch.stack([e["input_ids"] for e in examples])  # [B, seq_len]
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    return causal


def _loss(model, teacher, batch: dict[str, torch.Tensor], objective: str, config: FinetuneConfig, generator):
    inputs = dict(batch)
    if config.pose_target is not None:
        batch_size, seq_len = inputs["input_ids"].shape
        inputs["position_ids"] = pose_position_ids(batch_size, seq_len, config.pose_target, generator).to(
            inputs["input_ids"].device
        )
    encoder_distill = teacher is not None and objective == "mlm"
    outputs = model(**inputs, output_hidden_states=encoder_distill)
    if teacher is None or config.distill_weight == 0:
        return outputs.loss
    with torch.no_grad():
        reference = teacher(**{k: v for k, v in inputs.items() if k != "labels"}, output_hidden_states=encoder_distill)
    if encoder_distill:
        distill = hidden_state_matching(outputs.hidden_states[-1], reference.hidden_states[-1])
    else:
        distill = distillation_kl(outputs.logits, reference.logits, config.distill_temperature)
    return (1 - config.distill_weight) * outputs.loss + config.distill_weight * distill


@torch.no_grad()
def _evaluate(model, loader, objective: str, accelerator) -> float:
    """Mean held-out loss of the plain objective (masked LM masks are drawn by the collator)."""
    was_training = model.training
    model.eval()
    losses = []
    for batch in loader:
        losses.append(accelerator.gather(model(**batch).loss.detach()[None]).mean().item())
    model.train(was_training)
    return float(sum(losses) / len(losses)) if losses else math.nan


def _progress(total: int, initial: int, accelerator):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="finetune", disable=not accelerator.is_local_main_process)


def _log(output: Path, record: dict[str, Any], accelerator) -> None:
    if accelerator.is_main_process:
        with open(output / LOSS_LOG, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def _save_checkpoint(accelerator, output: Path, position: dict[str, int]) -> None:
    staging = staging_dir(output, position["step"])
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        publish_checkpoint(output, position["step"], position)
    accelerator.wait_for_everyone()


def _save_result(accelerator, model, tokenizer, output: Path, config: FinetuneConfig) -> Path:
    """The final model (or adapter, and with ``merge_lora`` the merged model), written atomically."""
    accelerator.wait_for_everyone()
    final = output / ("adapter" if config.lora else "final")
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        staging = final.with_name(f".{final.name}.staging")
        shutil.rmtree(staging, ignore_errors=True)
        if config.lora:
            from ..peft_utils import save_adapter

            save_adapter(unwrapped, staging)
        else:
            unwrapped.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        if config.merge_lora:
            merged_dir = output / "merged"
            staging = output / ".merged.staging"
            shutil.rmtree(staging, ignore_errors=True)
            copy.deepcopy(unwrapped).merge_and_unload().save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            if merged_dir.exists():
                shutil.rmtree(merged_dir)
            staging.rename(merged_dir)
    accelerator.wait_for_everyone()
    return final
