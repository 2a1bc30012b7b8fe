"""The benchmark scripts run end to end on tiny settings and write what the README shows (their numbers are
measurements, not test expectations); the byte tokenizer and the passkey filler they rely on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hf_posswap.evaluation import BYTE_VOCAB_SIZE, byte_tokenizer, passkey_prompt

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_speed  # noqa: E402
import bench_tiny  # noqa: E402
from readme_section import replace_section  # noqa: E402


def test_byte_tokenizer_round_trips_any_text() -> None:
    tokenizer = byte_tokenizer()
    text = "def f(x):\n    return 'héllo ✓' * 2\t# ünïcode"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256 and len(tokenizer) == BYTE_VOCAB_SIZE
    assert tokenizer.decode(ids) == text


def test_passkey_prompt_takes_a_filler() -> None:
    tokenizer = byte_tokenizer()
    text = tokenizer.decode(passkey_prompt(tokenizer, 300, 0.5, "12345", filler="Rain falls. "))
    assert "Rain falls." in text and "grass" not in text and text.count("12345") == 2


def test_training_examples_have_the_length_and_hold_the_answer() -> None:
    import random

    tokenizer, rng = byte_tokenizer(), random.Random(0)
    for length in (128, 256):
        passkey = tokenizer.decode(bench_tiny.passkey_example(tokenizer, length, rng))
        key = passkey.rsplit("The pass key is ", 1)[1][:5]
        assert len(passkey) == length and passkey.count(key) == 3 and passkey.endswith(f" {key}.")
        copy = tokenizer.decode(bench_tiny.copy_example(tokenizer, length, rng))
        chunk = copy.split("|")[0]
        assert len(copy) == length and copy.startswith(f"{chunk}|{chunk}")


@pytest.mark.slow
def test_bench_tiny_writes_table_plot_and_readme_section(tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- bench-tiny:start -->\nold\n<!-- bench-tiny:end -->\nafter\n", encoding="utf-8")
    out = tmp_path / "out"
    argv = ["--quick", "--schemes", "learned", "alibi", "rope", "--scalings", "yarn", "longrope", "self_extend",
            "--steps", "2", "--finetune-steps", "1", "--length", "16", "--trials", "1", "--seeds", "0", "1",
            "--output-dir", str(out), "--readme", str(readme)]
    assert bench_tiny.main(argv) == 0
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert list(results["runs"]) == ["learned", "alibi", "rope", "rope+yarn (zero-shot)", "rope+yarn (fine-tuned)",
                                     "rope+longrope (zero-shot)", "rope+longrope (fine-tuned)",
                                     "rope+self_extend (zero-shot)", "rope+self_extend (fine-tuned)"]
    assert all(len(rows) == 2 for rows in results["runs"].values())  # one row per seed
    row = results["runs"]["alibi"][0]
    assert set(row["windows"]) == {"1", "2", "4", "8"} and set(row["tail"]) == {"2", "4", "8"}
    assert all(0.0 <= value <= 1.0 for value in row["passkey"].values())
    table = (out / "results.md").read_text(encoding="utf-8")
    assert "| rope+yarn (fine-tuned)" in table and "ppl 8x" in table and "passkey 8x" in table
    assert "seeds 0, 1 (mean ± std)" in table and " ± " in table.split("| alibi")[1].splitlines()[0]
    assert (out / "bench_tiny.png").stat().st_size > 10_000
    text = readme.read_text(encoding="utf-8")
    assert "old" not in text and "| alibi" in text and text.endswith("<!-- bench-tiny:end -->\nafter\n")
    assert (tmp_path / "scripts" / "results" / "bench_tiny.png").exists()
    redrawn = tmp_path / "redrawn"
    assert bench_tiny.main(["--report", str(out / "results.json"), "--output-dir", str(redrawn)]) == 0
    assert (redrawn / "results.md").read_text(encoding="utf-8") == table


def test_bench_speed_writes_the_readme_section(tmp_path, monkeypatch) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench-speed:start -->\n<!-- bench-speed:end -->\n", encoding="utf-8")
    argv = ["bench_speed.py", "--cases", "llama-alibi", "--lengths", "32", "--repeats", "1", "--steps", "forward",
            "--no-memory", "--readme", str(readme)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_speed.main()
    text = readme.read_text(encoding="utf-8")
    assert "| llama-alibi | 32 | forward ms |" in text and "--lengths 32" in text


def test_readme_section_needs_its_markers(tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"has no '<!-- bench-tiny:start -->' ... '<!-- bench-tiny:end -->' markers"):
        replace_section(readme, "bench-tiny", "table")
