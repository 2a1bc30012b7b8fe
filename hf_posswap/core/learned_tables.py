"""Growing a learned position table to a longer context, and finding the trained table in a grown one.

``extend_context`` grows a learned table from its trained length L0 to N rows (:func:`grow_table`). Extending
again starts from the trained rows, not from the grown ones; in memory the swap state keeps them, but a saved
checkpoint holds only the grown table (it stays a plain transformers checkpoint), so a reloaded model finds them
with :func:`trained_rows`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InvalidConfigError


def grow_table(trained: torch.Tensor, max_positions: int, method: str) -> torch.Tensor:
    """[L0, hidden] -> [max_positions, hidden].

    ``interpolate``: the trained vectors stretched over the new length (row i of the result is the linear
    interpolation at i * (L0 - 1) / (N - 1)), the table analogue of position interpolation (Chen et al. 2023).
    ``copy``: the trained table repeated, as Longformer initialised its 4096 positions (Beltagy et al. 2020, §5).
    """
    if method == "copy":
        repeats = -(-max_positions // trained.shape[0])
        return trained.repeat(repeats, 1)[:max_positions]
    stretched = nn.functional.interpolate(
        trained.T[None].float(), size=max_positions, mode="linear", align_corners=True
    )  # [1, hidden, L0] -> [1, hidden, N]
    return stretched[0].T.to(trained.dtype)


def trained_rows(grown: torch.Tensor, original: int, method: str | None) -> torch.Tensor:
    """The trained table [original, hidden] that ``grow_table(trained, N, method)`` turned into ``grown`` [N, hidden].

    ``copy`` (and a table never grown) kept the trained rows first. ``interpolate`` mixed them: grown row i is
    (1 - f) trained[lo] + f trained[lo + 1] at x = i (L0 - 1) / (N - 1), lo = floor(x), f = x - lo, a linear map of
    full column rank for N >= L0, so the trained rows are its least-squares solution. Its normal equations only
    couple neighbouring trained rows (a tridiagonal [L0, L0] system, solved in float64); the solution is accepted
    only if growing it gives back ``grown`` to the table's precision. A table changed after it
    was grown (fine-tuned at the longer length) is no interpolation of any trained table, and is refused rather
    than squeezed from its first rows.
    """
    if method != "interpolate" or grown.shape[0] == original or original < 2:
        return grown[:original].clone()
    target = grown.detach().to("cpu", torch.float64)  # [N, hidden]; solved on the CPU whatever the table's device
    low, low_weight, high_weight = _interpolation_weights(grown.shape[0], original)
    solution = _least_squares_ungrow(target, original, low, low_weight, high_weight)  # [L0, hidden]
    regrown = low_weight[:, None] * solution[low] + high_weight[:, None] * solution[low + 1]  # [N, hidden]
    residual = (regrown - target).abs().max()
    tolerance = 4 * torch.finfo(_saved_precision(grown)).eps * max(float(target.abs().max()), 1e-30)
    if float(residual) > tolerance:
        raise InvalidConfigError(
            f"This model's learned position table was grown from {original} to {grown.shape[0]} positions by "
            "'interpolate' and has changed since (fine-tuned at the longer length, say), and the trained table it was "
            f"grown from is not saved with a checkpoint, so it cannot be grown again from its {original} trained "
            "positions. Extend the checkpoint it was grown from instead."
        )
    return solution.to(grown.device, grown.dtype)


def _saved_precision(table: torch.Tensor) -> torch.dtype:
    """The coarsest dtype that holds every value of ``table`` exactly: a table grown in bfloat16 and loaded in
    float32 still carries bfloat16's rounding, and its precision is bfloat16's."""
    for dtype in (torch.bfloat16, torch.float16):  # coarsest first
        coarser = torch.finfo(dtype).eps > torch.finfo(table.dtype).eps
        if coarser and torch.equal(table.to(dtype).to(table.dtype), table):
            return dtype
    return table.dtype


def _interpolation_weights(length: int, original: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each of ``length`` grown rows: lo (the trained row before it) and the weights of rows lo and lo + 1,
    read from :func:`grow_table` itself (its float32 arithmetic places rows up to ~1e-4 off the exact i (L0 - 1) /
    (N - 1), more than a table's precision, so the exact formula would not reproduce it)."""
    mixing = grow_table(torch.eye(original), length, "interpolate")  # [N, L0]: at most two non-zeros a row
    low = (mixing > 0).to(torch.uint8).argmax(dim=1).clamp(max=original - 2)  # [N]
    rows = torch.arange(length)
    return low, mixing[rows, low].double(), mixing[rows, low + 1].double()


def _least_squares_ungrow(target: torch.Tensor, original: int, low: torch.Tensor, low_weight: torch.Tensor,
                          high_weight: torch.Tensor) -> torch.Tensor:
    """argmin_T |A T - target|, A [N, L0] the ``interpolate`` map, from the normal equations (A^T A) T = A^T target:
    A^T A is tridiagonal (row i of A weighs trained rows lo and lo + 1 only), [L0, L0] in float64."""
    normal = torch.zeros(original, original, dtype=torch.float64)  # A^T A
    normal.index_put_((low, low), low_weight * low_weight, accumulate=True)
    normal.index_put_((low + 1, low + 1), high_weight * high_weight, accumulate=True)
    normal.index_put_((low, low + 1), low_weight * high_weight, accumulate=True)
    normal.index_put_((low + 1, low), low_weight * high_weight, accumulate=True)
    projected = torch.zeros(original, target.shape[1], dtype=torch.float64)  # A^T target [L0, hidden]
    projected.index_add_(0, low, low_weight[:, None] * target)
    projected.index_add_(0, low + 1, high_weight[:, None] * target)
    return torch.linalg.solve(normal, projected)
