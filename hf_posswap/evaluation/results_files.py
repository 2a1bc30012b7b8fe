"""The results files `hf-posswap plot` draws (what `hf-posswap eval --output` writes), read and checked: every row
that would be drawn is a valid one, and a bad one is refused naming the file and the row."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import InvalidConfigError


def load_runs(paths: Sequence[str], mode: str | None = None, passkey: bool = False) -> dict[str, dict[str, Any]]:
    """``label=results.json`` (or just the path) -> {label: results}. A missing or malformed file, a bad row, or
    (with ``mode``) a run whose perplexity rows are all of other modes, is refused with its name; with ``passkey``,
    the first run (whose heatmap is drawn) must hold passkey rows."""
    from ..persistence.user_files import read_json

    runs: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    for item in paths:
        label, sep, path = item.partition("=")
        if not sep or Path(item).exists():
            label, path = Path(item).stem, item
        _check_run(item, label, path)
        if label in runs:
            raise InvalidConfigError(
                f"Two runs are labelled {label!r} ({sources[label]!r} and {path!r}), and a picture tells runs apart "
                f"by label; name them: {label}-a={sources[label]} {label}-b={path}."
            )
        results = read_json(Path(path), flag="results", fix="restore the file or run hf-posswap eval again")
        _missing_as_nan(results)
        _check_perplexity_rows(results, path, mode)
        if passkey and not runs:  # the first run's passkey rows are drawn: only they must make a heatmap
            check_passkey_rows(results, repr(path), required=True)
        runs[label], sources[label] = results, path
    return runs


def _check_run(item: str, label: str, path: str) -> None:
    """A run names an existing results file, with a label that is not empty (``=r.json`` would draw an unnamed
    line)."""
    if not label.strip():
        raise InvalidConfigError(f"Run {item!r} has an empty label; write label=results.json (e.g. "
                                 f"mine={path or 'results.json'}), or the file alone to be labelled by its name.")
    if Path(path).is_dir():
        raise InvalidConfigError(f"Results file {path!r} is a directory; pass the results file in it (the --output "
                                 f"of hf-posswap eval, e.g. {Path(path) / 'results.json'}).")
    if not Path(path).is_file():
        raise InvalidConfigError(f"Results file {path!r} does not exist; pass the --output of hf-posswap eval.")


def _missing_as_nan(results: dict[str, Any]) -> None:
    """A perplexity written as ``null`` (eval writes non-finite numbers so, as JSON has no NaN) is read as NaN: a
    point the picture names and leaves out, as files written with a bare ``NaN`` were read."""
    rows = results.get("perplexity")
    for row in rows if isinstance(rows, list) else ():
        if isinstance(row, dict) and "perplexity" in row and row["perplexity"] is None:
            row["perplexity"] = math.nan


def has_perplexity(runs: dict[str, dict[str, Any]]) -> bool:
    """Whether any run holds perplexity rows (a passkey-only eval holds none)."""
    return any(results["perplexity"] for results in runs.values())


def number(value: Any) -> bool:
    """A JSON number (``true`` is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_row(row: Any) -> bool:
    """A perplexity row: a finite positive length, a mode name and a numeric perplexity (``inf`` and ``nan``
    perplexities are rows: the picture names them as points it cannot draw)."""
    return (isinstance(row, dict) and number(row.get("length")) and math.isfinite(row["length"])
            and row["length"] > 0 and isinstance(row.get("mode"), str) and number(row.get("perplexity")))


def _check_perplexity_rows(results: dict[str, Any], path: str, mode: str | None) -> None:
    rows = results.get("perplexity")
    if not isinstance(rows, list):
        raise InvalidConfigError(f"{path!r} is not an hf-posswap eval results file (needs a 'perplexity' list of "
                                 "rows with numeric length and perplexity and a mode).")
    bad = next((row for row in rows if not _is_row(row)), None)
    if bad is not None:
        raise InvalidConfigError(f"{path!r} is not an hf-posswap eval results file: perplexity row {bad!r} needs a "
                                 "finite positive length, a numeric perplexity and a mode; restore the file or run "
                                 "eval again.")
    if mode is not None and rows and not any(r["mode"] == mode for r in rows):
        found = sorted({str(r["mode"]) for r in rows})
        raise InvalidConfigError(f"{path!r} has no perplexity rows of mode {mode!r} (it has: {', '.join(found)}); "
                                 "pass --mode with one of those.")


def _is_passkey_row(row: Any) -> bool:
    """A passkey row: a finite positive length, a depth and an accuracy in [0, 1]."""
    return (isinstance(row, dict) and all(number(row.get(key)) for key in ("length", "depth", "accuracy"))
            and math.isfinite(row["length"]) and row["length"] > 0
            and 0.0 <= row["depth"] <= 1.0 and 0.0 <= row["accuracy"] <= 1.0)


def check_passkey_rows(results: dict[str, Any], where: str, required: bool) -> None:
    """The passkey rows of ``results`` can be drawn: numbers in range, one row per length and depth; ``required``:
    there must be some. ``where`` names the results in a refusal (the file, quoted)."""
    rows = results.get("passkey")
    if rows is None or (isinstance(rows, list) and not rows):
        if required:
            raise InvalidConfigError(f"{where} has no passkey results to draw; run eval with --passkey-lengths.")
        return
    if not isinstance(rows, list):
        raise InvalidConfigError(f"{where}: 'passkey' must be a list of rows, got {type(rows).__name__}; restore "
                                 "the file or run eval again.")
    bad = next((row for row in rows if not _is_passkey_row(row)), None)
    if bad is not None:
        raise InvalidConfigError(f"{where}: passkey row {bad!r} needs a finite positive length, and a depth and an "
                                 "accuracy in [0, 1]; restore the file or run eval again.")
    cells = [(row["length"], row["depth"]) for row in rows]
    repeated = next((cell for cell in cells if cells.count(cell) > 1), None)
    if repeated is not None:
        raise InvalidConfigError(f"{where}: {cells.count(repeated)} passkey rows at length {repeated[0]}, depth "
                                 f"{repeated[1]}, and the heatmap has one cell for them; keep one row per length and "
                                 "depth (eval refuses repeated --passkey-lengths and --depths).")
