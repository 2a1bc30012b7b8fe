"""bench_tiny's command line: a run end to end on tiny settings writes the table, the plot and the README section;
numbers, paths and devices that would fail after hours of training are refused before it; an earlier run's
results are kept unless told; --corpus-file carries one Python's text to another."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from hf_posswap.evaluation import corpus_text

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "benchmarks"), str(ROOT / "scripts" / "maintenance")]

import bench_tiny  # noqa: E402

TINY = ["--quick", "--schemes", "alibi", "--scalings", "--steps", "1", "--length", "16", "--trials", "1"]


@pytest.mark.slow
def test_bench_tiny_writes_table_plot_and_readme_section(tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- bench-tiny:start -->\nold\n<!-- bench-tiny:end -->\nafter\n", encoding="utf-8")
    out = tmp_path / "out"
    argv = ["--quick", "--schemes", "learned", "learned+concat", "alibi", "rope", "nope-interleaved", "--scalings",
            "yarn", "longrope", "self_extend", "--steps", "2", "--finetune-steps", "1", "--length", "16", "--trials",
            "1", "--seeds", "0", "1", "--jobs", "2", "--output-dir", str(out), "--readme", str(readme)]
    assert bench_tiny.main(argv) == 0
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert list(results["runs"]) == ["learned", "learned+concat", "alibi", "rope", "nope-interleaved",
                                     "rope+yarn (zero-shot)", "rope+yarn (fine-tuned)",
                                     "rope+longrope (zero-shot)", "rope+longrope (fine-tuned)",
                                     "rope+self_extend (zero-shot)", "rope+self_extend (fine-tuned)"]
    assert all(len(rows) == 2 for rows in results["runs"].values())  # one row per seed
    row = results["runs"]["alibi"][0]
    assert set(row["windows"]) == {"1", "2", "4", "8"} and set(row["tail"]) == {"2", "4", "8"}
    assert all(0.0 <= value <= 1.0 for value in row["passkey"].values())
    table = (out / "results.md").read_text(encoding="utf-8")
    assert "| rope+yarn (fine-tuned)" in table and "ppl 8x" in table and "passkey 8x" in table
    assert "| learned+concat" in table and "| nope-interleaved" in table
    assert "seeds 0, 1 (mean ± std)" in table and " ± " in table.split("| alibi")[1].splitlines()[0]
    assert (out / "bench_tiny.png").stat().st_size > 10_000
    text = readme.read_text(encoding="utf-8")
    assert "old" not in text and "| alibi" in text and text.endswith("<!-- bench-tiny:end -->\nafter\n")
    assert (tmp_path / "scripts" / "results" / "bench_tiny.png").exists()
    redrawn = tmp_path / "redrawn"
    assert bench_tiny.main(["--report", str(out / "results.json"), "--output-dir", str(redrawn)]) == 0
    assert (redrawn / "results.md").read_text(encoding="utf-8") == table


def test_bench_tiny_until_retrieval_needs_probes_and_a_larger_maximum(capsys) -> None:
    for argv in (["--until-retrieval", "20000"], ["--until-retrieval", "5000", "--probe-every", "1000"]):
        with pytest.raises(SystemExit) as stopped:
            bench_tiny.main(argv)
        assert stopped.value.code == 2 and "--until-retrieval" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--length", "8"], "--length 8: must be more than 8"),
    (["--jobs", "0"], "--jobs 0"),
    (["--lr", "-1"], "--lr -1.0"),
    (["--layers", "0"], "--layers 0: must be at least 1"),
    (["--weight-decay", "nan"], "--weight-decay nan: must be a number >= 0"),
    (["--synthetic", "1.5"], "--synthetic 1.5"),
    (["--decay-from", "1.5"], "--decay-from 1.5"),
    (["--curriculum", "0.9"], "--curriculum 0.9"),
    (["--curriculum", "-0.1"], "--curriculum -0.1"),
    (["--probe-every", "-5"], "--probe-every -5"),
    (["--confirm-retrieval", "0"], "--confirm-retrieval 0: must be at least 1"),
    (["--confirm-retrieval", "2"], "more than 1 only with --until-retrieval"),
    (["--seeds", "2", "2"], "a seed is given twice"),
    (["--schemes", "alibi", "alibi"], "a run is given twice"),
], ids=["steps", "length", "jobs", "lr", "layers", "weight-decay", "synthetic",
        "decay-from", "curriculum-late", "curriculum-negative",
        "probe-every", "confirm-retrieval-zero", "confirm-retrieval-alone", "seeds", "schemes"])
def test_bench_tiny_refuses_bad_numbers_before_training(argv: list[str], says: str, capsys) -> None:
    tiny = ["--quick", "--steps", "1", "--length", "16", "--trials", "1", "--scalings", "--schemes", "alibi"]
    with pytest.raises(SystemExit) as stopped:  # a check that misses would train a tiny model, not hang the tests
        bench_tiny.main([*tiny, *argv, "--output-dir", "/nonexistent/never-written"])
    assert stopped.value.code == 2 and says in capsys.readouterr().err


def test_bench_tiny_corpus_file_carries_the_text_to_another_python(tmp_path, monkeypatch, capsys) -> None:
    """Seeds run under another Python (a GPU machine's 3.12) read this Python's topics from a file: the text comes
    back byte for byte with the same fingerprint, training reads it (not the running Python's), results record it,
    and bad files are refused in one line before training."""
    path = tmp_path / "topics.txt"
    assert bench_tiny.main(["--write-corpus", str(path)]) == 0
    native = corpus_text("pydoc")
    assert bench_tiny.read_corpus_file(path) == native and path.read_bytes() == native.encode("utf-8")
    assert f"corpus {bench_tiny.corpus_fingerprint()}" in capsys.readouterr().out
    other = tmp_path / "other.txt"
    other.write_bytes(("Another Python's topics.\r\n" + native[:200_000]).encode("utf-8"))  # \r kept as written
    text = bench_tiny.read_corpus_file(other)
    assert text.startswith("Another Python's topics.\r\n")
    seen = []

    def split(tokenizer, text=None):
        seen.append(text)
        return real_split(tokenizer, text)

    real_split = bench_tiny.corpus_split
    monkeypatch.setattr(bench_tiny, "corpus_split", split)
    out = tmp_path / "out"
    argv = ["--quick", "--schemes", "alibi", "rope", "--scalings", "yarn", "--steps", "1", "--finetune-steps", "1",
            "--length", "16", "--trials", "1", "--corpus-file", str(other), "--output-dir", str(out)]
    assert bench_tiny.main(argv) == 0
    assert len(seen) == 4 and all(found == text for found in seen)  # the length check, two runs and the scaling
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert results["corpus"] == bench_tiny.corpus_fingerprint(text) != bench_tiny.corpus_fingerprint()
    short, binary = tmp_path / "short.txt", tmp_path / "binary.txt"
    short.write_text("too short", encoding="utf-8")
    binary.write_bytes(b"\xff\xfe" * 100_000)
    for bad, says in ((tmp_path / "missing.txt", "cannot read"), (short, "too short"), (binary, "as UTF-8")):
        with pytest.raises(SystemExit) as stopped:
            bench_tiny.main([*argv[:-2], "--corpus-file", str(bad), "--output-dir", str(tmp_path / "never")])
        assert stopped.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    with pytest.raises(SystemExit) as stopped:  # a directory where the file should go: one line, nothing left
        bench_tiny.main(["--write-corpus", str(tmp_path)])
    assert stopped.value.code == 2 and "--write-corpus" in capsys.readouterr().err
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("extra, says", [
    (["--output-dir", "FILE"], "--output-dir"), (["--readme", "missing.md"], "--readme missing.md"),
    (["--readme", "plain.md"], "markers"), (["--device", "foo"], "--device foo"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "foo"], "--device"),
    (["--seeds", str(2**40)], "--seeds"), (["--length", "300000"], "holds no window"),
    (["--schemes", "alibi", "--scalings", "yarn"], "add rope to --schemes"),
    (["--decay-from", "nan"], "--decay-from nan"),
], ids=["output-dir-is-a-file", "readme-missing", "readme-without-markers", "device", "no-cuda", "seed",
        "length", "scalings-without-rope", "decay-from-nan"])
def test_bench_tiny_refuses_before_training_what_would_fail_after_it(extra, says, tmp_path, monkeypatch,
                                                                     capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("x", encoding="utf-8")
    (tmp_path / "plain.md").write_text("# no markers\n", encoding="utf-8")
    with pytest.raises(SystemExit) as stopped:
        bench_tiny.main([*TINY, "--output-dir", "out", *extra])
    assert stopped.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "out" / "partial.json").exists()


def test_bench_tiny_keeps_an_earlier_runs_results_unless_told(tmp_path, capsys) -> None:
    """A rerun into the same --output-dir replaced a stopped run's partial.json (its rows lost); --report with its
    output as one of its inputs overwrote that input; --write-corpus replaced any file (a device too)."""
    out = tmp_path / "out"
    assert bench_tiny.main([*TINY, "--output-dir", str(out)]) == 0
    with pytest.raises(SystemExit) as stopped:
        bench_tiny.main([*TINY, "--output-dir", str(out)])
    assert stopped.value.code == 2 and "--overwrite-output-dir" in capsys.readouterr().err
    assert bench_tiny.main([*TINY, "--output-dir", str(out), "--overwrite-output-dir"]) == 0
    before = (out / "results.json").read_bytes()
    with pytest.raises(SystemExit) as stopped:
        bench_tiny.main(["--report", str(out / "results.json"), "--output-dir", str(out)])
    assert stopped.value.code == 2 and (out / "results.json").read_bytes() == before
    precious = tmp_path / "topics.txt"
    precious.write_text("carried from another Python", encoding="utf-8")
    with pytest.raises(SystemExit) as stopped:
        bench_tiny.main(["--write-corpus", str(precious)])
    assert stopped.value.code == 2 and precious.read_text(encoding="utf-8") == "carried from another Python"


def test_bench_tiny_weight_decay_reaches_the_optimizer_and_the_table(tmp_path, monkeypatch) -> None:
    seen = []
    adamw = torch.optim.AdamW

    def recording(params, **options):
        seen.append(options["weight_decay"])
        return adamw(params, **options)

    monkeypatch.setattr(torch.optim, "AdamW", recording)
    tiny = ["--quick", "--steps", "2", "--length", "16", "--trials", "1", "--scalings", "--schemes", "alibi",
            "--weight-decay", "0.2", "--output-dir", str(tmp_path)]
    assert bench_tiny.main(tiny) == 0
    assert seen == [0.2] and "lr 0.003, weight decay 0.2)" in (tmp_path / "results.md").read_text(encoding="utf-8")
