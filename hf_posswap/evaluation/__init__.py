"""Measure what a swap or an extension did: perplexity against length and passkey retrieval.

>>> results = evaluate(model, tokenizer, [512, 1024], passkey_lengths=[512])  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .corpora import CORPORA, corpus_text, text_digest
from .passkey import PasskeyResult, passkey_accuracy, passkey_prompt
from .perplexity import MODES, PerplexityResult, perplexity
from .tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer

__all__ = [
    "BYTE_VOCAB_SIZE",
    "CORPORA",
    "MODES",
    "PasskeyResult",
    "PerplexityResult",
    "corpus_text",
    "byte_tokenizer",
    "evaluate",
    "passkey_accuracy",
    "passkey_prompt",
    "perplexity",
]


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
    """Perplexity at each length and mode, and passkey accuracy by length x depth; optionally written as JSON."""
    model.eval()
    source = "given text" if text is not None else f"corpus:{corpus}"
    text = text if text is not None else corpus_text(corpus)
    token_ids = torch.tensor(tokenizer(text)["input_ids"])
    results: dict[str, Any] = {
        "text": {"source": source, "sha256": text_digest(text), "tokens": int(token_ids.numel())},
        "perplexity": [],
        "passkey": [],
    }
    for length in lengths:
        for mode in modes:
            result = perplexity(model, token_ids, length, mode, stride, tail_from, max_windows, progress)
            results["perplexity"].append(dataclasses.asdict(result))
    for length in passkey_lengths:
        for depth in depths:
            results["passkey"].append(dataclasses.asdict(passkey_accuracy(model, tokenizer, length, depth, trials)))
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(results, indent=2), encoding="utf-8")
    return results
