"""Fine-tuning swapped models with accelerate (and peft for LoRA); sharded (FSDP2) training pieces in
:mod:`.sharding` (``shard_model``, ``save_full_model``) and :mod:`.sharded_checkpoint`.

``FinetuneConfig`` and the command line (``config``) need no torch; ``finetune`` (the loop, with torch and
accelerate) is imported on first use, so ``hf-posswap finetune --help`` answers at once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import FinetuneConfig

if TYPE_CHECKING:
    from .loop import finetune

__all__ = ["FinetuneConfig", "finetune"]


def __getattr__(name: str) -> Any:
    if name == "finetune":
        from .loop import finetune

        return finetune
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
