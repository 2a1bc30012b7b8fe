"""The memo one forward shares across its layers (``PositionContext.memo``, in :mod:`hf_posswap.core.context`).

Eagerly it works as a dict: positions, bucket ids, merged masks and block masks are made by the first layer that
asks and read by the others. Under ``torch.compile`` it keeps nothing. Its keys hold sizes (query and key lengths,
the cache offset), and dynamo can only hash a key by fixing those sizes in the graph's guards: every decoding step
would then compile the model again (one more key token, one more graph; after eight, dynamo gives up and runs it
eagerly). And a key names a tensor by its ``id()``, which dynamo cannot give: two masks would share one key.
Computed afresh in each layer, the values are part of the one graph instead, which the compiler traces once per
shape kind.

Both sides of compilation can meet one memo: with regional compilation (each decoder layer compiled, the model's
forward eager) the memo is made eagerly and read inside compiled layers. So the eager memo asks at every access
whether it is being compiled (:class:`ForwardMemo`), and under compilation the memo made is a plain object
(:class:`CompiledMemo`: dynamo cannot build a dict subclass inside a graph).

Callers read it as ``found = memo.get(key)`` (or ``key in memo``) and write ``memo[key] = found``, never reading
back with ``memo[key]`` what they wrote.
"""

from __future__ import annotations

from typing import Any

import torch


class ForwardMemo(dict):
    """A dict that, read or written under ``torch.compile``, holds nothing: lookups miss and writes are dropped."""

    def get(self, key: Any, default: Any = None) -> Any:
        return default if torch.compiler.is_compiling() else super().get(key, default)

    def __contains__(self, key: object) -> bool:
        return False if torch.compiler.is_compiling() else super().__contains__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        if not torch.compiler.is_compiling():
            super().__setitem__(key, value)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return default if torch.compiler.is_compiling() else super().setdefault(key, default)


class CompiledMemo:
    """The memo made under ``torch.compile``: every lookup misses and every write is dropped."""

    def get(self, key: Any, default: Any = None) -> Any:
        return default

    def __contains__(self, key: object) -> bool:
        return False

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return default


def new_memo() -> ForwardMemo | CompiledMemo:
    """A forward's memo: a :class:`ForwardMemo`, or under ``torch.compile`` a :class:`CompiledMemo`."""
    return CompiledMemo() if torch.compiler.is_compiling() else ForwardMemo()
