"""The memo one forward shares across its layers (``PositionContext.memo``, in :mod:`hf_posswap.core.context`).

Eagerly it is a plain dict: positions, bucket ids, merged masks and block masks are made by the first layer that
asks and read by the others. Under ``torch.compile`` it keeps nothing. Its keys hold sizes (query and key lengths,
the cache offset), and dynamo can only hash a key by fixing those sizes in the graph's guards: every decoding step
would then compile the model again (one more key token, one more graph; after eight, dynamo gives up and runs it
eagerly). Computed afresh in each layer, the values are part of the one graph instead, which the compiler traces
once per shape kind.

Callers read it as ``found = memo.get(key)`` (or ``key in memo``) and write ``memo[key] = found``, never reading
back with ``memo[key]`` what they wrote.
"""

from __future__ import annotations

from typing import Any

import torch


class CompiledMemo:
    """The memo under ``torch.compile``: every lookup misses and every write is dropped (a plain class, not a dict
    subclass: dynamo cannot build one of those inside a graph)."""

    def get(self, key: Any, default: Any = None) -> Any:
        return default

    def __contains__(self, key: object) -> bool:
        return False

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return default


def new_memo() -> dict | CompiledMemo:
    """A forward's memo: a dict, or under ``torch.compile`` a :class:`CompiledMemo`."""
    return CompiledMemo() if torch.compiler.is_compiling() else {}
