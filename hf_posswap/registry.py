"""A small checked registry: names to objects, with errors that list what exists."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .errors import closest_hint

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to registered objects.

    Args:
        kind: what the registry holds, used in error messages ("position scheme", "model family").
        error_cls: exception raised for unknown names.
        fix_hint: a sentence appended to the unknown-name error telling the user what to do.
    """

    def __init__(self, kind: str, error_cls: type[Exception], fix_hint: str = "") -> None:
        self.kind = kind
        self._error_cls = error_cls
        self._fix_hint = fix_hint
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``; names are unique."""

        def add(obj: T) -> T:
            if name in self._items:
                raise KeyError(f"{self.kind} '{name}' is already registered ({self._items[name]!r}).")
            self._items[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        """Return the object registered as ``name`` or raise the registry's error listing the known names."""
        if name in self._items:
            return self._items[name]
        known = ", ".join(sorted(self._items))
        raise self._error_cls(
            f"Unknown {self.kind} '{name}'. Known: {known}.{closest_hint(name, self._items)} {self._fix_hint}".rstrip()
        )

    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def items(self) -> list[tuple[str, T]]:
        return list(self._items.items())
