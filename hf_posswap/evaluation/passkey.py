"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", §4.2): a 5-digit key hidden at a chosen depth
in filler text; the model must repeat it. Fully seeded. A prompt has the requested number of tokens as the model
sees them: ``tokenizer(prompt)``, special tokens included, as LongLoRA and Landmark Attention build theirs."""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InvalidConfigError, PosSwapError
from ..progress import Progress
from .inputs import eval_mode

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeyResult:
    length: int
    depth: float
    accuracy: float
    trials: int


def passkey_prompt(tokenizer, length: int, depth: float, key: str, filler: str = FILLER) -> torch.Tensor:
    """Token ids of exactly ``length`` tokens, as ``tokenizer(prompt)`` gives them (its special tokens, e.g. a BOS,
    included and counted): filler, the needle at ``depth`` (0 = start, 1 = end) of the filler, then the question.

    The pieces are joined as text with one space between them and the whole text is tokenized, so the count is the
    one the model sees (a BPE tokenizer merges across the joins); the number of filler tokens is adjusted until it
    fits. Where no amount of filler gives exactly ``length`` (a merge across a join can make one more filler token
    add two), the prompt is the longest one below it, at most ``LENGTH_TOLERANCE`` tokens short.

    ``filler`` replaces the default filler text; byte-level models find the key more easily when the filler shares
    no long substring with the needle (the default's "sky is" ends like "key is")."""
    _check_passkey(length, depth)
    if not isinstance(filler, str) or not filler.strip():
        raise InvalidConfigError(f"The passkey filler must be a non-empty text, got {filler!r}; pass sentences to "
                                 "repeat around the key (or leave the default).")
    check_passkey_fits(tokenizer, length, [key])
    shortest = shortest_passkey_length(tokenizer, [key])
    stream = _filler_ids(tokenizer, filler, length - shortest + FILLER_SLACK)
    return torch.tensor(_fitted(tokenizer, stream, _needle(key), length, depth, length - shortest))


#: the most tokens a passkey prompt may fall short of its length (see ``passkey_prompt``): a tokenizer with whitespace
#: tokens of its own (byte-level) can miss a length by one with the needle first or last; BPE tokenizers hit it exactly
LENGTH_TOLERANCE = 1
#: the most filler tokens the needle may move from its depth to reach the length exactly (a word of byte tokens)
MAX_SHIFT = 8
#: filler tokens beyond the first estimate, for the merges across the joins to take
FILLER_SLACK = 32


def too_short_message(length: int, shortest: int) -> str:
    """The refusal of a passkey length that cannot hold the needle and the question."""
    return (f"Passkey length {length} is shorter than the needle and the question alone ({shortest} tokens); use "
            f"passkey lengths >= {shortest}.")


def _join(head: str, needle: str, tail: str) -> str:
    """The prompt text: filler before the needle, the needle, filler after it, the question; one space between."""
    return " ".join(part.strip() for part in (head, needle, tail, QUESTION) if part.strip())


def _filler_ids(tokenizer, filler: str, needed: int) -> list[int]:
    """At least ``needed`` ids of ``filler`` repeated (repeats merge across their joins: count them joined)."""
    repeats = needed // max(len(tokenizer(filler, add_special_tokens=False)["input_ids"]), 1) + 2
    while len(ids := tokenizer(filler * repeats, add_special_tokens=False)["input_ids"]) < needed:
        repeats *= 2
    return ids


def _fitted(tokenizer, stream: list[int], needle: str, length: int, depth: float, amount: int) -> list[int]:
    """The prompt ids with the amount of filler that gives ``length`` tokens (or the longest below it): from
    ``amount`` filler tokens, move the amount by the difference until it fits; then try the amounts around it with
    the needle up to ``MAX_SHIFT`` filler tokens either side of its depth (where it is neither first nor last), since
    a merge or a stripped space at one join can make the count skip a value that a cut elsewhere reaches."""
    tried: dict[tuple[int, int], list[int]] = {}
    decode = functools.partial(tokenizer.decode, clean_up_tokenization_spaces=False)

    def prompt(used: int, shift: int = 0) -> list[int]:
        cut = min(max(int(round(depth * used)) + shift, 0), used)
        if (used, cut) not in tried:
            tried[used, cut] = tokenizer(_join(decode(stream[:cut]), needle, decode(stream[cut:used])))["input_ids"]
        return tried[used, cut]

    for _ in range(8):
        difference = length - len(prompt(amount))
        if difference == 0:
            return prompt(amount)
        amount = min(max(amount + difference, 0), len(stream))
    shifts = sorted(range(-MAX_SHIFT, MAX_SHIFT + 1), key=abs) if 0.0 < depth < 1.0 else [0]
    for used in sorted(range(max(amount - 3, 0), min(amount + 4, len(stream) + 1)), key=lambda n: abs(n - amount)):
        for shift in shifts:
            if len(prompt(used, shift)) == length:
                return prompt(used, shift)
    fitting = [ids for ids in tried.values() if length - LENGTH_TOLERANCE <= len(ids) <= length]
    if not fitting:
        raise PosSwapError(f"No passkey prompt of {length} tokens could be built with this tokenizer (the nearest "
                           f"had {sorted({len(ids) for ids in tried.values()})} tokens); use another passkey length.")
    return max(fitting, key=len)


def _needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def passkey_keys(length: int, depth: float, trials: int, seed: int = 0) -> list[str]:
    """The 5-digit keys of ``trials`` passkey prompts at ``length`` and ``depth``, drawn from ``seed``."""
    rng = random.Random(seed * 1_000_003 + length * 101 + int(depth * 1000))
    return [f"{rng.randrange(10_000, 100_000)}" for _ in range(trials)]


def shortest_passkey_length(tokenizer, keys: Sequence[str] = ("12345",)) -> int:
    """Tokens taken by the needle and the question alone (special tokens included), the most over ``keys``: a
    passkey length below this cannot be built."""
    return max(len(tokenizer(_join("", _needle(key), ""))["input_ids"]) for key in keys)


def check_passkey_fits(tokenizer, length: int, keys: Sequence[str]) -> None:
    """Refuse ``length`` when the prompt of one of ``keys`` cannot hold the needle and the question."""
    shortest = shortest_passkey_length(tokenizer, keys)
    if length < shortest:
        raise InvalidConfigError(too_short_message(length, shortest))


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
    """Share of trials whose greedy continuation starts with the key (keys drawn from ``seed``), in eval mode (the
    model's own train/eval mode is given back afterwards). A length too short for the needle and the question is
    refused before any forward pass.

    ``progress``: ``True`` reports the trials on stderr; a :class:`Progress` (``evaluate`` passes one for all depths
    of a length) is moved on by one step per trial."""
    _check_passkey(length, depth, trials)
    keys = passkey_keys(length, depth, trials, seed)
    check_passkey_fits(tokenizer, length, keys)  # every trial's prompt can be built: refused before any forward
    correct = 0
    device = next(model.parameters()).device
    with eval_mode(model), _trial_progress(progress, length, depth, trials) as bar, bar.watch(model):
        for key in keys:
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
