"""Settings that would be ignored or computed twice are refused before any work; `plot` reads only results it can
draw truthfully (rows in range, one passkey cell per length and depth), names each tail run's own scoring start,
draws a passkey-only result's heatmap, and says in one line when it cannot write a picture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import byte_tokenizer
from torch import nn

import hf_posswap as ps
from hf_posswap.cli.main import main
from hf_posswap.evaluation import evaluate
from hf_posswap.evaluation.plots import load_runs, perplexity_figure, plot_passkey
from hf_posswap.persistence.saving import OutputError


class NoForward(nn.Module):
    """A model that must not run: every setting below is refused first."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor):
        raise AssertionError("a forward pass ran before the bad setting was refused")


@pytest.mark.parametrize(("settings", "message"), [
    ({"stride": 16}, r"--stride 16 \(stride\) applies to the sliding mode only, and the modes are windows; add "
                     r"--mode sliding, or drop --stride"),
    ({"modes": ["windows", "sliding"], "tail_from": 16},
     r"--tail-from 16 \(tail_from\) applies to the tail mode only.*add --mode tail, or drop --tail-from"),
    ({"lengths": [32, 64, 32]}, r"Perplexity lengths \(--lengths\) repeat 32; give each value once"),
    ({"modes": ["windows", "windows"]}, r"Perplexity modes \(--mode\) repeat 'windows'"),
    ({"passkey_lengths": [120, 120]}, r"Passkey lengths \(--passkey-lengths\) repeat 120"),
    ({"passkey_lengths": [120], "depths": [0.5, 0.0, 0.5]}, r"Passkey depths \(--depths\) repeat 0.5"),
], ids=["stride-without-sliding", "tail-from-without-tail", "repeated-length", "repeated-mode",
        "repeated-passkey-length", "repeated-depth"])
def test_ignored_or_repeated_settings_are_refused_before_any_work(settings: dict, message: str) -> None:
    """A --stride without sliding changes nothing; a repeated length is measured twice and a repeated passkey cell
    drawn over its twin."""
    with pytest.raises(ps.InvalidConfigError, match=message):
        evaluate(NoForward(), byte_tokenizer(), **{"lengths": [32], "corpus": "pydoc", "progress": False, **settings})


def _tail(start: int, values: dict[int, float]) -> dict:
    return {"perplexity": [{"length": n, "mode": "tail", "perplexity": p, "tail_from": start}
                           for n, p in values.items()], "passkey": []}


def test_tail_runs_scored_from_different_starts_each_name_their_own() -> None:
    """An extended model scored from its trained length (8,192) against its base scored from 2,048: one axis label
    claiming a shared start would misstate one of them."""
    runs = {"base": _tail(2048, {4096: 30.0, 16384: 400.0}), "yarn": _tail(8192, {16384: 9.0, 32768: 11.0})}
    (axis,) = perplexity_figure(runs, mode="tail").axes
    assert [line.get_label() for line in axis.get_lines()] == ["base (positions from 2,048 on)",
                                                              "yarn (positions from 8,192 on)"]
    assert axis.get_ylabel() == "perplexity (tail: each run from its own start)"
    (axis,) = perplexity_figure({"yarn": runs["yarn"]}, mode="tail").axes  # one start: said once, on the axis
    assert axis.get_ylabel() == "perplexity (positions from 8,192 on)"
    assert [line.get_label() for line in axis.get_lines()] == ["yarn"]


def _passkey_only(path: Path) -> Path:
    path.write_text(json.dumps({"perplexity": [], "passkey": [{"length": 120, "depth": d, "accuracy": a, "trials": 1}
                                                               for d, a in ((0.0, 1.0), (1.0, 0.0))]}))
    return path


def test_a_passkey_only_result_draws_its_heatmap(tmp_path, capsys) -> None:
    """`eval --passkey-lengths ...` alone holds no perplexity rows: no --mode can draw them, the heatmap can."""
    results = _passkey_only(tmp_path / "pk.json")
    assert main(["plot", str(results), "--output", str(tmp_path / "p.png"), "--passkey-output",
                 str(tmp_path / "k.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"skipped {tmp_path / 'p.png'}: the results hold no perplexity rows (eval ran without --lengths)",
                   f"wrote {tmp_path / 'k.png'}"]
    assert (tmp_path / "k.png").read_bytes().startswith(b"\x89PNG") and not (tmp_path / "p.png").exists()


def test_a_passkey_only_result_without_a_heatmap_asked_for_says_how_to_draw_it(tmp_path, capsys) -> None:
    results = _passkey_only(tmp_path / "pk.json")
    assert main(["plot", str(results), "--output", str(tmp_path / "p.png")]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "no perplexity rows to draw (eval ran without --lengths); draw the passkey results with " \
           "--passkey-output passkey.png" in line


@pytest.mark.parametrize(("rows", "message"), [
    ([{"length": 100, "depth": 0.5, "accuracy": 7}], r"passkey row \{'length': 100, 'depth': 0.5, 'accuracy': 7\} "
                                                     r"needs .*an accuracy in \[0, 1\]"),
    ([{"length": 100, "depth": 5, "accuracy": 1.0}], r"passkey row \{'length': 100, 'depth': 5, .*in \[0, 1\]"),
    ([{"length": float("inf"), "depth": 0.5, "accuracy": 1.0}], r"passkey row \{'length': inf.*finite positive"),
    ([{"length": 100, "depth": 0.5, "accuracy": 1.0}, {"length": 100, "depth": 0.5, "accuracy": 0.0}],
     r"2 passkey rows at length 100, depth 0.5, and the heatmap has one cell for them"),
], ids=["accuracy-7", "depth-5", "infinite-length", "repeated-cell"])
def test_passkey_rows_that_cannot_be_drawn_truthfully_are_refused_naming_file_and_row(tmp_path, rows,
                                                                                      message) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"perplexity": [{"length": 64, "mode": "windows", "perplexity": 3.0}],
                                "passkey": rows}))
    with pytest.raises(ps.InvalidConfigError, match=rf"'{path}': {message}"):
        load_runs([str(path)], mode="windows", passkey=True)
    assert load_runs([str(path)], mode="windows")  # a perplexity picture alone draws none of those rows


def test_a_perplexity_row_of_infinite_length_is_refused_naming_it(tmp_path) -> None:
    path = tmp_path / "inf.json"
    path.write_text(json.dumps({"perplexity": [{"length": float("inf"), "mode": "windows", "perplexity": 3.0}],
                                "passkey": []}))
    with pytest.raises(ps.InvalidConfigError, match=r"perplexity row \{'length': inf, .*needs a finite positive"):
        load_runs([str(path)])


def test_a_picture_that_cannot_be_written_is_one_error_naming_it(tmp_path) -> None:
    """/proc passes a permission check but takes no new file: the error names the picture, not a temporary file."""
    results = {"passkey": [{"length": 120, "depth": 0.5, "accuracy": 1.0}]}
    with pytest.raises(OutputError, match=r"Cannot write the picture '/proc/x.png': .*; choose another place"):
        plot_passkey(results, "/proc/x.png")
