"""The inputs the test_call_paths_*.py files share: random token ids, and a batch of two rows of 20 tokens whose
second row is left-padded (its first 6 tokens masked)."""

from __future__ import annotations

import torch
from conftest import VOCAB


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def padded_inputs() -> dict[str, torch.Tensor]:
    input_ids = tokens(2, 20)
    mask = torch.ones_like(input_ids)
    mask[1, :6] = 0
    return {"input_ids": input_ids, "attention_mask": mask}


def hidden(output) -> torch.Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output.logits
