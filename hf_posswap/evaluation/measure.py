"""``evaluate``: perplexity at each length and mode and passkey accuracy, every setting checked before the first
forward pass, the results as one JSON-ready dict (what ``hf-posswap eval`` writes)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import InvalidConfigError
from ..progress import Progress
from .checks import (
    check_causal,
    check_lengths_fit,
    check_results_output,
    check_settings,
    check_vocabulary,
    learned_table_size,
)
from .corpora import corpus_text, text_digest, text_token_ids
from .inputs import eval_mode
from .passkey import check_passkey_fits, passkey_accuracy, passkey_keys
from .perplexity import perplexity, plan_windows


def evaluate(
    model: nn.Module,
    tokenizer,
    lengths: Sequence[int] = (),
    *,
    text: str | None = None,
    corpus: str = "reference",
    modes: Sequence[str] = ("windows",),
    stride: int | None = None,
    tail_from: int | None = None,
    max_windows: int | None = 4,
    passkey_lengths: Sequence[int] = (),
    depths: Sequence[float] = (0.0, 0.5, 1.0),
    trials: int = 5,
    output: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Perplexity at each length and mode, and passkey accuracy by length x depth; optionally written as JSON.

    Every setting is checked before the first forward pass (an impossible one never costs finished results). The
    model runs in eval mode and gets its own train/eval mode back on return (also when a check or a pass raises).
    ``max_windows``: windows per length; ``None`` or 0 means all of them (as the CLI's ``--max-windows 0``).
    ``progress``: report each window and passkey trial on stderr, with the elapsed time and an ETA (a bar on a
    terminal, plain lines elsewhere); ``False`` for silent library use."""
    check_settings(lengths, modes, stride, tail_from, max_windows, passkey_lengths, depths, trials)
    if output is not None:
        check_results_output(output, flag="output")
    check_causal(model)
    with eval_mode(model):  # no dropout; a model evaluated mid-training goes back to training afterwards
        results = _measure(model, tokenizer, lengths, text, corpus, modes, stride, tail_from, max_windows,
                           passkey_lengths, depths, trials, progress)
    if output is not None:
        from ..persistence.saving import write_file_atomic

        write_file_atomic(output, results_json(results))
    return results


def results_json(results: dict[str, Any]) -> str:
    """``results`` as JSON text that every JSON reader takes: a non-finite number (the perplexity of a model that
    computes NaN or overflows) is written as ``null``, since JSON has no NaN or Infinity."""
    return json.dumps(_finite_or_none(results), indent=2, allow_nan=False)


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def _measure(model: nn.Module, tokenizer, lengths: Sequence[int], text: str | None, corpus: str,
             modes: Sequence[str], stride: int | None, tail_from: int | None, max_windows: int | None,
             passkey_lengths: Sequence[int], depths: Sequence[float], trials: int, progress: bool) -> dict[str, Any]:
    """``evaluate``'s measurements, the model already in eval mode: checks, then perplexity, then passkey."""
    source = "given text" if text is not None else f"corpus:{corpus}"
    text = text if text is not None else corpus_text(corpus)
    if not text.strip():
        raise InvalidConfigError("The evaluation text is empty; pass a text file with content, or a built-in corpus.")
    token_ids = torch.tensor(text_token_ids(tokenizer, text))
    _check_before_running(model, tokenizer, token_ids, lengths, modes, stride, tail_from, passkey_lengths, depths,
                          trials)
    weights = next(model.parameters(), None)
    results: dict[str, Any] = {
        "text": {"source": source, "sha256": text_digest(text), "tokens": int(token_ids.numel())},
        "dtype": str(weights.dtype).removeprefix("torch.") if weights is not None else None,  # what the numbers ran in
        "perplexity": [],
        "passkey": [],
    }
    for length in lengths:
        for mode in modes:
            result = perplexity(model, token_ids, length, mode, stride, tail_from, max_windows or None, progress)
            results["perplexity"].append(dataclasses.asdict(result))
    for length in passkey_lengths:
        with Progress(f"passkey at {length} tokens", len(depths) * trials, unit="trial", enabled=progress) as bar:
            for depth in depths:
                result = passkey_accuracy(model, tokenizer, length, depth, trials, progress=bar)
                results["passkey"].append(dataclasses.asdict(result))
    return results


def check_passkey_lengths(tokenizer, passkey_lengths: Sequence[int], depths: Sequence[float] = (),
                          trials: int = 0) -> None:
    """Every passkey prompt must hold at least the needle and the question, special tokens included (needs only the
    tokenizer, so callers can check this before loading a model); with ``depths`` and ``trials``, for the keys those
    prompts will hold (a tokenizer that merges digits gives some keys more tokens than others)."""
    for length in passkey_lengths:
        keys = [key for depth in depths for key in passkey_keys(length, depth, trials)] or ["12345"]
        check_passkey_fits(tokenizer, length, keys)


#: positions a passkey answer may take after its prompt (a 5-digit key and one token more, in any tokenizer here)
ANSWER_TOKENS = 8


def _check_before_running(model: nn.Module, tokenizer, token_ids: torch.Tensor, lengths: Sequence[int],
                          modes: Sequence[str], stride: int | None, tail_from: int | None,
                          passkey_lengths: Sequence[int], depths: Sequence[float], trials: int) -> None:
    """The checks that need the model, tokenizer or text, all before the first forward pass."""
    for length in lengths:
        for mode in modes:
            plan_windows(model, token_ids, length, mode, stride, tail_from)
    check_lengths_fit(model, max(passkey_lengths, default=0))  # before a long prompt is built for nothing
    check_passkey_lengths(tokenizer, passkey_lengths, depths, trials)
    check_lengths_fit(model, max(lengths, default=0))
    table = learned_table_size(model)
    for length in passkey_lengths if table is not None else ():
        needed = length + ANSWER_TOKENS  # a prompt is never longer than its length
        if needed > table[1]:
            raise InvalidConfigError(
                f"Passkey length {length} needs {needed} positions (the prompt, then up to {ANSWER_TOKENS} answer "
                f"tokens), past the model's learned position table ({table[0]}: {table[1]} positions); use passkey "
                f"lengths <= {length - (needed - table[1])}, or extend the context first (hf-posswap extend --to "
                f"{needed})."
            )
    check_vocabulary(model, tokenizer)
