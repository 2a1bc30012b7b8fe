"""What bench_tiny makes of its results (bench_tiny_report): the table and its caption, results of several runs
merged (seeds, machines, settings added later, corpora), a run's results split into parts, --report's refusals
of bad results, and the README section it writes."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "benchmarks"), str(ROOT / "scripts" / "maintenance")]

import bench_tiny  # noqa: E402
import bench_tiny_report  # noqa: E402
from readme_section import replace_section  # noqa: E402

DEFAULTS = dataclasses.asdict(bench_tiny.Settings())  # what --report fills into results older than a setting


def test_bench_tiny_table_shows_the_steps_each_run_took() -> None:
    settings = {**DEFAULTS, "until_retrieval": 300, "steps": 100}
    row = {"windows": {"1": 4.0}, "tail": {}, "passkey": {"1": 1.0}}
    table = bench_tiny_report.markdown({"settings": {**settings, "factors": [1], "seeds": [0, 1]}, "runs": {
        "alibi": [{**row, "steps": 120}, {**row, "steps": 140}], "fire": [{**row, "steps": 300}] * 2,
        "rope": [{**row, "steps": 200}, {**row, "steps": 260}], "rope+yarn (zero-shot)": [row, row]}})
    assert "at most 300, column `steps`" in table and "| run | steps | ppl 1x |" in table
    assert "| alibi | 130 ± 14 | 4.00 ± 0.00 |" in table and "| fire | 300 ± 0 |" in table
    assert "| rope+yarn (zero-shot) | 230 ± 42 |" in table  # the RoPE model it extends trained that long


def test_bench_tiny_report_merges_seeds_in_order() -> None:
    def part(seed: int, ppl: float) -> dict:
        row = {"windows": {"1": ppl}, "passkey": {"1": 1.0}}
        return {"settings": {"length": 16, "seeds": [seed]}, "runs": {"rope": [row]}, "seconds": 10.0,
                "command": f"python scripts/benchmarks/bench_tiny.py --seeds {seed}", "versions": {}}

    merged = bench_tiny_report.merge([part(1, 5.0), part(0, 4.0)], DEFAULTS)
    assert merged["settings"]["seeds"] == [0, 1] and merged["seconds"] == 20.0
    assert [r["windows"]["1"] for r in merged["runs"]["rope"]] == [4.0, 5.0]
    other = part(2, 6.0)
    other["settings"]["length"] = 32
    with pytest.raises(SystemExit, match="differ in settings other than seeds"):
        bench_tiny_report.merge([part(0, 4.0), other], DEFAULTS)


def test_bench_tiny_report_merges_other_runs_of_one_seed_and_refuses_repeats() -> None:
    def part(label: str, ppl: float) -> dict:
        row = {"windows": {"1": ppl}, "tail": {}, "passkey": {"1": 1.0}}
        return {"settings": {**DEFAULTS, "seeds": [2], "factors": [1]}, "runs": {label: [row]}, "seconds": 1.0,
                "command": label}

    merged = bench_tiny_report.merge([part("fire", 4.0), part("sandwich", 5.0)], DEFAULTS)
    assert merged["settings"]["seeds"] == [2] and list(merged["runs"]) == ["fire", "sandwich"]
    assert "seeds 2." in bench_tiny_report.markdown(merged)
    later = {**part("alibi", 4.5), "settings": {**DEFAULTS, "seeds": [1], "factors": [1]}}
    merged = bench_tiny_report.merge([part("fire", 4.0), later, part("sandwich", 5.0)], DEFAULTS)
    assert list(merged["runs"]) == ["fire", "alibi", "sandwich"]  # as given, though seed 1 sorts first
    rope = {**part("rope", 4.0), "runs": {"rope": [{}], "rope+yarn (zero-shot)": [{}], "rope+yarn (fine-tuned)": [{}]}}
    merged = bench_tiny_report.merge([rope, part("sandwich", 5.0)], DEFAULTS)
    assert list(merged["runs"]) == ["rope", "sandwich", "rope+yarn (zero-shot)", "rope+yarn (fine-tuned)"]
    with pytest.raises(SystemExit, match="'fire' seed 2 is in two"):
        bench_tiny_report.merge([part("fire", 4.0), part("fire", 4.1)], DEFAULTS)


def test_bench_tiny_merge_of_two_machines_names_both(tmp_path) -> None:
    """NoPE's 3-layer seeds 0-2 ran on this CPU and seeds 3-4 on an H100; the merge kept only the first part's
    versions, so its README line said every seed ran on 1 CPU thread. A merge now keeps each part's command and
    versions, claims only what every part shares, and a split gives each file its own part's."""
    def part(label: str, seeds: list[int], versions: dict) -> dict:
        row = {"windows": {"1": 4.0}, "tail": {}, "passkey": {"1": 1.0}}
        return {"settings": {**DEFAULTS, "seeds": seeds, "factors": [1]}, "runs": {label: [row] * len(seeds)},
                "seconds": 60.0, "command": f"{label} {seeds}", "versions": versions}

    cpu = {"torch": "2.13.0+cpu", "python": "3.11.7", "threads": 1, "device": "cpu", "jobs": 1}
    gpu = {"torch": "2.11.0+cu130", "python": "3.11.7", "threads": 16, "device": "NVIDIA H100", "jobs": 2}
    merged = bench_tiny_report.merge([part("none", [3, 4], gpu), part("none", [0, 1], cpu)], DEFAULTS)
    assert merged["versions"] == {"python": "3.11.7"}  # what is true of every seed
    assert [entry["seeds"] for entry in merged["parts"]] == [[0, 1], [3, 4]]
    assert bench_tiny_report.machines(merged) == (
        "1 CPU thread, torch 2.13.0+cpu (seeds 0, 1) and one NVIDIA H100, 2 runs at a time, torch 2.11.0+cu130 "
        "(seeds 3, 4)")
    alone = part("none", [0], cpu)
    assert bench_tiny_report.machines(alone) == "1 CPU thread, torch 2.13.0+cpu"
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench-tiny:start -->\n<!-- bench-tiny:end -->\n", encoding="utf-8")
    bench_tiny_report.report(merged, tmp_path / "out", readme)
    assert "(seeds 0, 1) and one NVIDIA H100" in readme.read_text(encoding="utf-8")
    again = bench_tiny_report.merge([merged, part("none", [5], cpu)], DEFAULTS)  # a merge merged again
    assert [entry["seeds"] for entry in again["parts"]] == [[0, 1], [3, 4], [5]]
    split = bench_tiny_report.merge([part("alibi", [3], gpu), part("t5", [3], cpu)], DEFAULTS)
    written = bench_tiny_report.write_split(split, tmp_path / "parts", bench_tiny.RUNS)
    files = {path.name: json.loads(path.read_text(encoding="utf-8")) for path in written}
    assert files["07_alibi_seed3.json"]["versions"] == gpu and files["08_t5_seed3.json"]["versions"] == cpu
    assert files["07_alibi_seed3.json"]["command"] == "alibi [3]" and "parts" not in files["08_t5_seed3.json"]
    remerged = bench_tiny_report.merge(list(files.values()), DEFAULTS)
    assert len(remerged["parts"]) == 2 and bench_tiny_report.machines(remerged).count("seeds 3") == 2
    del split["parts"][0]["command"]  # an entry the loader accepts (seeds and versions) without a command
    written = bench_tiny_report.write_split(split, tmp_path / "parts2", bench_tiny.RUNS)
    assert json.loads(written[0].read_text(encoding="utf-8"))["command"] == "?"


def test_bench_tiny_merges_results_written_before_a_setting_existed() -> None:
    """Seeds 0 and 1 were run before ``decay_from`` became a setting (the code decayed from 0.8 of the steps, the
    default): a later part at the default merges with them, one at another value is refused."""
    settings = {**dataclasses.asdict(bench_tiny.FULL), "seeds": [0, 1]}
    del settings["decay_from"]
    row = {"windows": {"1": 4.0}, "passkey": {"1": 1.0}}
    old = {"settings": settings, "runs": {"fire": [row, row], "t5": [row, row]}, "seconds": 1.0}
    later = {"settings": {**dataclasses.asdict(bench_tiny.FULL), "seeds": [2]}, "runs": {"fire": [row]},
             "seconds": 1.0}
    merged = bench_tiny_report.merge([later, old], DEFAULTS)
    assert merged["settings"]["seeds"] == [0, 1, 2] and len(merged["runs"]["fire"]) == 3
    table = bench_tiny_report.markdown({**merged, "runs": {
        label: [{**r, "tail": {str(f): 4.0 for f in (2, 4, 8)}, "windows": {str(f): 4.0 for f in (1, 2, 4, 8)},
                 "passkey": {str(f): 1.0 for f in (1, 2, 4, 8)}} for r in rows]
        for label, rows in merged["runs"].items()}})
    assert "| run | seeds | ppl 1x" in table
    assert "| fire | 3 |" in table and "| t5 | 2 |" in table and "how many of them each run has" in table
    other = {**later, "settings": {**later["settings"], "decay_from": 0.5}}
    with pytest.raises(SystemExit, match="differ in settings other than seeds"):
        bench_tiny_report.merge([other, old], DEFAULTS)


def test_bench_tiny_refuses_to_merge_runs_on_different_corpora() -> None:
    """The corpus is Python's pydoc topics, which change with the Python version: seeds 0 and 1 ran under 3.12 on
    a GPU, seed 2 under 3.11 on this machine read 4.07 perplexity where seeds 0 and 1 gave 4.68-4.92. Such parts
    must not be averaged. Parts with one fingerprint merge; parts from before fingerprints read their own Python's
    topics, known here only for this Python (a 3.12 part could have been compared with a part that read 3.11's
    topics through --corpus-file under 3.12), so they merge with each other by version."""
    import sys

    this = f"{sys.version_info.major}.{sys.version_info.minor}.0"
    other = "3.12.3" if not this.startswith("3.12") else "3.11.7"

    def part(seed: int, python: str, corpus: str | None = None) -> dict:
        found = {"settings": {"length": 16, "seeds": [seed]}, "runs": {"rope": [{"windows": {"1": 4.0}}]},
                 "versions": {"python": python}}
        return {**found, "corpus": corpus} if corpus else found

    native = bench_tiny.corpus_fingerprint()
    for parts in ([part(0, other), part(2, this, native)], [part(0, this, "aaaa"), part(1, this, "bbbb")],
                  [part(0, other), part(1, other, native)], [part(0, this), part(1, this, "aaaa")]):
        with pytest.raises(SystemExit, match="different text.*the same --corpus-file"):
            bench_tiny_report.merge(parts, DEFAULTS)
    for parts in ([part(0, other), part(1, other[:5] + "1")], [part(0, this), part(1, other, native)],
                  [part(0, this, "aaaa"), part(1, other, "aaaa")]):
        assert bench_tiny_report.merge(parts, DEFAULTS)["settings"]["seeds"] == [0, 1]
    assert len(native) == 16


@pytest.mark.slow  # trains four tiny runs; merging and split refusals are checked fast on written results
def test_bench_tiny_partial_results_merge_and_split_into_parts(tmp_path, capsys) -> None:
    """A run stopped early (a lent GPU's time ran out) leaves partial.json, which carries what --report needs (corpus,
    versions, command, each row's seed); --split writes it as the parts a run in parts writes, one per (run, seed),
    named so that a glob keeps the full mode's order, a seed's RoPE scalings with its RoPE run."""
    out = tmp_path / "out"
    argv = ["--quick", "--schemes", "rope", "sandwich:dim=8", "--scalings", "yarn", "--steps", "1", "--finetune-steps",
            "1", "--length", "16", "--trials", "1", "--seeds", "0", "2", "--output-dir", str(out)]
    assert bench_tiny.main(argv) == 0
    partial = json.loads((out / "partial.json").read_text(encoding="utf-8"))
    assert partial["corpus"] == bench_tiny.corpus_fingerprint() and partial["versions"]["device"] == "cpu"
    assert partial["command"].endswith(str(out)) and partial["seconds"] > 0
    assert [row["seed"] for row in partial["runs"]["rope+yarn (fine-tuned)"]] == [0, 2]
    parts = tmp_path / "parts"
    assert bench_tiny.main(["--report", str(out / "partial.json"), "--split", str(parts)]) == 0
    names = sorted(path.name for path in parts.glob("*.json"))
    assert names == ["06_rope_seed0.json", "06_rope_seed2.json", "10_sandwich_dim_8_seed0.json",
                     "10_sandwich_dim_8_seed2.json"]
    rope2 = json.loads((parts / "06_rope_seed2.json").read_text(encoding="utf-8"))
    assert rope2["settings"]["seeds"] == [2] and list(rope2["runs"]) == [
        "rope", "rope+yarn (zero-shot)", "rope+yarn (fine-tuned)"]
    assert all(rows[0]["seed"] == 2 and len(rows) == 1 for rows in rope2["runs"].values())
    merged = bench_tiny_report.merge([json.loads(p.read_text(encoding="utf-8")) for p in sorted(parts.glob("*"))],
                                     DEFAULTS)
    assert {label: [r["seed"] for r in rows] for label, rows in merged["runs"].items()} == {
        label: [r["seed"] for r in rows] for label, rows in partial["runs"].items()}
    with pytest.raises(SystemExit, match="already exist"):  # nothing written is replaced
        bench_tiny.main(["--report", str(out / "partial.json"), "--split", str(parts)])
    old = {**partial, "runs": {"alibi": [{k: v for k, v in partial["runs"]["rope"][0].items() if k != "seed"}]}}
    with pytest.raises(SystemExit, match="no seed in them"):  # rows of an older run: which seed is it?
        bench_tiny_report.merge([old], DEFAULTS)
    with pytest.raises(SystemExit) as stopped:
        bench_tiny.main(["--split", str(parts)])
    assert stopped.value.code == 2 and "--split DIR needs --report" in capsys.readouterr().err


def test_readme_section_needs_its_markers(tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"has no '<!-- bench-tiny:start -->' ... '<!-- bench-tiny:end -->' markers"):
        replace_section(readme, "bench-tiny", "table")


@pytest.mark.parametrize("content, says", [
    (None, "cannot read it"), ("", "cannot read it"), ("[]", "no 'settings' and 'runs'"),
    ("{}", "no 'settings' and 'runs'"), ('{"settings": {"seeds": [0]}, "runs": {"alibi": []}}', "has no rows"),
    ('{"settings": {"seeds": [0]}, "runs": {"alibi": [{"probe": [[1000, 0.5]]}]}}', "'probe' is not a list"),
    ('{"settings": {"seeds": [0]}, "runs": {"alibi": [{"probe": "x"}]}}', "'probe' is not a list"),
    ('{"settings": {"seeds": [0]}, "runs": {"alibi": [3]}}', "a row that is not an object"),
    ('{"settings": {"seeds": [0]}, "runs": {"alibi": [{}]}, "parts": []}', "its 'parts' is not a list"),
    ('{"settings": {"seeds": [0]}, "runs": {"alibi": [{}]}, "parts": [{"seeds": 0, "versions": {}}]}',
     "its 'parts' is not a list"),
], ids=["missing", "empty", "list", "object", "no-rows", "short-probe", "probe-text", "row-not-object",
        "parts-empty", "parts-seeds-not-list"])
def test_bench_tiny_report_refuses_bad_results_in_one_line(content, says, tmp_path) -> None:
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit, match=says):
        bench_tiny.main(["--report", str(path), "--output-dir", str(tmp_path / "out")])


def test_bench_tiny_report_merges_by_the_seeds_rows_carry(tmp_path, capsys) -> None:
    """A stopped multi-seed run's partial results merge with a separate run of the missing seed (the duplicate check
    read the planned seeds, not the rows'); rows of old parts take their part's seeds, so interleaved old parts are
    not mislabelled (seeds 0, 2 then 1 came out labelled 0, 1, 2)."""
    def row(seed: int | None, ppl: float) -> dict:
        found = {"windows": {"1": ppl}, "tail": {}, "passkey": {"1": 1.0}}
        return found if seed is None else {**found, "seed": seed}

    stopped = {"settings": {**DEFAULTS, "factors": [1], "seeds": [0, 1]}, "runs": {"alibi": [row(0, 4.0)]}}
    later = {"settings": {**DEFAULTS, "factors": [1], "seeds": [1]}, "runs": {"alibi": [row(1, 5.0)]}}
    merged = bench_tiny_report.merge([stopped, later], DEFAULTS)
    assert [r["seed"] for r in merged["runs"]["alibi"]] == [0, 1] and merged["settings"]["seeds"] == [0, 1]
    alone = bench_tiny_report.merge([stopped], DEFAULTS)
    assert alone["settings"]["seeds"] == [0]  # the table says the seeds it has, not the ones planned
    old02 = {"settings": {**DEFAULTS, "factors": [1], "seeds": [0, 2]},
             "runs": {"t5": [row(None, 100), row(None, 300)]}}
    old1 = {"settings": {**DEFAULTS, "factors": [1], "seeds": [1]}, "runs": {"t5": [row(None, 200)]}}
    merged = bench_tiny_report.merge([old02, old1], DEFAULTS)
    assert [(r["seed"], r["windows"]["1"]) for r in merged["runs"]["t5"]] == [(0, 100), (1, 200), (2, 300)]
    twice = {"settings": {**DEFAULTS, "factors": [1], "seeds": [0]}, "runs": {"t5": [row(0, 1.0), row(0, 2.0)]}}
    with pytest.raises(SystemExit, match="two rows of one seed"):
        bench_tiny_report.merge([twice], DEFAULTS)


@pytest.mark.parametrize("runs, says", [
    ({"rope+yarn (zero-shot)": [{"seed": 0}]}, "no RoPE row"),
    ({"rope": [{"seed": 0}], "rope+yarn (fine-tuned)": [{"seed": 0}, {"seed": 1}]}, "seed 1 have no RoPE row"),
    ({"mystery": [{"seed": 0}]}, "not one of bench_tiny's runs"),
    ({}, "nothing to split"),
], ids=["scalings-without-rope", "scalings-of-another-seed", "unknown-run", "empty"])
def test_bench_tiny_split_refuses_what_would_lose_or_mislabel_a_row(runs, says, tmp_path) -> None:
    results = {"settings": {**DEFAULTS, "seeds": [0, 1]}, "runs": runs}
    with pytest.raises(SystemExit, match=says):
        bench_tiny_report.write_split(results, tmp_path / "parts", bench_tiny.RUNS)
    assert not (tmp_path / "parts").exists()


@pytest.mark.parametrize("labels, says", [
    (["none"], []), (["rope", "rope+yarn (zero-shot)"], ["RoPE scalings extend"]),
    (["learned+concat:share=0.5", "rope+ntk (fine-tuned)"], ["RoPE scalings extend", "tiling its table"]),
], ids=["no-extension", "scalings", "learned-and-scalings"])
def test_bench_tiny_caption_explains_only_the_rows_it_has(labels: list, says: list) -> None:
    row = {"windows": {"1": 4.0}, "tail": {}, "passkey": {"1": 1.0}}
    table = bench_tiny_report.markdown({"settings": {**DEFAULTS, "factors": [1], "seeds": [0]},
                                        "runs": {label: [row] for label in labels}})
    for sentence in ("RoPE scalings extend", "tiling its table"):
        assert (sentence in table) == (sentence in says), sentence
