"""Pictures (PNG, matplotlib): perplexity against length, passkey heatmaps, and what a position scheme looks like
(``hf-posswap inspect``)."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .results_files import load_runs as load_runs  # where `plot` reads its runs; kept here for callers
from .results_files import number as _number


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen needed
    import matplotlib.pyplot as plt

    return plt


MEASURES = {"windows": "whole window", "sliding": "sliding window", "tail": "tail positions only"}
_STYLES = {"windows": ("-", "o"), "sliding": (":", "^"), "tail": ("--", "s")}


class EmptyRunWarning(UserWarning):
    """A run that has nothing to draw in a picture (no rows of the chosen measure, or none with a finite,
    positive perplexity); it is left out of the picture."""


def plot_perplexity(
    runs: Mapping[str, dict[str, Any]],
    path: str | os.PathLike[str],
    mode: str | None = "windows",
    trained_length: int | None = None,
    title: str = "Perplexity against context length",
) -> Path:
    """Write :func:`perplexity_figure` to ``path`` (PNG, PDF, SVG or JPEG by its suffix)."""
    return _save(perplexity_figure(runs, mode, trained_length, title), path)


#: lines with at most this many points get each measured value written beside its marker
MAX_LABELLED_POINTS = 8


def perplexity_figure(
    runs: Mapping[str, dict[str, Any]],
    mode: str | None = "windows",
    trained_length: int | None = None,
    title: str = "Perplexity against context length",
):
    """Perplexity against length, one line per run (label -> ``evaluate`` results) and measure: ``mode`` draws the
    rows of that measure ("windows", "sliding", "tail"); ``None`` (or "mixed") draws every measure the runs hold,
    each as its own labelled line, never joined. A run with nothing to draw is left out with an
    :class:`EmptyRunWarning`; when no run has anything, the picture is refused."""
    from ..errors import InvalidConfigError

    plt = _pyplot()
    measures = list(MEASURES) if mode in (None, "mixed") else [mode]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawable = {label: {m: _points(results, m) for m in measures} for label, results in runs.items()}
    if not any(points for lines in drawable.values() for points in lines.values()):
        raise InvalidConfigError(f"No run has {' or '.join(measures)} perplexity rows with a finite, positive value: "
                                 "nothing to draw; check the results files (hf-posswap eval --output).")
    figure, axis = plt.subplots(figsize=(7.5, 5.6))
    lengths, values = set(), []
    for index, (label, lines) in enumerate(drawable.items()):
        if not any(lines.values()):
            warnings.warn(f"Run {label!r} has no {' or '.join(measures)} perplexity rows with a finite, positive "
                          "value; it is left out of the picture.", EmptyRunWarning, stacklevel=3)
        elif left_out := _undrawable(runs[label], measures):
            warnings.warn(f"Run {label!r}: perplexity {left_out} cannot be drawn on a log axis; those points are left "
                          "out of the picture.", EmptyRunWarning, stacklevel=3)
        for measure, points in lines.items():
            if points:
                style, marker = _STYLES[measure]
                name = _line_name(label, measure, runs, len(measures) > 1)
                colour = colours[index % len(colours)]
                axis.plot(*zip(*points, strict=True), linestyle=style, marker=marker, label=name, color=colour,
                          linewidth=1.0, markersize=7)
                if len(points) <= MAX_LABELLED_POINTS:  # the values where they were measured: lines only join them
                    for length, value in points:
                        written = f"{value:.2f}" if value < 100 else f"{value:,.0f}"
                        axis.annotate(written, (length, value), textcoords="offset points", xytext=(5, 5),
                                      fontsize=8, color=colour)
                lengths.update(n for n, _ in points)
                values.extend(v for _, v in points)
    if trained_length:
        axis.axvline(trained_length, color="grey", linestyle="--", linewidth=1,
                     label=f"trained length ({trained_length:,})")
    ylabel = "perplexity" if len(measures) > 1 else f"perplexity ({_measure_name(measures[0], runs.values())})"
    axis.set(xlabel="context length (tokens)", ylabel=ylabel, title=title)
    _plain_length_axis(axis, sorted(lengths | ({trained_length} if trained_length else set())))
    _plain_value_axis(axis, min(values), max(values))
    axis.grid(True, which="major", alpha=0.3)
    axis.margins(x=0.08)  # room for the values written beside the last markers
    entries = len(axis.get_lines())
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2 if entries > 3 else entries, frameon=False)
    return figure


def _points(results: dict[str, Any], mode: str) -> list[tuple[float, float]]:
    """(length, perplexity) of the rows of ``mode`` that a log axis can show, sorted by length."""
    rows = [r for r in results.get("perplexity", []) if r.get("mode") == mode]
    return sorted((r["length"], r["perplexity"]) for r in rows
                  if math.isfinite(r["perplexity"]) and r["perplexity"] > 0 and r["length"] > 0)


def _undrawable(results: dict[str, Any], measures: Sequence[str]) -> str:
    """The rows of ``measures`` that ``_points`` leaves out: ``inf at 4,096 tokens (windows), ...`` ("" if none)."""
    rows = [r for r in results.get("perplexity", []) if r.get("mode") in measures]
    return ", ".join(f"{r['perplexity']} at {r['length']:,} tokens ({r['mode']})" for r in rows
                     if not (math.isfinite(r["perplexity"]) and r["perplexity"] > 0 and r["length"] > 0))


def _measure_name(mode: str, runs: Iterable[dict[str, Any]]) -> str:
    """What the rows of ``mode`` measured; for tail rows the first scored position when they all agree on it (that
    position is scored: ``tail_from`` is the first target counted)."""
    starts = _tail_starts(runs) if mode == "tail" else set()
    if len(starts) == 1 and _number(start := next(iter(starts))):
        return f"positions from {start:,} on"
    if len(starts) > 1:  # the legend says each run's start
        return "tail: each run from its own start"
    return MEASURES[mode]


def _tail_starts(runs: Iterable[dict[str, Any]]) -> set[Any]:
    """The ``tail_from`` values of the tail rows of ``runs`` that are drawn (a finite, positive perplexity)."""
    return {r.get("tail_from") for results in runs for r in results.get("perplexity", [])
            if r.get("mode") == "tail" and math.isfinite(r["perplexity"]) and r["perplexity"] > 0}


def _line_name(label: str, measure: str, runs: Mapping[str, dict[str, Any]], mixed: bool) -> str:
    """A line's legend entry: the run's label, with its measure when several are drawn. Tail runs that start scoring
    at different positions are drawn together, each naming its own start, rather than refused: comparing an extended
    model scored past its new trained length (8,192) with its base scored past its own (2,048) is the comparison a
    user makes, and re-running one of them with the other's start would measure something else."""
    if mixed:
        return f"{label}: {_measure_name(measure, [runs[label]])}"
    if measure == "tail" and len(_tail_starts(runs.values())) > 1:
        return f"{label} ({_measure_name(measure, [runs[label]])})"
    return label


def _plain_length_axis(axis, lengths: list[int]) -> None:
    """Lengths on a log axis (they usually double) with a plain tick at each one (4,096 rather than 10^3.6)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    if len(lengths) > 1 and lengths[-1] / lengths[0] >= 4:
        axis.set_xscale("log")
        axis.xaxis.set_minor_locator(NullLocator())
    axis.xaxis.set_major_locator(FixedLocator(lengths))
    axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    if len(lengths) > 6:
        axis.tick_params(axis="x", labelrotation=45)


def _plain_value_axis(axis, low: float, high: float) -> None:
    """Perplexity: a linear axis when the values are within a factor of 10, else a log axis at 1-2-5 steps; the
    labels are plain numbers either way."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    if high / low >= 10:
        axis.set_yscale("log")
        axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.yaxis.set_minor_formatter(NullFormatter())
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.4g}"))


def plot_passkey(results: dict[str, Any], path: str | os.PathLike[str], title: str = "Passkey retrieval") -> Path:
    """Accuracy as a depth x length heatmap (a repeated cell or a value outside [0, 1] is refused)."""
    from .results_files import check_passkey_rows

    check_passkey_rows(results, "the results", required=True)  # one cell per length and depth, values in range
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
        causal = adapter.spec(model).is_causal
        bias = module(positions, positions, 0, causal)[0].float().detach()  # [H, L, L]
        tables = getattr(module, "tables", None)  # T5: one table shared by all layers, or one per layer
        where = f" (layer 0 of {len(tables)})" if tables is not None and len(tables) > 1 else ""
        figure = bias_figure(bias, f"{state.config.name}{where}", causal)
        return [_save(figure, directory / "bias_per_head.png")]
    if kind == "rotary" or (state is None and adapter.rotary_module_path):  # a swap to none/bias has no rotary
        return [_rope_curve(model, adapter, directory / "rope_qk_vs_distance.png", length)]
    return []


def _cosine_matrix(vectors: torch.Tensor, path: Path) -> Path:
    plt = _pyplot()
    unit = nn.functional.normalize(vectors, dim=-1)
    distance = 1 - unit @ unit.T  # [L, L]
    figure, axis = plt.subplots(figsize=(5.5, 4.5))
    image = axis.imshow(distance.numpy(), cmap="viridis")
    axis.set(xlabel="position", ylabel="position", title="cosine distance between position vectors")
    figure.colorbar(image, ax=axis, label="cosine distance (1 - cosine similarity)")
    return _save(figure, path)


ZERO_BIAS_NOTE = "all zero: the tables are zero until trained\n(the bias adds nothing yet; fine-tune the model first)"


def bias_figure(bias: torch.Tensor, scheme: str, causal: bool):
    """The logit bias of each head, bias [H, L, L] (query x key), on one colour scale shared by all heads (so
    heads compare by colour) with a labelled colour bar; a causal model's future keys (key > query) are masked,
    since attention never sees them; an all-zero bias says so on the figure."""
    import numpy as np

    plt = _pyplot()
    heads, length = bias.shape[0], bias.shape[-1]
    columns = math.ceil(math.sqrt(heads))
    rows = math.ceil(heads / columns)
    future = np.triu(np.ones((length, length), dtype=bool), k=1) if causal else np.zeros((length, length), bool)
    shown = np.ma.masked_array(bias.numpy(), mask=np.broadcast_to(future, bias.shape))  # [H, L, L]
    low, high = float(shown.min()), float(shown.max())
    if low == high:  # a constant bias (zero tables): any range around it
        low, high = low - 1.0, high + 1.0
    norm = plt.Normalize(vmin=low, vmax=high)
    cmap = plt.get_cmap("viridis").with_extremes(bad="0.88")  # masked future: light grey
    figure, axes = plt.subplots(rows, columns, figsize=(2.6 * columns + 1.4, 2.6 * rows + 0.9), squeeze=False,
                                layout="constrained")
    for head, axis in enumerate(axes.flat):
        if head >= heads:
            axis.set_visible(False)
            continue
        image = axis.imshow(shown[head], cmap=cmap, norm=norm, interpolation="nearest")
        lowest, highest = (float(v) + 0.0 for v in (shown[head].min(), shown[head].max()))  # + 0.0: no "-0"
        axis.set_title(f"head {head}: {lowest:.3g} to {highest:.3g}", fontsize=9)
        axis.tick_params(labelsize=7)
        if head % columns == 0:
            axis.set_ylabel("query position")
        if head // columns == rows - 1 or head + columns >= heads:
            axis.set_xlabel("key position")
    figure.colorbar(image, ax=axes.ravel().tolist(), label="bias added to the attention logit", shrink=0.9)
    masked = "; future keys (key > query) masked: causal" if causal else ""
    note = f"\n{ZERO_BIAS_NOTE}" if not shown.any() else ""  # in the title, where it covers no panel
    figure.suptitle(f"{scheme} logit bias per head, {length} positions\nquery x key{masked}{note}")
    return figure


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
    """Write ``figure`` to ``path`` atomically; a place that takes no file is one :class:`OutputError`."""
    import io

    from ..persistence.saving import OutputError, write_file_atomic

    path = Path(path)
    if figure.get_layout_engine() is None:
        figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, dpi=110, format=check_picture_path(path))
    _pyplot().close(figure)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, buffer.getvalue())
    except OSError as error:
        raise OutputError(f"Cannot write the picture {str(path)!r}: {error.strerror or error} (in "
                          f"{str(path.parent)!r}); choose another place.") from error
    return path


def check_picture_output(path: str | os.PathLike[str], flag: str = "--output") -> None:
    """A picture file that can be written: a supported suffix, an existing writable directory, and one that takes a
    new file under the temporary name the write uses (``/proc`` passes the permission check but takes none; a name
    near the file system's limit passes until the temporary name's extra characters); checked before anything is
    read or drawn."""
    from ..persistence.output_names import check_file_writable, check_output_given
    from ..persistence.saving import OutputError, check_output_file

    check_output_given(str(path), flag=flag, example="perplexity.png")
    if Path(path).is_dir():
        raise OutputError(f"{flag} {str(path)!r} is a directory; give a picture file name (e.g. "
                          f"{Path(path) / 'perplexity.png'}).")
    check_output_file(path, flag=flag)
    check_picture_path(path, flag=flag)
    check_file_writable(path, flag=flag)


PICTURE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")


def check_picture_path(path: str | os.PathLike[str], flag: str = "--output") -> str:
    """The picture format named by ``path``'s suffix; an unsupported one is refused before anything is drawn."""
    from ..errors import InvalidConfigError

    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in PICTURE_FORMATS:
        raise InvalidConfigError(f"{flag} {str(path)!r}: pictures are written as {', '.join(PICTURE_FORMATS)}; "
                                 "end the file name with one of them (e.g. perplexity.png).")
    return suffix
