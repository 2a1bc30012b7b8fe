"""Training objectives: causal LM, masked LM, distillation from the unswapped original, and PoSE position ids; the
batches they read and the held-out loss."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import FinetuneConfig


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


def collator(tokenizer, objective: str, config: FinetuneConfig):
    """Batches of packed sequences: causal LM labels are the inputs; masked LM draws its masks here."""
    if objective == "mlm":
        from transformers import DataCollatorForLanguageModeling

        masker = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=config.mlm_probability)
        return lambda examples: at_least_one_mask(masker([{"input_ids": e["input_ids"]} for e in examples]),
                                                   tokenizer)

    def causal(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        input_ids = torch.stack([e["input_ids"] for e in examples])  # [B, seq_len]
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    return causal


def at_least_one_mask(batch: dict[str, torch.Tensor], tokenizer) -> dict[str, torch.Tensor]:
    """A masked-LM batch with no masked token has a 0/0 (NaN) loss: mask its first token then."""
    labels = batch["labels"]  # [B, seq_len], -100 where not masked
    if bool((labels != -100).any()):
        return batch
    labels[0, 0] = batch["input_ids"][0, 0]
    batch["input_ids"][0, 0] = tokenizer.mask_token_id
    return batch


def batch_loss(model, teacher, batch: dict[str, torch.Tensor], objective: str, config: FinetuneConfig,
               generator: torch.Generator) -> torch.Tensor:
    """The training loss of one batch: the objective's own loss (with PoSE position ids when asked), blended with
    distillation from ``teacher`` by ``distill_weight``."""
    inputs = dict(batch)
    if config.pose_target is not None:
        batch_size, seq_len = inputs["input_ids"].shape
        inputs["position_ids"] = pose_position_ids(batch_size, seq_len, config.pose_target, generator).to(
            inputs["input_ids"].device
        )
        # Without an attention mask transformers reads position ids that jump as several sequences packed into one
        # row (masking_utils.find_packed_sequence_indices) and masks attention across each jump; a PoSE row is one
        # sequence whose positions skip ahead, so it gets an explicit all-ones mask.
        inputs.setdefault("attention_mask", torch.ones_like(inputs["input_ids"]))
    encoder_distill = teacher is not None and objective == "mlm"
    inputs.update(no_cache(objective))  # training builds no KV cache (and gradient checkpointing needs none)
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


def no_cache(objective: str) -> dict[str, bool]:
    """``use_cache=False`` for decoders (encoders have no cache to turn off)."""
    return {"use_cache": False} if objective == "causal" else {}


@torch.no_grad()
def held_out_loss(model, loader, objective: str, accelerator) -> float:
    """Mean held-out loss of the plain objective (masked LM masks are drawn by the collator)."""
    was_training = model.training
    model.eval()
    losses = []
    for batch in loader:
        losses.append(accelerator.gather(model(**batch, **no_cache(objective)).loss.detach()[None]).mean().item())
    model.train(was_training)
    return float(sum(losses) / len(losses)) if losses else math.nan
