"""Validation of evaluation settings, done before any forward pass so a bad setting never costs finished results.

``check_settings`` needs no model (the CLI calls it before loading one); ``check_model`` needs the model and
tokenizer but runs no forward pass.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

from torch import nn

from ..errors import InvalidConfigError
from .perplexity import MODES

_POSITION_TABLE = re.compile(r"(^|\.)(wpe|position_embeddings)$")
#: the longest passkey prompt built (16.8M tokens, past any single-device forward pass): a longer one would only
#: exhaust memory while its filler text is built
MAX_PASSKEY_LENGTH = 1 << 24


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ints(name: str, values: Sequence[Any], minimum: int, hint: str) -> None:
    for value in values:
        if not _is_int(value) or value < minimum:
            raise InvalidConfigError(f"{name} must be integers >= {minimum}, got {value!r}; {hint}.")


def check_settings(
    lengths: Sequence[int],
    modes: Sequence[str],
    stride: int | None,
    tail_from: int | None,
    max_windows: int | None,
    passkey_lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
) -> None:
    """Refuse impossible settings, naming the value and what is allowed; needs no model."""
    if not lengths and not passkey_lengths:
        raise InvalidConfigError("Nothing to measure: give perplexity lengths (--lengths) and/or passkey lengths "
                                 "(--passkey-lengths).")
    _check_ints("Perplexity lengths (--lengths)", lengths, 2, "a window needs at least 2 tokens")
    for mode in modes:
        if mode not in MODES:
            raise InvalidConfigError(f"Unknown perplexity mode {mode!r}. Modes: {', '.join(MODES)}.")
    _check_unique("Perplexity lengths (--lengths)", lengths)
    _check_unique("Perplexity modes (--mode)", modes)
    _check_mode_options(modes, stride, tail_from)
    if stride is not None:
        _check_ints("The sliding stride (--stride)", [stride], 1, "pass a positive stride")
        too_short = [n for n in lengths if stride > n]
        if "sliding" in modes and too_short:
            raise InvalidConfigError(f"The sliding stride {stride} exceeds length {too_short[0]}; use a stride "
                                     f"in 1..{min(lengths)}.")
    if tail_from is not None:
        _check_ints("tail_from (--tail-from)", [tail_from], 1, "pass the trained length")
        too_short = [n for n in lengths if n <= tail_from]
        if "tail" in modes and too_short:
            raise InvalidConfigError(
                f"Tail NLL scores positions >= tail_from={tail_from}, so every length must exceed it; length "
                f"{too_short[0]} does not. Use lengths > {tail_from} for --mode tail, or a smaller --tail-from."
            )
    if max_windows is not None:
        _check_ints("max_windows (--max-windows)", [max_windows], 0, "0 or None means all windows")
    _check_ints("Passkey lengths (--passkey-lengths)", passkey_lengths, 1, "pass prompt lengths in tokens")
    too_long = [n for n in passkey_lengths if n > MAX_PASSKEY_LENGTH]
    if too_long:
        raise InvalidConfigError(f"Passkey length {too_long[0]} (--passkey-lengths) is past the longest prompt built, "
                                 f"{MAX_PASSKEY_LENGTH} tokens; pass lengths up to {MAX_PASSKEY_LENGTH}.")
    for depth in depths:
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0 \
                or not math.isfinite(depth):
            raise InvalidConfigError(f"Passkey depths (--depths) must be in [0, 1] (0 = start, 1 = end), got "
                                     f"{depth!r}.")
    _check_unique("Passkey lengths (--passkey-lengths)", passkey_lengths)
    _check_unique("Passkey depths (--depths)", depths)
    if passkey_lengths and not depths:
        raise InvalidConfigError("Passkey lengths were given but no depths (--depths); pass depths in [0, 1].")
    _check_ints("Passkey trials (--trials)", [trials], 1, "pass at least 1 trial")


def _check_unique(name: str, values: Sequence[Any]) -> None:
    """Refuse a value given twice: it would be measured twice (and a passkey cell drawn once, over the other)."""
    repeated = sorted({value for value in values if list(values).count(value) > 1}, key=list(values).index)
    if repeated:
        shown = ", ".join(repr(value) for value in repeated)
        raise InvalidConfigError(f"{name} repeat {shown}; give each value once.")


def _check_mode_options(modes: Sequence[str], stride: int | None, tail_from: int | None) -> None:
    """Refuse a mode's option given without that mode: it would be accepted and change nothing."""
    if stride is not None and "sliding" not in modes:
        raise InvalidConfigError(f"--stride {stride} (stride) applies to the sliding mode only, and the modes are "
                                 f"{', '.join(modes) or 'none'}; add --mode sliding, or drop --stride.")
    if tail_from is not None and "tail" not in modes:
        raise InvalidConfigError(f"--tail-from {tail_from} (tail_from) applies to the tail mode only, and the modes "
                                 f"are {', '.join(modes) or 'none'}; add --mode tail, or drop --tail-from.")


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` predicts the next token from the tokens before it (BERT, an encoder, does not)."""
    from ..families.base import FAMILY_REGISTRY

    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(inner, "config", None)
    model_type = getattr(config, "posswap_base_model_type", None) or getattr(config, "model_type", None)
    if not model_type:
        return True  # not a transformers model: nothing says it is an encoder, trust the caller
    if model_type in FAMILY_REGISTRY:
        return FAMILY_REGISTRY.get(model_type).is_causal(config)
    from ..transformers_internals import causal_lm_class_names

    return model_type in causal_lm_class_names() or bool(getattr(config, "is_decoder", False))


def check_causal(model: nn.Module) -> None:
    """Refuse an encoder: a causal perplexity or a greedy passkey answer of BERT means nothing."""
    if not is_causal_lm(model):
        raise InvalidConfigError(
            f"{type(model).__name__} is not a causal language model (its attention sees the whole sequence), so "
            "next-token perplexity and passkey retrieval do not apply. Evaluate a decoder (GPT-2, LLaMA, ...)."
        )


def check_vocabulary(model: nn.Module, tokenizer) -> None:
    """Every id the tokenizer can give has a row in the model's input embeddings (a larger tokenizer would fail
    half-way through the evaluation with an ``IndexError``)."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    rows = embeddings.num_embeddings if isinstance(embeddings, nn.Embedding) else None
    if rows is not None and len(tokenizer) > rows:
        raise InvalidConfigError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's input embeddings have {rows} rows, so token "
            f"ids >= {rows} have no embedding. Use the checkpoint's own tokenizer, or resize the embeddings with "
            "model.resize_token_embeddings(len(tokenizer)) before saving the checkpoint."
        )


def learned_table_size(model: nn.Module) -> tuple[str, int] | None:
    """(name, rows) of the smallest learned absolute position table (a native ``wpe`` / ``position_embeddings``
    embedding, or a swapped-in learned table), or ``None`` when the model has none."""
    from ..schemes.learned import LearnedPositions

    tables = []
    for name, module in model.named_modules():
        if isinstance(module, LearnedPositions):
            tables.append((name, int(module.weight.shape[0])))
        elif isinstance(module, nn.Embedding) and _POSITION_TABLE.search(name):
            tables.append((name, module.num_embeddings))
    return min(tables, key=lambda item: item[1]) if tables else None


def check_lengths_fit(model: nn.Module, longest: int) -> None:
    """Refuse a length past a learned position table (it would fail half-way with an IndexError)."""
    table = learned_table_size(model)
    if table is not None and longest > table[1]:
        raise InvalidConfigError(
            f"Length {longest} exceeds the model's learned position table ({table[0]}: {table[1]} positions). "
            f"Use lengths <= {table[1]}, or extend the context first (hf-posswap extend --to {longest})."
        )


def check_results_output(path: str | os.PathLike[str], flag: str = "--output") -> None:
    """Where results JSON goes: a writable place, and never over an existing file that is not earlier results
    (``--output model/config.json`` would otherwise destroy a checkpoint); the directory must take a new file under
    the temporary name the results are written through, so a long evaluation never ends in a failed write."""
    from ..persistence.output_names import check_file_writable, check_output_given
    from ..persistence.saving import check_output_file

    check_output_given(str(path), flag=flag)
    target = check_output_file(path, flag=flag)
    check_file_writable(path, flag=flag)
    if not target.exists():
        return
    try:
        earlier = json.loads(target.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        earlier = None
    if not (isinstance(earlier, dict) and "perplexity" in earlier and "passkey" in earlier):
        raise InvalidConfigError(
            f"{flag} {str(path)!r} exists and is not an hf-posswap results file; choose another file name (the "
            "existing file is left untouched)."
        )
