"""Training objectives: causal LM, masked LM, distillation from the unswapped original, and PoSE position ids."""

from __future__ import annotations

import torch
from torch import nn


def pose_position_ids(batch_size: int, seq_len: int, target_len: int, generator: torch.Generator) -> torch.Tensor:
    """PoSE (Zhu et al. 2024, arXiv:2309.10400, §3.2 with two chunks): each row is cut at a random point; the second
    chunk's positions skip ahead by u ~ U{0, target_len - seq_len}, so short sequences cover the target length.
    Returns [B, seq_len] position ids whose last value is < target_len."""
    rows = []
    for _ in range(batch_size):
        cut = int(torch.randint(1, seq_len, (1,), generator=generator))
        skip = int(torch.randint(0, target_len - seq_len + 1, (1,), generator=generator))
        positions = torch.arange(seq_len)
        positions[cut:] += skip
        rows.append(positions)
    return torch.stack(rows)


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) per token on temperature-softened distributions, scaled by T^2 (Hinton et al. 2015).
    logits [B, L, V] -> scalar."""
    student = nn.functional.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = nn.functional.log_softmax(teacher_logits.float() / temperature, dim=-1)
    per_token = nn.functional.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)  # [B, L]
    return per_token.mean() * temperature**2


def hidden_state_matching(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
    """Mean squared error between final hidden states [B, L, hidden] (encoders, e.g. sentence-embedding BERTs)."""
    return nn.functional.mse_loss(student_hidden.float(), teacher_hidden.float())
