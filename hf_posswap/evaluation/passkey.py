"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", §4.2): a 5-digit key hidden at a chosen depth
in filler text; the model must repeat it. Fully seeded."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InvalidConfigError
from ..progress import Progress

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeyResult:
    length: int
    depth: float
    accuracy: float
    trials: int


def passkey_prompt(tokenizer, length: int, depth: float, key: str, filler: str = FILLER) -> torch.Tensor:
    """Token ids of about ``length`` tokens: filler, the needle at ``depth`` (0 = start, 1 = end), the question.

    ``filler`` replaces the default filler text; byte-level models find the key more easily when the filler shares
    no long substring with the needle (the default's "sky is" ends like "key is")."""
    _check_passkey(length, depth)
    needle = _needle(key)
    fixed = len(tokenizer(needle + QUESTION, add_special_tokens=False)["input_ids"])
    filler_ids = tokenizer(filler, add_special_tokens=False)["input_ids"]
    budget = max(length - fixed, 0)
    repeats = budget // max(len(filler_ids), 1) + 1
    filler_ids = tokenizer(filler * repeats, add_special_tokens=False)["input_ids"][:budget]
    cut = int(round(depth * len(filler_ids)))
    ids = filler_ids[:cut] + tokenizer(needle, add_special_tokens=False)["input_ids"] + filler_ids[cut:]
    ids += tokenizer(" " + QUESTION if ids else QUESTION, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids)


def _needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def shortest_passkey_length(tokenizer) -> int:
    """Tokens taken by the needle and the question alone: a passkey length below this cannot be built."""
    return len(tokenizer(_needle("12345") + QUESTION, add_special_tokens=False)["input_ids"])


def _check_passkey(length: int, depth: float, trials: int = 1) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise InvalidConfigError(f"A passkey length must be a positive number of tokens, got {length!r}.")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise InvalidConfigError(f"A passkey depth must be in [0, 1] (0 = start, 1 = end), got {depth!r}.")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise InvalidConfigError(f"Passkey trials must be an integer >= 1, got {trials!r}.")


@torch.no_grad()
def passkey_accuracy(
    model: nn.Module,
    tokenizer,
    length: int,
    depth: float,
    trials: int = 5,
    seed: int = 0,
    filler: str = FILLER,
    progress: bool | Progress = False,
) -> PasskeyResult:
    """Share of trials whose greedy continuation starts with the key (keys drawn from ``seed``).

    ``progress``: ``True`` reports the trials on stderr; a :class:`Progress` (``evaluate`` passes one for all depths
    of a length) is moved on by one step per trial."""
    _check_passkey(length, depth, trials)
    rng = random.Random(seed * 1_000_003 + length * 101 + int(depth * 1000))
    correct = 0
    device = next(model.parameters()).device
    with _trial_progress(progress, length, depth, trials) as bar, bar.watch(model):
        for _ in range(trials):
            key = f"{rng.randrange(10_000, 100_000)}"
            prompt = passkey_prompt(tokenizer, length, depth, key, filler).to(device)
            correct += _greedy_finds_key(model, tokenizer, prompt, key)
            bar.step(f"depth {depth:.0%}")
    return PasskeyResult(length, depth, correct / trials, trials)


@contextlib.contextmanager
def _trial_progress(progress: bool | Progress, length: int, depth: float, trials: int) -> Iterator[Progress]:
    """The caller's ``Progress`` (left open: it spans more than this call), or a new one for these trials."""
    if isinstance(progress, Progress):
        yield progress
        return
    with Progress(f"passkey at {length} tokens, depth {depth:.0%}", trials, unit="trial",
                  enabled=bool(progress)) as bar:
        yield bar


def _greedy_finds_key(model: nn.Module, tokenizer, prompt: torch.Tensor, key: str) -> bool:
    """Whether greedy decoding after ``prompt`` starts with ``key`` (after stripping whitespace), mostly in one
    forward pass: feed prompt + " key" and compare each argmax with the answer token. All equal: greedy produces
    the answer. First difference at token j: greedy has produced answer[:j] + argmax_j; if that text can no longer
    start with the key, greedy fails; only when it still can (another split of the same characters, other
    whitespace) is the answer decided by decoding greedily. Equal to plain greedy decoding up to float rounding,
    except for scalings whose frequencies depend on the input length (dynamic NTK, LongRoPE), which here see the
    length of prompt + answer."""
    answer = tokenizer(" " + key, add_special_tokens=False)["input_ids"]
    ids = torch.cat([prompt, prompt.new_tensor(answer)])
    logits = model(input_ids=ids[None]).logits[0, prompt.numel() - 1 : -1]  # [answer tokens, vocab]
    predicted = logits.argmax(-1).tolist()
    mismatch = next((j for j, (p, a) in enumerate(zip(predicted, answer, strict=True)) if p != a), None)
    if mismatch is None:
        return True
    produced = tokenizer.decode(answer[:mismatch] + [predicted[mismatch]]).strip()
    if not (key.startswith(produced) or produced.startswith(key)):
        return False
    return tokenizer.decode(_greedy(model, prompt, len(answer) + 1)).strip().startswith(key)


def _greedy(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy decoding by full recompute (works for any model returning ``.logits``)."""
    ids = prompt[None]
    out: list[int] = []
    for _ in range(new_tokens):
        next_id = int(model(input_ids=ids).logits[0, -1].argmax())
        out.append(next_id)
        ids = torch.cat([ids, ids.new_tensor([[next_id]])], dim=1)
    return out
