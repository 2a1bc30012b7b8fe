"""The model a fine-tuning run trains: loaded from ``--model``, swapped or extended as asked, with gradient
checkpointing and LoRA. Library messages that would mislead are replaced by one line saying what happened."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidConfigError
from ..persistence.quiet import hidden_logs, quiet_peft, release
from .config import FinetuneConfig
from .resume import say

#: transformers' messages about a head that the checkpoint does not hold (shown as one line of ours instead)
NEW_HEAD_NOTES = (r"This checkpoint seem corrupted", r"LOAD REPORT")


def load_model(config: FinetuneConfig, objective: str, accelerator=None):
    """(model, tokenizer) of ``config.model`` with the head of ``objective`` (``causal`` or ``mlm``)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    from ..persistence.autoload import register

    register()  # hf_posswap checkpoints load through transformers' Auto classes
    auto = AutoModelForCausalLM if objective == "causal" else AutoModelForMaskedLM
    # a local path is loaded by its absolute form: a LoRA adapter records it as its base, and a relative one would
    # load only from this working directory (or load whatever has that name elsewhere)
    local = Path(config.model).expanduser()
    source = str(local.resolve()) if local.exists() else config.model
    try:
        with hidden_logs("transformers.modeling_utils", *NEW_HEAD_NOTES) as notes:
            model, info = auto.from_pretrained(source, dtype=torch.float32, output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, RuntimeError) as error:  # a truncated or foreign checkpoint: one line naming it
        raise InvalidConfigError(
            f"--model {config.model!r} cannot be loaded ({type(error).__name__}: {' '.join(str(error).split())[:300]});"
            " pass a complete checkpoint directory."
        ) from error
    _explain_loading(model, info, notes, config.model, objective, accelerator)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def new_head(model: torch.nn.Module, info: dict[str, Any]) -> list[str] | None:
    """The head modules a load initialised because the checkpoint has none (a ``BertModel`` checkpoint loaded for
    masked-LM training lacks ``cls.predictions``); ``None`` when anything else is missing or left over (then
    transformers' own report is the right message)."""
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    missing = sorted(info.get("missing_keys") or ())
    unused = sorted(info.get("unexpected_keys") or ())
    if not missing or any(key.startswith(prefix) for key in missing) or info.get("mismatched_keys"):
        return None
    if any(not key.removeprefix(prefix).startswith("pooler.") for key in unused):
        return None  # only a sentence-embedding pooler may be left over
    return sorted({".".join(key.split(".")[:2]) for key in missing})


def _explain_loading(model, info: dict[str, Any], notes: list[logging.LogRecord], path: str, objective: str,
                     accelerator) -> None:
    """One line for a new head instead of transformers' "This checkpoint seem corrupted" and its load report;
    any other report is let through unchanged."""
    head = new_head(model, info)
    if head is None:
        release(notes)
        return
    saved_as = ", ".join(getattr(model.config, "architectures", None) or ["a model without it"])
    task = "masked-LM" if objective == "mlm" else "language-model"
    pooler = " Its pooler (for sentence embeddings) is not used by the masked-LM model." if info.get(
        "unexpected_keys") else ""
    say(f"note: --model {path!r} was saved as {saved_as}, without a {task} head: a new head ({', '.join(head)}) "
        f"is initialised and trained with the rest.{pooler}", accelerator)


def teacher_copy(model: torch.nn.Module, accelerator) -> torch.nn.Module:
    """A frozen copy of the model before the swap (the distillation teacher)."""
    teacher = copy.deepcopy(model).eval().to(accelerator.device)
    teacher.requires_grad_(False)
    return teacher


def prepare_positions(model: torch.nn.Module, config: FinetuneConfig) -> None:
    """Swap and extend as ``config`` asks."""
    from ..core.extend import extend_context
    from ..core.state import swap_state
    from ..core.swap import swap

    if config.scheme is not None:
        swap(model, config.scheme, replace=swap_state(model) is not None, **config.scheme_options)
    if config.extend_to is not None:
        extend_context(model, config.extend_to, config.extend_method, **config.extend_options)


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Activation (gradient) checkpointing, non-reentrant, by transformers 5.x's name where it has it."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def with_lora(model: torch.nn.Module, config: FinetuneConfig) -> torch.nn.Module:
    """The model wrapped by peft: LoRA on the attention projections, the position modules trained in full."""
    from peft import get_peft_model

    from ..persistence.adapters import lora_config

    with quiet_peft():
        return get_peft_model(model, lora_config(model, config.lora_r, config.lora_alpha, config.lora_dropout))
