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

    ``copy`` (and a table never grown) kept the trained rows first. ``interpolate`` mixed them: each grown row is a
    weighted sum of two trained rows, a linear map of full column rank for N >= L0, so the trained rows are its
    least-squares solution; the solution is accepted only if growing it gives back ``grown`` to the table's
    precision. A table changed after it was grown (fine-tuned at the longer length) is no interpolation of any
    trained table, and is refused rather than squeezed from its first rows.
    """
    if method != "interpolate" or grown.shape[0] == original:
        return grown[:original].clone()
    mixing = grow_table(torch.eye(original, dtype=torch.float64), grown.shape[0], "interpolate")  # [N, L0]
    target = grown.detach().to(torch.float64)  # [N, hidden]
    solution = torch.linalg.lstsq(mixing, target).solution  # [L0, hidden]
    residual = (mixing @ solution - target).abs().max()
    tolerance = 4 * torch.finfo(grown.dtype).eps * max(float(target.abs().max()), 1e-30)
    if float(residual) > tolerance:
        raise InvalidConfigError(
            f"This model's learned position table was grown from {original} to {grown.shape[0]} positions by "
            "'interpolate' and has changed since (fine-tuned at the longer length, say), and the trained table it was "
            f"grown from is not saved with a checkpoint, so it cannot be grown again from its {original} trained "
            "positions. Extend the checkpoint it was grown from instead."
        )
    return solution.to(grown.dtype)
