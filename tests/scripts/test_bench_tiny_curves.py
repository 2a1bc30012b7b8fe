"""Protocol A's learning curves: the n-gram references are right on texts whose answer is known, are read on the
text the probes read, and the report draws the curves only from runs that have probes."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from hf_posswap.evaluation import byte_tokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))

import bench_tiny_curves  # noqa: E402
import bench_tiny_report  # noqa: E402
import bench_tiny_training  # noqa: E402


def test_ngram_references_know_what_each_order_can_see() -> None:
    # "aabb" repeated: the byte before the last one tells the next (aa->b, ab->b, bb->a, ba->a); the last one alone
    # leaves two choices. So bigram perplexity is 2 and trigram perplexity 1, up to the smoothing and the one
    # bigram-scored byte at each window's start.
    result = bench_tiny_curves.ngram_perplexities("aabb" * 20_000, 64, orders=(1, 2, 3))
    assert result[1] == pytest.approx(2.0, rel=0.01)
    assert result[2] == pytest.approx(2.0, rel=0.01)
    assert result[3] == pytest.approx(2.0 ** (1 / 63), rel=0.01)  # 1 of 63 targets per window is bigram-scored


def test_ngram_references_refuse_a_text_too_short_for_the_probe_windows() -> None:
    with pytest.raises(ValueError, match="shorter than 8 windows of 256"):
        bench_tiny_curves.ngram_perplexities("abc" * 1000, 256)


def test_ngram_references_read_the_text_the_probes_read() -> None:
    # The byte tokenizer gives one token per UTF-8 byte, one id per byte value: the n-gram counts over bytes are the
    # counts over the models' tokens, and the held-out cut falls at the same place.
    text = "def f(x):\n    return 'héllo ✓' * 2  # ünïcode\n" * 500
    tokenizer = byte_tokenizer()
    train_ids, heldout_ids = bench_tiny_training.corpus_split(tokenizer, text)
    data = text.encode("utf-8")
    cut = int((1 - bench_tiny_curves.HELDOUT_SHARE) * len(data))
    assert (len(train_ids), len(heldout_ids)) == (cut, len(data) - cut)
    pairs = set(zip(data, [*train_ids.tolist(), *heldout_ids.tolist()], strict=True))
    assert len(pairs) == len({byte for byte, _ in pairs}) == len({token for _, token in pairs})
    assert bench_tiny_curves.PROBE_WINDOWS == bench_tiny_training.PROBE_WINDOWS


def results_with(probes: dict[str, list | None], corpus: str = "f" * 16) -> dict:
    return {"settings": {"length": 64}, "corpus": corpus, "runs": {
        label: [{"seed": 0, **({"probe": probe} if probe is not None else {})}] for label, probe in probes.items()}}


def test_the_report_draws_curves_only_from_runs_with_probes(tmp_path, monkeypatch) -> None:
    drawn = {}
    monkeypatch.setattr(bench_tiny_report, "plot_curves",
                        lambda results, path, references: drawn.update(runs=list(results["runs"]), refs=references))
    assert bench_tiny_report.learning_curves(results_with({"alibi": None}), tmp_path / "c.png") is None
    assert not drawn
    bench_tiny_report.learning_curves(results_with({"alibi": None, "none": [[1000, 0.0, 13.0, 12.0]]}),
                                      tmp_path / "c.png")
    assert drawn["refs"] is None  # the results read other text than this Python's topics: no references


def test_the_references_come_with_results_measured_on_this_pythons_topics(tmp_path, monkeypatch) -> None:
    drawn = {}
    monkeypatch.setattr(bench_tiny_report, "plot_curves",
                        lambda results, path, references: drawn.update(refs=references))
    corpus = bench_tiny_training.corpus_fingerprint()
    bench_tiny_report.learning_curves(results_with({"none": [[1000, 0.0, 13.0, 12.0]]}, corpus), tmp_path / "c.png")
    assert set(drawn["refs"]) == {2, 3} and drawn["refs"][3] < drawn["refs"][2]
    too_long = results_with({"none": [[1000, 0.0, 13.0, 12.0]]}, corpus)
    too_long["settings"]["length"] = 10**6  # more than the held-out text holds: curves, no references, no traceback
    bench_tiny_report.learning_curves(too_long, tmp_path / "c.png")
    assert drawn["refs"] is None


def test_curves_are_drawn_with_a_diverged_run_among_them(tmp_path) -> None:
    results = results_with({"none": [[1000, 0.0, 13.0, 12.0], [2000, 0.25, 9.0, 8.0]],
                            "alibi": [[1000, 0.0, math.nan, math.nan]]})
    results["runs"]["none"].append({"seed": 1})  # a seed run without --probe-every, merged with one run with it
    path = bench_tiny_curves.plot_curves(results, tmp_path / "curves.png", {2: 13.3, 3: 6.4})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
