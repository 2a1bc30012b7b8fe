"""The command line's errors suggest fixes the user can type: options of the command, never Python calls
(``overwrite=True``, ``hf_posswap.available_schemes()``, ``LearnedConfig(max_positions=...)``, ``tail_from``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import save_tiny_checkpoint

from hf_posswap.cli import main
from hf_posswap.cli.wording import in_cli_words

#: phrases of the Python API that a command-line user cannot type
PYTHON_WORDS = re.compile(r"hf_posswap\.\w+\(|\w=True|\w=False|[A-Z]\w*Config[.(]|\btail_from\b|"
                          r"(?<!--option )\bmax_positions=|\bextend_context\b|\bscheme_options\b|\bmerge_lora\b")


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wording")
    save_tiny_checkpoint("gpt2", root / "gpt2")  # learned table of 64 positions
    save_tiny_checkpoint("llama", root / "llama")
    (root / "full").mkdir()
    (root / "full" / "config.json").write_text("{}")
    return root


CASES = {
    "unknown-scheme": (["swap", "--model", "{gpt2}", "--scheme", "alibbi", "--output", "{tmp}/a"],
                       "List them with `hf-posswap schemes`."),
    "output-not-empty": (["swap", "--model", "{gpt2}", "--scheme", "alibi", "--output", "{full}"],
                         "or pass --overwrite to replace"),
    "shrinking-table": (["swap", "--model", "{gpt2}", "--scheme", "learned", "--option", "max_positions=8",
                         "--output", "{tmp}/b"], "--option max_positions=8 would shrink"),
    "extend-shorter": (["extend", "--model", "{gpt2}", "--to", "8", "--output", "{tmp}/c"],
                       "--to 8 is shorter than the model's current length 64"),
    "tail-past-length": (["eval", "--model", "{gpt2}", "--lengths", "16", "--mode", "tail"],
                         "pass --tail-from"),
    "merge-without-lora": (["finetune", "--model", "{gpt2}", "--data", "x", "--output", "{tmp}/d", "--merge-lora"],
                           "--merge-lora needs --lora."),
    "seq-len-zero": (["finetune", "--model", "{gpt2}", "--data", "x", "--output", "{tmp}/e", "--seq-len", "0"],
                     "--seq-len must be a positive integer, got 0."),
    "option-without-scheme": (["finetune", "--model", "{gpt2}", "--data", "x", "--output", "{tmp}/f",
                               "--scheme-option", "a=1"], "--scheme-option {'a': 1} needs a --scheme"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cli_errors_name_options_not_python_calls(case: str, ws: Path, tmp_path: Path, capsys) -> None:
    argv, expected = CASES[case]
    argv = [arg.format(gpt2=ws / "gpt2", full=ws / "full", tmp=tmp_path) for arg in argv]
    assert main(argv) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    assert expected in error, error
    assert not PYTHON_WORDS.search(error.split(":", 1)[1]), error


def test_the_rewrites_leave_other_commands_and_other_text_alone() -> None:
    message = "max_positions=8 is shorter than the model's current length 64"
    assert in_cli_words("extend", message).startswith("--to 8 is shorter")
    assert in_cli_words("swap", message) == message  # only `extend` has --to
    assert in_cli_words("eval", "nothing to rewrite here") == "nothing to rewrite here"


def test_schemes_lists_every_option_with_its_default_and_what_it_does(capsys) -> None:
    import dataclasses

    from hf_posswap.schemes.base import SCHEME_REGISTRY

    assert main(["schemes"]) == 0
    printed = capsys.readouterr().out
    options = printed.split("Scheme options (pass with --option KEY=VALUE):", 1)[1]
    for name in SCHEME_REGISTRY.names():
        config_cls = SCHEME_REGISTRY.get(name)
        assert f"\n  {name} ({config_cls.kind}): " in options
        for field in dataclasses.fields(config_cls):
            line = next((line for line in options.splitlines() if line.startswith(f"      {field.name}=")), None)
            assert line is not None, f"{name}.{field.name} is not listed"
            assert re.match(rf"^      {field.name}=\S+  \S.{{10,}}", line), f"{name}.{field.name} undescribed: {line!r}"


def test_export_of_a_natively_extended_checkpoint_says_it_already_loads_without_hf_posswap(ws, tmp_path,
                                                                                          capsys) -> None:
    assert main(["extend", "--model", str(ws / "llama"), "--to", "256", "--method", "yarn", "--output",
                 str(tmp_path / "long")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "long"), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err.strip()
    assert "already loads without hf_posswap: its positions ('rope', extended with 'yarn')" in error, error
    assert "carries no" not in error and not (tmp_path / "out").exists()


def test_a_too_short_passkey_is_refused_before_the_model_loads(ws, capsys, monkeypatch) -> None:
    from hf_posswap.persistence import loading

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the passkey lengths were checked")

    monkeypatch.setattr(loading, "load_model", no_model)
    assert main(["eval", "--model", str(ws / "llama"), "--passkey-lengths", "5"]) == 1
    assert "Passkey length 5 is shorter than the needle and the question alone" in capsys.readouterr().err


def test_inspect_default_length_fits_a_short_learned_table(ws, tmp_path, capsys) -> None:
    assert main(["inspect", "--model", str(ws / "gpt2"), "--output", str(tmp_path / "pictures")]) == 0
    assert "absolute_cosine.png" in capsys.readouterr().out  # the table holds 64 positions: 64 are drawn, not 256
    assert main(["inspect", "--model", str(ws / "gpt2"), "--output", str(tmp_path / "p2"), "--length", "100"]) == 1
    assert "exceeds the model's learned position table (transformer.wpe: 64 positions)" in capsys.readouterr().err
