"""The swap mechanism: what a swapped model carries (``state``), the per-call position context (``context``), the
attention functions that read it (``attention``, ``self_extend``), ``swap``/``unswap``, ``extend_context`` and
``describe``. Built on ``schemes`` (what positions are) and ``families`` (where they go in a model)."""
