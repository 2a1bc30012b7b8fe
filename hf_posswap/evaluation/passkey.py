"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", §4.2): a 5-digit key hidden at a chosen depth
in filler text; the model must repeat it. Fully seeded."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeyResult:
    length: int
    depth: float
    accuracy: float
    trials: int


def passkey_prompt(tokenizer, length: int, depth: float, key: str) -> torch.Tensor:
    """Token ids of about ``length`` tokens: filler, the needle at ``depth`` (0 = start, 1 = end), the question."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = len(tokenizer(needle + QUESTION, add_special_tokens=False)["input_ids"])
    filler_ids = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    budget = max(length - fixed, 0)
    repeats = budget // max(len(filler_ids), 1) + 1
    filler = tokenizer(FILLER * repeats, add_special_tokens=False)["input_ids"][:budget]
    cut = int(round(depth * len(filler)))
    ids = filler[:cut] + tokenizer(needle, add_special_tokens=False)["input_ids"] + filler[cut:]
    ids += tokenizer(" " + QUESTION if ids else QUESTION, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids)


@torch.no_grad()
def passkey_accuracy(
    model: nn.Module, tokenizer, length: int, depth: float, trials: int = 5, seed: int = 0
) -> PasskeyResult:
    """Share of trials whose greedy continuation starts with the key (keys drawn from ``seed``)."""
    rng = random.Random(seed * 1_000_003 + length * 101 + int(depth * 1000))
    correct = 0
    device = next(model.parameters()).device
    for _ in range(trials):
        key = f"{rng.randrange(10_000, 100_000)}"
        prompt = passkey_prompt(tokenizer, length, depth, key).to(device)
        answer = _greedy(model, prompt, len(tokenizer(" " + key, add_special_tokens=False)["input_ids"]) + 1)
        correct += tokenizer.decode(answer).strip().startswith(key)
    return PasskeyResult(length, depth, correct / trials, trials)


def _greedy(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy decoding by full recompute (works for any model returning ``.logits``)."""
    ids = prompt[None]
    out: list[int] = []
    for _ in range(new_tokens):
        next_id = int(model(input_ids=ids).logits[0, -1].argmax())
        out.append(next_id)
        ids = torch.cat([ids, ids.new_tensor([[next_id]])], dim=1)
    return out
