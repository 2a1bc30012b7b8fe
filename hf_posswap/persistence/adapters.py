"""LoRA through peft with the swapped position parameters trained and saved alongside the adapter.

``trainable_position_modules(model)`` names the modules holding position parameters (ALiBi slopes, T5 tables,
learned tables) for peft's ``modules_to_save``. Adapters are saved with a ``posswap_adapter.json`` record; loading
one onto a base that was not swapped the same way is refused instead of silently dropping position weights
(which plain ``PeftModel.from_pretrained`` would do).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from ..core.native import unwrap_peft
from ..core.state import swap_state
from ..errors import InvalidConfigError
from ..families.base import get_family
from .quiet import quiet_peft
from .user_files import read_json

ADAPTER_RECORD = "posswap_adapter.json"
#: the model card peft writes beside an adapter
MODEL_CARD = "README.md"
POSITION_MODULE_NAMES = ("wpe", "position_embeddings", "posswap_positions")


def trainable_position_modules(model: nn.Module) -> list[str]:
    """Attribute names of the modules that hold the swap's trainable position parameters (for ``modules_to_save``)."""
    state = swap_state(_unwrap(model))
    if state is None:
        return []
    names = []
    for name, _, trainable in state.new_parameters:
        if trainable:
            parts = name.split(".")
            # the attribute holding the position module: wpe, position_embeddings or posswap_positions
            module = next((p for p in parts if p in POSITION_MODULE_NAMES), None)
            if module and module not in names:
                names.append(module)
    return names


def lora_config(model: nn.Module, r: int = 8, alpha: int = 16, dropout: float = 0.0, **extra: Any):
    """A peft ``LoraConfig`` for the model's family: attention projections as targets, position modules saved."""
    from peft import LoraConfig, TaskType

    adapter = get_family(_unwrap(model))
    causal = adapter.is_causal(_unwrap(model).config)  # BERT and RoBERTa are encoders unless is_decoder
    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(adapter.lora_target_modules),
        modules_to_save=trainable_position_modules(model) or None,
        task_type=TaskType.CAUSAL_LM if causal else None,
        fan_in_fan_out=adapter.name == "gpt2",  # GPT-2's Conv1D stores weights transposed
        **extra,
    )


def save_adapter(peft_model: nn.Module, directory: str | os.PathLike[str],
                 state_dict: dict[str, Any] | None = None, overwrite: bool = False) -> None:
    """``peft_model.save_pretrained`` plus the swap record the adapter was trained with, written atomically.

    ``state_dict``: the whole model's state gathered beforehand (the parameters of a model sharded by FSDP or
    DeepSpeed ZeRO-3 hold only this process's shards). A non-empty ``directory`` is refused unless ``overwrite``
    (then the adapter's files are replaced and every other file stays, a README.md of yours included); a full
    checkpoint directory is always refused."""
    from .saving import check_finite_weights, check_output_dir, staged_directory

    check_output_dir(directory, overwrite, flag="directory", kind="adapter")
    check_finite_weights(peft_model if state_dict is None else state_dict, "the adapter's model")
    state = swap_state(_unwrap(peft_model))
    record = {"scheme": state.config.to_dict() if state else None, "extension": state.extension if state else None}
    with staged_directory(directory, overwrite, kind="adapter") as staging:
        with quiet_peft():
            peft_model.save_pretrained(staging, **({} if state_dict is None else {"state_dict": state_dict}))
        (staging / ADAPTER_RECORD).write_text(json.dumps(record, indent=2), encoding="utf-8")
        if (Path(directory) / MODEL_CARD).exists():  # peft writes a model card; the user's own one stays
            (staging / MODEL_CARD).unlink(missing_ok=True)


def load_adapter(base_model: nn.Module, directory: str | os.PathLike[str], **kwargs: Any):
    """``PeftModel.from_pretrained`` that first checks the base carries the swap the adapter was trained with."""
    from peft import PeftModel

    directory = Path(directory)
    record_path = directory / ADAPTER_RECORD
    if record_path.exists():
        record = read_json(record_path, flag="load_adapter")  # one error naming the file, whatever is wrong with it
        state = swap_state(base_model)
        base_scheme = state.config.to_dict() if state else None
        if record.get("scheme") != base_scheme:
            wanted = record.get("scheme") or "no swap"
            has = base_scheme or "no swap"
            raise InvalidConfigError(
                f"The adapter in {directory} was trained on a model swapped to {wanted}, but this base carries "
                f"{has}. Loading it would drop or misplace its position weights. Swap the base first: "
                f"hf_posswap.swap(base, hf_posswap.schemes.scheme_config_from_dict({wanted!r}))."
            )
    with quiet_peft():
        return PeftModel.from_pretrained(base_model, directory, **kwargs)


_unwrap = unwrap_peft
