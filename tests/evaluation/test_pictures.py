"""The pictures explain themselves: the Figure objects that plots.py builds carry axis labels, a labelled colour bar,
one colour scale shared by all heads, the causal mask, a note on all-zero tables, one line per measure with a
legend and plain tick labels; a run with nothing to draw is reported, not drawn silently."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import save_tiny_checkpoint

import hf_posswap as ps
from hf_posswap.errors import InvalidConfigError
from hf_posswap.evaluation import plots
from hf_posswap.evaluation.plots import EmptyRunWarning, bias_figure, perplexity_figure


@pytest.fixture()
def figures(monkeypatch) -> list:
    """The figures position_pictures builds, captured instead of written."""
    built = []

    def keep(figure, path):
        built.append(figure)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    return built


def _images(figure) -> list:
    return [axis.images[0] for axis in figure.axes if axis.images and axis.get_visible()]


def _colorbar_label(figure) -> str:
    bars = [axis for axis in figure.axes if axis.get_label() == "<colorbar>"]
    assert len(bars) == 1
    return bars[0].get_ylabel()


def _tiny(family: str, scheme: str, tmp_path):
    from transformers import AutoModel, AutoModelForCausalLM

    loader = AutoModel if family == "bert" else AutoModelForCausalLM
    model = loader.from_pretrained(save_tiny_checkpoint(family, tmp_path / family))
    ps.swap(model, scheme)
    return model


def test_alibi_heads_share_one_labelled_scale_and_mask_the_future(tmp_path, figures) -> None:
    model = _tiny("llama", "alibi", tmp_path)
    plots.position_pictures(model, tmp_path / "pictures", length=24)
    (figure,) = figures
    images = _images(figure)
    heads = model.config.num_attention_heads
    assert len(images) == heads > 1
    assert len({id(image.norm) for image in images}) == 1  # one shared scale, not one per panel
    steepest = min(float(image.get_array().min()) for image in images)
    assert images[0].norm.vmin == pytest.approx(steepest) and images[0].norm.vmax == pytest.approx(0.0)
    assert _colorbar_label(figure) == "bias added to the attention logit"
    panels = [axis for axis in figure.axes if axis.images]
    assert all(axis.get_xlabel() == "key position" for axis in panels if axis.get_subplotspec().is_last_row())
    assert all(axis.get_ylabel() == "query position" for axis in panels if axis.get_subplotspec().is_first_col())
    future = np.triu(np.ones((24, 24), dtype=bool), k=1)
    for image in images:
        assert np.array_equal(np.ma.getmaskarray(image.get_array()), future)  # key > query: masked
    assert "masked" in figure._suptitle.get_text()


def test_bidirectional_bias_is_not_masked(tmp_path, figures) -> None:
    plots.position_pictures(_tiny("bert", "alibi", tmp_path), tmp_path / "pictures", length=16)
    (figure,) = figures
    assert not any(np.ma.getmaskarray(image.get_array()).any() for image in _images(figure))
    assert "masked" not in figure._suptitle.get_text()


def test_untrained_t5_says_its_tables_are_zero(tmp_path, figures) -> None:
    model = _tiny("llama", "t5", tmp_path)
    plots.position_pictures(model, tmp_path / "pictures", length=16)
    assert "tables are zero until trained" in figures[0]._suptitle.get_text()
    assert [t for t in figures[0].texts if t is not figures[0]._suptitle] == []  # no box over the panels
    with torch.no_grad():
        model.model.posswap_positions.tables[0].weight.normal_()
    plots.position_pictures(model, tmp_path / "pictures", length=16)
    assert "zero until trained" not in figures[1]._suptitle.get_text()


def test_one_scale_across_heads_of_different_ranges() -> None:
    bias = torch.stack([torch.full((4, 4), -1.0), torch.full((4, 4), -8.0), torch.full((4, 4), 2.0)])
    figure = bias_figure(bias, "made up", causal=False)
    norms = {(image.norm.vmin, image.norm.vmax) for image in _images(figure)}
    assert norms == {(-8.0, 2.0)}


def _run(windows: dict[int, float], tail: dict[int, float], tail_from: int = 8192) -> dict:
    rows = [{"length": n, "mode": "windows", "perplexity": p} for n, p in windows.items()]
    rows += [{"length": n, "mode": "tail", "perplexity": p, "tail_from": tail_from} for n, p in tail.items()]
    return {"perplexity": rows, "passkey": []}


def test_mixed_measures_are_separate_labelled_lines_with_plain_ticks() -> None:
    runs = {"no scaling": _run({4096: 8.57, 12288: 14.0}, {12288: 10.72}),
            "yarn": _run({4096: 9.37, 12288: 8.1}, {12288: 6.35})}
    figure = perplexity_figure(runs, mode=None, trained_length=8192, title="t")
    (axis,) = figure.axes
    lines = {line.get_label(): list(line.get_xdata()) for line in axis.get_lines()}
    assert lines == {"no scaling: whole window": [4096, 12288], "no scaling: positions from 8,192 on": [12288],
                     "yarn: whole window": [4096, 12288], "yarn: positions from 8,192 on": [12288],
                     "trained length (8,192)": [8192, 8192]}
    assert [text.get_text() for text in axis.get_legend().get_texts()] == list(lines)
    assert axis.get_ylabel() == "perplexity" and "mixed" not in axis.get_ylabel()
    figure.canvas.draw()
    assert [t.get_text() for t in axis.get_xticklabels()] == ["4,096", "8,192", "12,288"]
    y_labels = [t.get_text() for t in axis.get_yticklabels() if t.get_text()]
    assert y_labels and all(label.replace(",", "").replace(".", "").isdigit() for label in y_labels)


def test_one_measure_names_it_on_the_axis() -> None:
    runs = {"a": _run({512: 20.0, 1024: 30.0, 4096: 400.0}, {}), "b": _run({512: 25.0, 1024: 28.0}, {})}
    figure = perplexity_figure(runs, mode="windows")
    (axis,) = figure.axes
    assert axis.get_ylabel() == "perplexity (whole window)" and axis.get_yscale() == "log"
    assert [line.get_label() for line in axis.get_lines()] == ["a", "b"]
    figure.canvas.draw()
    assert all("$" not in t.get_text() for t in axis.get_yticklabels())  # no 10^x mathtext


def test_a_run_with_nothing_to_draw_is_reported() -> None:
    runs = {"good": _run({}, {128: 5.0, 256: 7.0}, tail_from=64), "broken": _run({64: 3.0}, {128: math.nan})}
    with pytest.warns(EmptyRunWarning, match="'broken' has no tail perplexity rows"):
        figure = perplexity_figure(runs, mode="tail")
    assert [line.get_label() for line in figure.axes[0].get_lines()] == ["good"]
    with pytest.raises(InvalidConfigError, match="nothing to draw"):
        perplexity_figure({"broken": runs["broken"]}, mode="tail")


def _tail_runs(tmp_path) -> None:
    (tmp_path / "good.json").write_text(json.dumps(_run({}, {128: 5.0, 256: 7.0}, tail_from=64)))
    (tmp_path / "broken.json").write_text(json.dumps(_run({64: 3.0}, {128: math.nan})))


def test_plot_mode_tail_warns_about_a_run_without_points(tmp_path) -> None:
    from hf_posswap.cli.main import main

    _tail_runs(tmp_path)
    with pytest.warns(EmptyRunWarning, match="'broken' has no tail perplexity rows"):
        assert main(["plot", f"good={tmp_path / 'good.json'}", f"broken={tmp_path / 'broken.json'}", "--mode", "tail",
                     "--output", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_plot_cli_shows_the_warning_on_stderr(tmp_path) -> None:
    _tail_runs(tmp_path)
    result = subprocess.run([sys.executable, "-m", "hf_posswap", "plot", f"good={tmp_path / 'good.json'}",
                             f"broken={tmp_path / 'broken.json'}", "--mode", "tail", "--output",
                             str(tmp_path / "p.png")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "'broken' has no tail perplexity rows" in result.stderr and "left out of the picture" in result.stderr
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


def test_the_passkey_heatmap_names_its_run(tmp_path, figures) -> None:
    import json

    from hf_posswap.cli import main

    run = _run({512: 20.0}, {})
    run["passkey"] = [{"length": 512, "depth": d, "accuracy": a} for d, a in ((0.0, 1.0), (0.5, 0.4))]
    (tmp_path / "yarn-32k.json").write_text(json.dumps(run))
    assert main(["plot", str(tmp_path / "yarn-32k.json"), "--output", str(tmp_path / "ppl.png"),
                 "--passkey-output", str(tmp_path / "passkey.png")]) == 0
    assert figures[-1].axes[0].get_title() == "Passkey retrieval: yarn-32k"


def test_measured_values_are_written_where_they_were_measured() -> None:
    runs = {"no scaling": _run({4096: 8.57, 12288: 8.6}, {12288: 10.72}), "yarn": _run({4096: 9.37, 12288: 7.8}, {})}
    (axis,) = perplexity_figure(runs, mode=None, trained_length=8192).axes
    written = sorted((text.xy, text.get_text()) for text in axis.texts)
    assert written == [((4096, 8.57), "8.57"), ((4096, 9.37), "9.37"), ((12288, 7.8), "7.80"),
                       ((12288, 8.6), "8.60"), ((12288, 10.72), "10.72")]  # nothing at 8,192, where lines cross


def test_a_run_that_loses_some_points_says_which() -> None:
    """A model that blows up at long lengths must not look like a line that simply ends early."""
    runs = {"blows up": _run({64: 5.0, 128: math.inf, 256: math.nan}, {})}
    expected = r"'blows up': perplexity inf at 128 tokens \(windows\), nan at 256 tokens"
    with pytest.warns(EmptyRunWarning, match=expected):
        figure = perplexity_figure(runs, mode="windows")
    assert [list(line.get_xdata()) for line in figure.axes[0].get_lines()] == [[64]]


def test_two_runs_with_one_label_are_refused_not_merged(tmp_path) -> None:
    """``a/results.json`` and ``b/results.json`` are both labelled ``results`` by default: the second would replace
    the first without a word."""
    for folder, value in (("a", 5.0), ("b", 9.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "results.json").write_text(json.dumps(_run({64: value}, {})))
    first, second = str(tmp_path / "a" / "results.json"), str(tmp_path / "b" / "results.json")
    with pytest.raises(InvalidConfigError, match=r"Two runs are labelled 'results'.*name them: results-a="):
        plots.load_runs([first, second])
    assert list(plots.load_runs([f"a={first}", f"b={second}"])) == ["a", "b"]


def test_the_heatmap_may_not_replace_the_perplexity_picture(tmp_path, capsys) -> None:
    from hf_posswap.cli.main import main

    results = tmp_path / "r.json"
    results.write_text(json.dumps({**_run({64: 5.0}, {}), "passkey": [{"length": 64, "depth": 0.5, "accuracy": 1}]}))
    picture = str(tmp_path / "p.png")
    assert main(["plot", str(results), "--output", picture, "--passkey-output", picture]) == 1
    assert "is also --output" in capsys.readouterr().err and not (tmp_path / "p.png").exists()
