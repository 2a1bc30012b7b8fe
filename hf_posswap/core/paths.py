"""Which attention path each call took, for tests and benchmarks that must know (not guess) what ran.

The carriers choose per call between exact forms of the same attention (the dense bias, a scheme's fused CPU
form, ``flex_attention`` with a ``score_mod``, Self-Extend's chunked or merged passes, the context-parallel ring);
the numbers must agree, so a wrong choice shows up as speed or memory, never as a failed comparison. Recording the
choice lets a test say "bf16 ALiBi on CUDA ran flex" and a benchmark print what it timed::

    with record_paths() as paths:
        model(input_ids)
    assert set(paths) == {"flex"}

Outside :func:`record_paths` nothing is kept (one attribute read per attention call).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

#: path names used by the carriers (a test may compare against these)
DENSE = "dense"  # the [B, H, q, kv] bias merged into the mask, eager or sdpa
FUSED_ALIBI = "fused-alibi"  # schemes.fused_alibi: separable / Toeplitz forms through sdpa
FUSED_T5 = "fused-t5"  # schemes.fused_t5: far parts + near band, merged by log-sum-exp
FLEX = "flex"  # core.flex_bias: flex_attention with the scheme's score_mod and a BlockMask
SELF_EXTEND_CHUNKED = "self-extend-chunked"  # core.self_extend: query chunks, both logits per chunk
SELF_EXTEND_MERGED = "self-extend-merged"  # two fused attention calls merged by log-sum-exp
RING = "ring"  # core.context_parallel: key blocks passed round the ranks, as matmuls
RING_FUSED = "ring-fused"  # the same through the CPU flash kernel (core.ring_function.fused_applies)

#: (thread, paths) of every open :func:`record_paths` block: a block records its own thread's calls, not those of
#: another thread's model (a serving process runs several)
_recorders: list[tuple[int, list[str]]] = []


def note_path(name: str) -> None:
    """Record that one attention call took path ``name`` (no-op outside :func:`record_paths`)."""
    if _recorders:
        thread = threading.get_ident()
        for owner, taken in reversed(_recorders):
            if owner == thread:
                taken.append(name)
                return


@contextlib.contextmanager
def record_paths() -> Iterator[list[str]]:
    """Collect the path of every attention call this thread makes inside the block, in call order."""
    entry = (threading.get_ident(), [])
    _recorders.append(entry)
    try:
        yield entry[1]
    finally:
        _recorders[:] = [kept for kept in _recorders if kept is not entry]  # by identity: equal empty lists abound
