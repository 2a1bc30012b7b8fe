"""After every forward of a swapped model, a check that what the position wrapper (:mod:`hf_posswap.core.context`)
assumed of transformers held: a release that breaks an assumption then fails loud (docs/guarantees.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..transformers_internals import KNOWN_CACHE_KWARGS, cache_length, drift_error, find_cache_in_output


def new_tokens(kwargs: dict[str, Any]) -> int | None:
    """How many tokens a forward adds (None when neither input_ids nor inputs_embeds say)."""
    for name in ("input_ids", "inputs_embeds"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    return None


@dataclass(frozen=True)
class ForwardCheck:
    """What the position wrapper assumed about one forward, checked against what the model then did.

    The wrapper places new tokens after the KV cache it finds among the forward's arguments, and passes the position
    context to attention through transformers' keyword forwarding. A transformers release that renames the cache
    argument, or stops forwarding keywords, would break either assumption without an error (wrong logits), so
    both are checked after every forward: a model that returns a cache holding more tokens than this forward
    added used a cache the wrapper did not see, and a context no attention call read was never applied.
    """

    cache_seen: bool
    new_tokens: int | None
    #: the forward's PositionContext (None: the scheme needs none inside attention)
    context: Any

    def verify(self, outputs: Any) -> None:
        if self.context is not None and not self.context.reached_attention:
            raise drift_error(
                "the swapped model's attention layers never received hf_posswap's position context (transformers "
                "no longer passes the model's extra keyword arguments down to the attention function), so the "
                "position scheme was not applied."
            )
        if self.cache_seen or self.new_tokens is None:
            return
        cache = find_cache_in_output(outputs)
        if cache is not None and (held := cache_length(cache)) != self.new_tokens:
            raise drift_error(
                f"the model continued a KV cache of {held - self.new_tokens} earlier tokens that hf_posswap did not "
                f"find among its arguments (it looks for {' or '.join(KNOWN_CACHE_KWARGS)}), so the new tokens were "
                "placed from position 0."
            )
