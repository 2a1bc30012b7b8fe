"""What the measurements take from their caller: the model's train/eval mode and a stream of token ids."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ..errors import InvalidConfigError


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Run the block with ``model`` in eval mode (no dropout: the same numbers on every call), then give every module
    back the train/eval mode it had, also when the block raises (a training loop that evaluates mid-run keeps its
    dropout, and a model with some frozen modules in eval mode keeps them so)."""
    before = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in before:
            module.training = training


#: what ``token_stream`` accepts, for its error message
TOKEN_SHAPES = "a 1-D tensor of token ids [N], a [1, N] tensor (tokenizer(text, return_tensors='pt').input_ids) or a " \
               "list of ints"


def token_stream(token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``token_ids`` as a flat integer tensor [N]: a 1-D tensor, a one-row [1, N] tensor (what
    ``tokenizer(..., return_tensors="pt").input_ids`` gives) and a list of ints are the same stream; anything else
    (several rows, float ids, no ids) is refused naming what was given."""
    if isinstance(token_ids, torch.Tensor):
        ids = token_ids
    elif isinstance(token_ids, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool)
                                                      for i in token_ids):
        ids = torch.tensor(list(token_ids), dtype=torch.long)
    else:
        raise InvalidConfigError(f"token_ids must be {TOKEN_SHAPES}, got {_describe(token_ids)}.")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype.is_complex \
            or ids.dtype == torch.bool:
        raise InvalidConfigError(
            f"token_ids must be {TOKEN_SHAPES}, got {_describe(ids)}; pass one text's ids (for a batch, one row at a "
            "time), as integers, and at least one of them."
        )
    return ids


def _describe(value: object) -> str:
    """``a tensor of dtype float32 and shape [2, 10]``, ``a list holding 'a'``, ``a str``: what the caller passed."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of dtype {str(value.dtype).removeprefix('torch.')} and shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        odd = next((i for i in value if not isinstance(i, int) or isinstance(i, bool)), None)
        return f"a {type(value).__name__} holding {odd!r}"
    return f"a {type(value).__name__}"
