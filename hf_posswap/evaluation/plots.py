"""Pictures (PNG, matplotlib): perplexity against length, passkey heatmaps, and what a position scheme looks like
(``hf-posswap inspect``)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen needed
    import matplotlib.pyplot as plt

    return plt


def plot_perplexity(
    runs: Mapping[str, dict[str, Any]],
    path: str | os.PathLike[str],
    mode: str = "windows",
    trained_length: int | None = None,
    title: str = "Perplexity against context length",
) -> Path:
    """One line per run (label -> ``evaluate`` results) of perplexity against length, log scales (``mode="mixed"``
    takes every row whatever its mode)."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for label, results in runs.items():
        rows = sorted((r for r in results["perplexity"] if mode == "mixed" or r["mode"] == mode),
                      key=lambda r: r["length"])
        axis.plot([r["length"] for r in rows], [r["perplexity"] for r in rows], marker="o", label=label)
    if trained_length:
        axis.axvline(trained_length, color="grey", linestyle="--", linewidth=1, label="trained length")
    axis.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel=f"perplexity ({mode})", title=title)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    return _save(figure, path)


def plot_passkey(results: dict[str, Any], path: str | os.PathLike[str], title: str = "Passkey retrieval") -> Path:
    """Accuracy as a depth x length heatmap."""
    plt = _pyplot()
    rows = results["passkey"]
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    grid = torch.full((len(depths), len(lengths)), float("nan"))
    for r in rows:
        grid[depths.index(r["depth"]), lengths.index(r["length"])] = r["accuracy"]
    figure, axis = plt.subplots(figsize=(1.2 * len(lengths) + 2, 0.6 * len(depths) + 2))
    image = axis.imshow(grid.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    axis.set(
        xticks=range(len(lengths)),
        xticklabels=lengths,
        yticks=range(len(depths)),
        yticklabels=[f"{d:.0%}" for d in depths],
        xlabel="length (tokens)",
        ylabel="depth of the key",
        title=title,
    )
    figure.colorbar(image, ax=axis, label="accuracy")
    return _save(figure, path)


def position_pictures(model: nn.Module, directory: str | os.PathLike[str], length: int = 256) -> list[Path]:
    """What the model's position scheme looks like: cosine distance between absolute position vectors; RoPE's
    q.k against distance; ALiBi / T5 bias per head. Returns the PNG paths."""
    from ..core.state import swap_state
    from ..families.base import get_family

    adapter = get_family(model)
    base = adapter.base_model(model)
    state = swap_state(model)
    directory = Path(directory)
    kind = state.config.kind if state is not None else None
    module = getattr(base, "posswap_positions", None)
    if kind == "absolute" or (state is None and adapter.absolute_table_path):
        slot = adapter.absolute_slot(base)
        table = getattr(slot[0], slot[1]) if slot is not None else module
        vectors = table(torch.arange(length)[None].to(next(model.parameters()).device))[0].float().detach()
        return [_cosine_matrix(vectors, directory / "absolute_cosine.png")]
    if kind == "bias":
        positions = torch.arange(length)
        bias = module(positions, positions, 0, adapter.spec(model).is_causal)[0].float().detach()
        return [_bias_heads(bias, directory / "bias_per_head.png", state.config.name)]
    if kind == "rotary" or adapter.rotary_module_path:
        return [_rope_curve(model, adapter, directory / "rope_qk_vs_distance.png", length)]
    return []


def _cosine_matrix(vectors: torch.Tensor, path: Path) -> Path:
    plt = _pyplot()
    unit = nn.functional.normalize(vectors, dim=-1)
    distance = 1 - unit @ unit.T  # [L, L]
    figure, axis = plt.subplots(figsize=(5.5, 4.5))
    image = axis.imshow(distance.numpy(), cmap="viridis")
    axis.set(xlabel="position", ylabel="position", title="cosine distance between position vectors")
    figure.colorbar(image, ax=axis)
    return _save(figure, path)


def _bias_heads(bias: torch.Tensor, path: Path, scheme: str) -> Path:
    plt = _pyplot()
    heads = bias.shape[0]
    columns = min(heads, 4)
    rows = -(-heads // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3 * columns, 3 * rows), squeeze=False)
    for head in range(rows * columns):
        axis = axes[head // columns][head % columns]
        axis.axis("off")
        if head < heads:
            axis.imshow(bias[head].numpy(), cmap="magma")
            axis.set_title(f"head {head}")
    figure.suptitle(f"{scheme} logit bias (query x key)")
    return _save(figure, path)


def _rope_curve(model: nn.Module, adapter, path: Path, length: int) -> Path:
    """Expected q.k of identical random unit vectors rotated to positions 0 and d (RoPE's long-range decay)."""
    from ..schemes.rope import apply_rotary

    plt = _pyplot()
    base = adapter.base_model(model)
    rotary = getattr(base, "posswap_positions", None)
    spec = adapter.spec(model)
    vector = nn.functional.normalize(
        torch.randn(256, spec.head_dim, generator=torch.Generator().manual_seed(0)), dim=-1
    )
    positions = torch.arange(length)
    if rotary is not None and hasattr(rotary, "frequencies"):
        cos, sin = rotary(positions, length)
    else:
        native = adapter.rotary_slot(base)
        module = getattr(native[0], native[1])
        cos, sin = (t[0].float() for t in module(vector[None], positions[None]))
    rotated = apply_rotary(vector[None, :, None, :].expand(1, -1, length, -1), cos, sin)  # [1, 256, L, D]
    scores = (rotated[0, :, :1] * rotated[0]).sum(-1).mean(0)  # q at 0 . k at d, averaged over vectors
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(positions.numpy(), scores.detach().numpy())
    axis.set(xlabel="relative distance", ylabel="mean q.k (q = k, unit)", title="RoPE: q.k against distance")
    axis.grid(True, alpha=0.3)
    return _save(figure, path)


def _save(figure, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    import io

    from ..persistence.saving import write_file_atomic

    buffer = io.BytesIO()
    figure.savefig(buffer, dpi=110, format=check_picture_path(path))
    _pyplot().close(figure)
    write_file_atomic(path, buffer.getvalue())
    return path


PICTURE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")


def check_picture_path(path: str | os.PathLike[str], flag: str = "--output") -> str:
    """The picture format named by ``path``'s suffix; an unsupported one is refused before anything is drawn."""
    from ..errors import InvalidConfigError

    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in PICTURE_FORMATS:
        raise InvalidConfigError(f"{flag} {str(path)!r}: pictures are written as {', '.join(PICTURE_FORMATS)}; "
                                 "end the file name with one of them (e.g. perplexity.png).")
    return suffix


def load_runs(paths: Sequence[str], mode: str | None = None, passkey: bool = False) -> dict[str, dict[str, Any]]:
    """``label=results.json`` (or just the path) -> {label: results}. A missing or malformed file, or (with
    ``mode``) a run without perplexity rows of that mode, is refused with its name."""
    from ..errors import InvalidConfigError
    from ..persistence.user_files import read_json

    runs = {}
    for item in paths:
        label, sep, path = item.partition("=")
        if not sep or Path(item).exists():
            label, path = Path(item).stem, item
        if not Path(path).is_file():
            raise InvalidConfigError(f"Results file {path!r} does not exist; pass the --output of hf-posswap eval.")
        results = read_json(Path(path), flag="results")
        _check_results(results, path, mode, passkey and not runs)  # the first run's passkey is drawn
        runs[label] = results
    return runs


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_row(row: Any) -> bool:
    """A perplexity row: a positive length, a mode name and a numeric perplexity."""
    return (isinstance(row, dict) and _number(row.get("length")) and row["length"] > 0
            and isinstance(row.get("mode"), str) and _number(row.get("perplexity")))


def _check_results(results: dict[str, Any], path: str, mode: str | None, passkey: bool) -> None:
    from ..errors import InvalidConfigError

    rows = results.get("perplexity")
    if not isinstance(rows, list) or not all(_is_row(r) for r in rows):
        raise InvalidConfigError(f"{path!r} is not an hf-posswap eval results file (needs a 'perplexity' list of "
                                 "rows with numeric length and perplexity and a mode).")
    if mode is not None and not any(r["mode"] == mode for r in rows):
        found = sorted({str(r["mode"]) for r in rows}) or ["none"]
        raise InvalidConfigError(f"{path!r} has no perplexity rows of mode {mode!r} (it has: {', '.join(found)}); "
                                 "pass --mode with one of those.")
    pass_rows = results.get("passkey")
    if passkey and (not isinstance(pass_rows, list) or not pass_rows
                    or not all(isinstance(r, dict) and all(_number(r.get(k)) for k in ("length", "depth", "accuracy"))
                               for r in pass_rows)):
        raise InvalidConfigError(f"{path!r} has no passkey results to draw; run eval with --passkey-lengths.")
