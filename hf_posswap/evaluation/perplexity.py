"""Perplexity against length: non-overlapping windows, a sliding window with a stride, and tail-only NLL."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InvalidConfigError
from ..progress import Progress
from .inputs import eval_mode, token_stream

MODES = ("windows", "sliding", "tail")


@dataclass
class PerplexityResult:
    length: int
    mode: str
    perplexity: float
    nll: float
    tokens: int
    windows: int
    tail_from: int | None = None  # tail mode: the first scored position


@torch.no_grad()
def window_nll(model: nn.Module, window: torch.Tensor, first_scored: int) -> tuple[float, int]:
    """Sum of next-token NLL over the targets at positions >= ``first_scored`` (1-based target positions in the
    window: target i is predicted from tokens < i). window [L] -> (sum NLL, count)."""
    return window_nlls(model, window, (first_scored,))[0]


@torch.no_grad()
def window_nlls(model: nn.Module, window: torch.Tensor, first_scored: Sequence[int]) -> list[tuple[float, int]]:
    """``window_nll`` for several first scored positions from one forward pass (e.g. the whole window and only the
    positions past the trained length): window [L] -> [(sum NLL, count) per entry of ``first_scored``]."""
    logits = model(input_ids=window[None]).logits[0, :-1]  # [L-1, vocab]
    targets = window[1:]
    return [_nll_sum(logits, targets, max(first - 1, 0)) for first in first_scored]


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor, start: int, chunk: int = 4096) -> tuple[float, int]:
    """(sum of NLL, count) of ``targets[start:]``, a chunk of rows at a time: a float32 log-softmax of 12k tokens
    over a 49k vocabulary would take another 2.4 GB at once."""
    total = 0.0
    for first in range(start, targets.numel(), chunk):
        rows = slice(first, first + chunk)
        total += float(nn.functional.cross_entropy(logits[rows].float(), targets[rows], reduction="sum"))
    return total, max(targets.numel() - start, 0)


def perplexity(
    model: nn.Module,
    token_ids: torch.Tensor | Sequence[int],
    length: int,
    mode: str = "windows",
    stride: int | None = None,
    tail_from: int | None = None,
    max_windows: int | None = None,
    progress: bool = False,
) -> PerplexityResult:
    """Perplexity of ``model`` on the flat token stream ``token_ids`` at context ``length``, in eval mode (the
    model's own train/eval mode is given back afterwards).

    ``token_ids``: a 1-D tensor [N], a one-row tensor [1, N] (``tokenizer(text, return_tensors="pt").input_ids``) or
    a list of ints; several rows, float ids or no ids are refused.

    - ``windows``: non-overlapping windows of ``length`` tokens; every next-token prediction counts.
    - ``sliding``: windows of ``length`` moved by ``stride``; each window scores only the tokens not scored by the
      previous one, so every token after the first window is predicted with at least ``length - stride`` tokens of
      context (those in the first window with what precedes them).
    - ``tail``: non-overlapping windows; only predictions of positions >= ``tail_from`` count (default: the
      model's trained length), so early tokens do not flatter long-context numbers.

    ``progress``: report the windows on stderr (a bar on a terminal, plain lines elsewhere).
    """
    token_ids = token_stream(token_ids)
    starts, first_scored = plan_windows(model, token_ids, length, mode, stride, tail_from)
    if max_windows is not None and (isinstance(max_windows, bool) or not isinstance(max_windows, int)
                                    or max_windows < 0):
        raise InvalidConfigError(f"max_windows must be an integer >= 0 (0 or None: all windows), got {max_windows!r}.")
    if max_windows:
        starts, first_scored = starts[:max_windows], first_scored[:max_windows]
    total, count = 0.0, 0
    with eval_mode(model), Progress(f"perplexity at {length} tokens ({mode})", len(starts), unit="window",
                                    enabled=progress) as bar, bar.watch(model):
        for start, first in zip(starts, first_scored, strict=True):
            nll, scored = window_nll(model, token_ids[start : start + length].to(_device(model)), first)
            total, count = total + nll, count + scored
            bar.step()
    if count == 0:
        raise InvalidConfigError(f"No token was scored at length {length} ({mode}); use a longer text or length.")
    mean = total / count
    tail_from = first_scored[0] if mode == "tail" else None
    return PerplexityResult(length, mode, exp_nll(mean), mean, count, len(starts), tail_from)


def exp_nll(mean_nll: float) -> float:
    """Perplexity from a mean next-token NLL: ``exp(mean_nll)``, and ``inf`` where that passes the float range (a
    mean above ~709.8 nats: a model that gives the text almost no probability) rather than an OverflowError."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def plan_windows(
    model: nn.Module, token_ids: torch.Tensor, length: int, mode: str, stride: int | None, tail_from: int | None
) -> tuple[list[int], list[int]]:
    """(window starts, first scored position of each); raises on any impossible setting, runs nothing."""
    token_ids = token_stream(token_ids)
    if mode not in MODES:
        raise InvalidConfigError(f"Unknown perplexity mode '{mode}'. Modes: {', '.join(MODES)}.")
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise InvalidConfigError(f"Length {length!r}: a window needs an integer of at least 2 tokens.")
    if token_ids.numel() < length:
        raise InvalidConfigError(
            f"Length {length} needs at least {length} tokens of text, and the text has {token_ids.numel()}; give a "
            f"longer text (or a larger corpus) or lengths of at most {token_ids.numel()}."
        )
    return _plan(token_ids.numel(), length, mode, stride, tail_from, model)


def _plan(n_tokens: int, length: int, mode: str, stride: int | None, tail_from: int | None, model: nn.Module):
    if mode == "sliding":
        stride = length // 2 if stride is None else stride
        if isinstance(stride, bool) or not isinstance(stride, int) or not 0 < stride <= length:
            raise InvalidConfigError(f"stride must be in (0, {length}], got {stride}.")
        starts = list(range(0, n_tokens - length + 1, stride))
        # the first window scores everything; later ones only their last `stride` targets
        return starts, [1] + [length - stride] * (len(starts) - 1)
    starts = list(range(0, n_tokens - length + 1, length))
    if mode == "tail":
        if tail_from is None:
            tail_from = trained_length(model)
        if not isinstance(tail_from, int) or isinstance(tail_from, bool) or not 0 < tail_from < length:
            raise InvalidConfigError(
                f"Tail NLL needs 0 < tail_from < length={length}, got {tail_from}; pass tail_from (--tail-from; e.g. "
                "the trained length) and a longer length."
            )
        return starts, [tail_from] * len(starts)
    return starts, [1] * len(starts)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def trained_length(model: nn.Module) -> int | None:
    """The context length the model was trained at: before ``extend_context`` when it was extended (its record in
    ``config.posswap``, or RoPE's ``original_max_position_embeddings``), else ``max_position_embeddings``."""
    config = getattr(model, "config", None)
    record = getattr(config, "posswap", None)
    extension = record.get("extension") if isinstance(record, dict) else None
    if isinstance(extension, dict) and isinstance(extension.get("original_max_position_embeddings"), int):
        return extension["original_max_position_embeddings"]
    from ..transformers_internals import config_rope_parameters

    rope = config_rope_parameters(config)
    if isinstance(rope.get("original_max_position_embeddings"), int):
        return rope["original_max_position_embeddings"]
    return getattr(config, "max_position_embeddings", None)
