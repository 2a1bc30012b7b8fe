"""Fine-tuning swapped models with accelerate (and peft for LoRA)."""

from .config import FinetuneConfig
from .loop import finetune

__all__ = ["FinetuneConfig", "finetune"]
