"""The ``hf-posswap`` command line (``main``), its ``demo`` and ``finetune`` entry points. The top layer: nothing in
hf_posswap imports from here."""

from .main import main

__all__ = ["main"]
