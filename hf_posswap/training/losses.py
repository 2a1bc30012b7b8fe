"""Training objectives: causal LM, masked LM, distillation from the unswapped original, and PoSE position ids; the
batches they read and the held-out loss."""

from __future__ import annotations

import hashlib
import math
import struct

import torch
from torch import nn

from ..errors import InvalidConfigError, UnsupportedFamilyError
from ..families import get_family
from .config import FinetuneConfig


def pose_position_ids(batch_size: int, seq_len: int, target_len: int, generator: torch.Generator,
                      process: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """PoSE (Zhu et al. 2024, arXiv:2309.10400, §3.2 with two chunks): each row is cut at a random point; the second
    chunk's positions skip ahead by u ~ U{0, target_len - seq_len}, so short sequences cover the target length.
    Returns [B, seq_len] position ids whose last value is < target_len.

    ``process`` = (index, count): the rows of the whole global batch are drawn and this process keeps its own, so
    N processes draw what one process reading the global batch draws (not N copies of the same rows)."""
    index, count = process
    rows = []
    for _ in range(batch_size * count):
        cut = int(torch.randint(1, seq_len, (1,), generator=generator))
        skip = int(torch.randint(0, target_len - seq_len + 1, (1,), generator=generator))
        positions = torch.arange(seq_len)
        positions[cut:] += skip
        rows.append(positions)
    return torch.stack(rows)[index * batch_size:(index + 1) * batch_size]  # [B * count, seq_len] -> [B, seq_len]


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


class CausalBatches:
    """Causal-LM batches: the packed rows, labels the inputs (the model shifts them)."""

    def set_epoch(self, epoch: int) -> None:
        """Nothing is drawn: the same for every epoch."""

    def __call__(self, examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        input_ids = torch.stack([e["input_ids"] for e in examples])  # [B, seq_len]
        return {"input_ids": input_ids, "labels": input_ids.clone()}


class MaskedLMBatches:
    """Masked-LM batches by BERT's rule (Devlin et al. 2019, arXiv:1810.04805, §3.1: ``probability`` of the tokens
    chosen, special tokens never; of those 80 % become [MASK], 10 % a random token, 10 % stay), each row's draws
    seeded by the run's seed, the epoch and the row's own tokens alone. So a row gets the same masks in whichever
    process, batch or resumed run reads it (masks drawn from the global generator differ between one process and
    several, and a resumed run redraws the batch read ahead before its checkpoint with a later state). The held-out
    batches keep one epoch, so every evaluation scores the same masks."""

    def __init__(self, tokenizer, probability: float, seed: int, epoch: int = 0) -> None:
        if tokenizer.mask_token_id is None:
            raise InvalidConfigError(
                f"The tokenizer ({type(tokenizer).__name__}) has no mask token, which masked-LM training puts where "
                "the tokens to predict were; use the model's own tokenizer (with its [MASK]), or --objective causal "
                "for a decoder."
            )
        self.tokenizer, self.probability, self.seed, self.epoch = tokenizer, probability, seed, epoch
        self.special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        rows = [self._masked_row(e["input_ids"]) for e in examples]
        return {"input_ids": torch.stack([r[0] for r in rows]), "labels": torch.stack([r[1] for r in rows])}

    def _masked_row(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of one row [seq_len]: labels -100 where nothing is predicted. A row whose draw chose no
        token gets one, drawn from its own generator (a batch with none would have a 0/0 loss; choosing per row
        keeps a row's masks independent of the rows it is batched with)."""
        generator = torch.Generator().manual_seed(self._row_seed(row))
        maskable = ~torch.isin(row, self.special_ids)
        chosen = (torch.rand(row.shape, generator=generator) < self.probability) & maskable
        candidates = maskable.nonzero().flatten()
        if not bool(chosen.any()) and candidates.numel():
            chosen[candidates[torch.randint(candidates.numel(), (1,), generator=generator)]] = True
        replace = torch.rand(row.shape, generator=generator)  # < 0.8: [MASK]; 0.8-0.9: random token; else kept
        random_ids = torch.randint(len(self.tokenizer), row.shape, generator=generator, dtype=torch.long)
        inputs = torch.where(chosen & (replace < 0.8), self.tokenizer.mask_token_id, row)
        inputs = torch.where(chosen & (replace >= 0.8) & (replace < 0.9), random_ids, inputs)
        return inputs, torch.where(chosen, row, -100)

    def _row_seed(self, row: torch.Tensor) -> int:
        """63 bits of a hash of (seed, epoch, the row's token ids): the same on every machine and Python."""
        digest = hashlib.blake2b(digest_size=8)
        digest.update(struct.pack("<qq", self.seed, self.epoch))
        digest.update(row.to(torch.int64).numpy().tobytes())
        return int.from_bytes(digest.digest(), "little") >> 1


def collator(tokenizer, objective: str, config: FinetuneConfig, held_out: bool = False):
    """The batches of one objective; ``held_out``: the masks of the held-out set, fixed for the whole run."""
    if objective == "mlm":
        return MaskedLMBatches(tokenizer, config.mlm_probability, config.seed, epoch=-1 if held_out else 0)
    return CausalBatches()


def _first_position_id(model: nn.Module) -> int:
    """The id the model's family numbers a sequence's first token with (RoBERTa: padding_idx + 1; 0 elsewhere):
    PoSE's ids count from 0 and are shifted to it, so RoBERTa's table reads its own rows."""
    inner = getattr(model, "module", model)  # DistributedDataParallel, DeepSpeed's engine
    try:
        return get_family(inner).first_position_id(inner)
    except UnsupportedFamilyError:
        return 0


def batch_loss(model, teacher, batch: dict[str, torch.Tensor], objective: str, config: FinetuneConfig,
               generator: torch.Generator, process: tuple[int, int] = (0, 1),
               global_masked: int | None = None) -> torch.Tensor:
    """The training loss of one batch: the objective's own loss (with PoSE position ids when asked, this process's
    rows of the global batch's draw: ``process`` = (index, count)), blended with distillation from ``teacher`` by
    ``distill_weight``.

    Masked LM with ``global_masked`` (the masked tokens of the global batch, all processes together): this process's
    summed loss / ``global_masked`` x processes, so that the processes' mean (of the losses logged and of the
    gradients, as data parallelism averages them) is the mean over the global batch's masked tokens, as in one
    process. Each process's own mean would weigh a process with fewer masked tokens more."""
    inputs = dict(batch)
    if config.pose_target is not None:
        batch_size, seq_len = inputs["input_ids"].shape
        inputs["position_ids"] = pose_position_ids(batch_size, seq_len, config.pose_target, generator, process).to(
            inputs["input_ids"].device
        ) + _first_position_id(model)
        # Without an attention mask transformers reads position ids that jump as several sequences packed into one
        # row (masking_utils.find_packed_sequence_indices) and masks attention across each jump; a PoSE row is one
        # sequence whose positions skip ahead, so it gets an explicit all-ones mask.
        inputs.setdefault("attention_mask", torch.ones_like(inputs["input_ids"]))
    encoder_distill = teacher is not None and objective == "mlm"
    inputs.update(no_cache(objective))  # training builds no KV cache (and gradient checkpointing needs none)
    own_loss = objective == "mlm" and global_masked is not None  # the model's own loss would be computed unused
    outputs = model(**{k: v for k, v in inputs.items() if not (own_loss and k == "labels")},
                    output_hidden_states=encoder_distill)
    if own_loss:
        summed, _ = token_losses(outputs.logits, inputs["labels"], objective)  # [B]
        own = summed.sum() * process[1] / max(global_masked, 1)
    else:
        own = outputs.loss
    if teacher is None or config.distill_weight == 0:
        return own
    with torch.no_grad():
        reference = teacher(**{k: v for k, v in inputs.items() if k != "labels"}, output_hidden_states=encoder_distill)
    if encoder_distill:
        distill = hidden_state_matching(outputs.hidden_states[-1], reference.hidden_states[-1])
    else:
        distill = distillation_kl(outputs.logits, reference.logits, config.distill_temperature)
    return (1 - config.distill_weight) * own + config.distill_weight * distill


def no_cache(objective: str) -> dict[str, bool]:
    """``use_cache=False`` for decoders (encoders have no cache to turn off)."""
    return {"use_cache": False} if objective == "causal" else {}


def token_losses(logits: torch.Tensor, labels: torch.Tensor, objective: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed negative log-likelihood of its scored tokens and how many there are ([B] each), as the
    model's own loss scores them (causal LM: token t predicts label t + 1; -100 scores nothing)."""
    if objective == "causal":
        logits, labels = logits[:, :-1], labels[:, 1:]  # [B, L - 1, V], [B, L - 1]
    nll = nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return nll.sum(-1), (labels != -100).sum(-1)  # [B, L'] summed over tokens -> [B]


@torch.no_grad()
def held_out_loss(model, loader, objective: str, accelerator) -> float:
    """Mean loss per scored token of the plain objective over the held-out set, each sequence counted once: the rows
    accelerate repeats to give every process a full last batch are dropped (``gather_for_metrics``), so one process
    and several give the same number."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in loader:
            inputs = {name: value for name, value in batch.items() if name != "labels"}
            logits = model(**inputs, **no_cache(objective)).logits
            sums, counts = accelerator.gather_for_metrics(token_losses(logits, batch["labels"], objective))
            total, count = total + float(sums.double().sum()), count + int(counts.sum())
    finally:
        model.train(was_training)
    return total / count if count else math.nan
