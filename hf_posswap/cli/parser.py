"""The command line's argument parser: a malformed command line is one line on stderr, never a usage block."""

from __future__ import annotations

import argparse

from ..errors import PosSwapError


class UsageError(PosSwapError, ValueError):
    """A malformed command line (unknown option, a value of the wrong type)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` (printed as one line) instead of printing a usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")
