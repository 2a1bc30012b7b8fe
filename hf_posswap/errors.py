"""Exceptions raised by hf_posswap.

Every error names the bad value, what is allowed, and how to fix it. They subclass the built-in exception a
Python user would expect (``ValueError`` for bad values, ``TypeError`` for bad types), so ``except ValueError``
in user code keeps working.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PosSwapError(Exception):
    """Base class for all hf_posswap errors."""


class UnknownSchemeError(PosSwapError, ValueError):
    """A position scheme name that is not registered."""


class UnsupportedFamilyError(PosSwapError, ValueError):
    """A model whose ``config.model_type`` has no family adapter."""


class InvalidOptionError(PosSwapError, TypeError):
    """An option that the scheme's config does not have."""


class InvalidConfigError(PosSwapError, ValueError):
    """An option with an invalid value (non-positive theta, too few buckets, ...)."""


class IncompatibleAttentionError(PosSwapError, ValueError):
    """The model's attention implementation cannot carry the requested scheme."""


class AlreadySwappedError(PosSwapError, RuntimeError):
    """``swap`` on a model that already carries a swapped scheme."""


class NotSwappedError(PosSwapError, RuntimeError):
    """``unswap`` on a model that was never swapped."""


class FlexAttentionError(PosSwapError, RuntimeError):
    """Compiled ``flex_attention`` failed on a call the flex path took (rather than silently running another
    implementation of the same attention)."""


def closest_hint(name: str, choices: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest choice, or an empty string."""
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean '{matches[0]}'?" if matches else ""


def one_line(error: BaseException) -> str:
    """An error's message on one line (what the command line prints), or its type when it has none."""
    return " ".join(str(error).split()) or type(error).__name__
