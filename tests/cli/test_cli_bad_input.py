"""Every CLI subcommand given bad input answers with one line naming the bad value, a
non-zero exit and no traceback, before expensive work; adapters are evaluated as adapted models; writes are atomic."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_tiny_adapter, save_tiny_checkpoint, write_corpus

import hf_posswap as ps
import hf_posswap.persistence.loading
from hf_posswap.cli import main

ROOT = Path(__file__).resolve().parents[2]
CLI_MODULE = importlib.import_module("hf_posswap.cli.main")  # the attribute of that name is the main function


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli_bad_input")
    for family in ("llama", "bert", "gpt2"):
        save_tiny_checkpoint(family, root / family)
    ps_model_dir = root / "swapped"
    main(["swap", "--model", str(root / "llama"), "--scheme", "alibi", "--output", str(ps_model_dir)])
    save_tiny_adapter(root)
    main(["swap", "--model", str(root / "llama"), "--scheme", "t5", "--output", str(root / "t5")])
    shutil.copytree(root / "t5", root / "disguised")  # model_type edited back to llama, record removed
    config = json.loads((root / "t5" / "config.json").read_text())
    config["model_type"] = "llama"
    config.pop("posswap")
    (root / "disguised" / "config.json").write_text(json.dumps(config))
    (root / "notes.txt").write_text("notes")
    (root / "empty.txt").write_text("")
    (root / "binary.bin").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    (root / "empty_dir").mkdir()
    (root / "full_dir").mkdir()
    (root / "full_dir" / "mine.txt").write_text("mine")
    for name, change in (("bad_config", lambda d: (d / "config.json").write_text("{model_type: llama")),
                         ("odd_type", lambda d: (d / "config.json").write_text('{"model_type": "banana"}')),
                         ("truncated", _truncate),
                         ("no_weights", lambda d: (d / "model.safetensors").unlink()),
                         ("pickle_junk", _junk_bin),
                         ("other_config", _other_config),
                         ("lost_shard", _lose_shard),
                         ("header_shape", lambda d: _edit_header(d, "shape")),
                         ("header_dtype", lambda d: _edit_header(d, "dtype")),
                         ("config_dtype_junk", lambda d: _edit_config(d, dtype="banana")),
                         ("config_dtype_float8", lambda d: _edit_config(d, dtype="float8_e4m3fn")),
                         ("zero_length", lambda d: _edit_config(d, max_position_embeddings=0))):
        shutil.copytree(root / "llama", root / name)
        change(root / name)
    shutil.copytree(root / "gpt2", root / "gpt2_zero_positions")
    _edit_config(root / "gpt2_zero_positions", n_positions=0)
    for name, change in (("bad_record", lambda d: (d / "posswap_adapter.json").write_text("{oops")),
                         ("odd_record", lambda d: (d / "posswap_adapter.json").write_text('{"scheme": 3}')),
                         ("lost_base", _lose_base),
                         ("own_base", lambda d: _set_base(d, d)),
                         ("adapter_base", lambda d: _set_base(d, root / "adapter"))):
        shutil.copytree(root / "adapter", root / name)
        change(root / name)
    (root / "results.json").write_text(json.dumps({"perplexity": [{"length": 8, "mode": "windows",
                                                                   "perplexity": 3.0}], "passkey": []}))
    (root / "corrupt.json").write_text('{"perplexity": [')
    (root / "badpk.json").write_text(json.dumps({"perplexity": [{"length": 8, "mode": "windows", "perplexity": 3.0}],
                                                 "passkey": [{"length": 100, "depth": 0.5, "accuracy": 7}]}))
    (root / "pkonly.json").write_text(json.dumps({"perplexity": [],
                                                  "passkey": [{"length": 100, "depth": 0.5, "accuracy": 1.0}]}))
    (root / "strings.json").write_text(json.dumps({"perplexity": [{"length": "x", "mode": "windows",
                                                                   "perplexity": "abc"}], "passkey": []}))
    return root


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))


def _edit_header(directory: Path, field: str) -> None:
    """A safetensors header of the same length (so the file size still adds up) whose first tensor has one more
    row than its bytes hold (``shape``) or a dtype safetensors does not know (``dtype``)."""
    weights = directory / "model.safetensors"
    raw = weights.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    entry = header[next(name for name in header if name != "__metadata__")]
    if field == "shape":
        entry["shape"] = [entry["shape"][0] + 1, *entry["shape"][1:]]
    else:
        entry["dtype"] = "Q9"
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    weights.write_bytes(raw[:8] + text.ljust(length) + raw[8 + length :])


def _junk_bin(directory: Path) -> None:
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"garbage, not a pickle")


def _lose_shard(directory: Path) -> None:
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))


def _other_config(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "hidden_size": 32, "head_dim": 8}))


def _truncate(directory: Path) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _set_base(directory: Path, base: Path) -> None:
    config = json.loads((directory / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base)
    (directory / "adapter_config.json").write_text(json.dumps(config))


def _lose_base(directory: Path) -> None:
    config = json.loads((directory / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(directory / "moved-away")
    (directory / "adapter_config.json").write_text(json.dumps(config))


E = ["eval", "--lengths", "32", "--corpus", "pydoc", "--model"]
# (case id, argv with {ws}, text the one-line message must contain). Every case is refused before a model loads.
BEFORE_LOADING = [
    ("eval-missing-model", E + ["{ws}/nope"], "'{ws}/nope': no such directory"),
    ("eval-model-is-a-file", E + ["{ws}/notes.txt"], "'{ws}/notes.txt' is a file"),
    ("eval-no-config", E + ["{ws}/empty_dir"], "'{ws}/empty_dir' has no config.json"),
    ("eval-corrupt-config", E + ["{ws}/bad_config"], "bad_config/config.json' is not valid JSON"),
    ("eval-unknown-model-type", E + ["{ws}/odd_type"], "model_type 'banana'"),
    ("eval-truncated-weights", E + ["{ws}/truncated"], "truncated/model.safetensors' is truncated or corrupt"),
    ("eval-no-weights", E + ["{ws}/no_weights"], "'{ws}/no_weights' holds no weights"),
    ("eval-missing-shard", E + ["{ws}/lost_shard"], "names missing weight files ['model-00002-of-00002.safetensors']"),
    ("eval-junk-pytorch-bin", E + ["{ws}/pickle_junk"], "pytorch_model.bin' is not a PyTorch weights file"),
    ("swap-header-shape-past-its-bytes", ["swap", "--model", "{ws}/header_shape", "--scheme", "t5", "--output",
                                          "{ws}/o"], "header_shape/model.safetensors' is not a valid safetensors"),
    ("swap-header-unknown-dtype", ["swap", "--model", "{ws}/header_dtype", "--scheme", "t5", "--output", "{ws}/o"],
     "header_dtype/model.safetensors' is not a valid safetensors"),
    ("swap-config-dtype-junk", ["swap", "--model", "{ws}/config_dtype_junk", "--scheme", "t5", "--output", "{ws}/o"],
     "holds \"dtype\": 'banana', which is not a dtype"),
    ("swap-config-dtype-float8", ["swap", "--model", "{ws}/config_dtype_float8", "--scheme", "t5", "--output",
                                  "{ws}/o"], "holds \"dtype\": 'float8_e4m3fn', which is not a dtype"),
    ("eval-name-too-long", E + ["{ws}/" + "x" * 300], "File name too long"),
    ("eval-text-endless-device", E + ["{ws}/llama", "--text", "/dev/zero"], "'/dev/zero' is not a regular file"),
    ("eval-output-over-a-checkpoint-file", E + ["{ws}/llama", "--output", "{ws}/llama/config.json"],
     "config.json' exists and is not an hf-posswap results file"),
    ("eval-encoder", E + ["{ws}/bert"], "'{ws}/bert' is a bert encoder"),
    ("eval-corrupt-adapter-record", E + ["{ws}/bad_record"], "bad_record/posswap_adapter.json' is not valid JSON"),
    ("eval-malformed-adapter-record", E + ["{ws}/odd_record"], "odd_record/posswap_adapter.json' is malformed"),
    ("eval-adapter-base-gone", E + ["{ws}/lost_base"], "moved-away': no such directory"),
    ("extend-trained-length-0", ["extend", "--model", "{ws}/zero_length", "--to", "128", "--output", "{ws}/short"],
     "zero_length/config.json' gives the model 0 positions (max_position_embeddings, n_positions for GPT-2)"),
    ("eval-gpt2-no-positions", E + ["{ws}/gpt2_zero_positions"], "gives the model 0 positions"),
    ("eval-adapter-based-on-itself", E + ["{ws}/own_base"], "adapter_config.json' names its own directory as its base"),
    ("swap-adapter-based-on-an-adapter", ["swap", "--model", "{ws}/adapter_base", "--scheme", "alibi", "--output",
                                          "{ws}/o"], "adapter_config.json' names another adapter as its base"),
    ("eval-tail-from-past-lengths", E + ["{ws}/llama", "--mode", "windows", "tail", "--tail-from", "1024"],
     "--tail-from 1024"),
    ("eval-trials-0", E + ["{ws}/llama", "--passkey-lengths", "200", "--trials", "0"], "got 0"),
    ("eval-passkey-length-0", E + ["{ws}/llama", "--passkey-lengths", "0"], "got 0"),
    ("eval-passkey-negative", E + ["{ws}/llama", "--passkey-lengths", "-3"], "got -3"),
    ("eval-depth-1.5", E + ["{ws}/llama", "--passkey-lengths", "200", "--depths", "1.5"], "got 1.5"),
    ("eval-max-windows-negative", E + ["{ws}/llama", "--max-windows", "-1"], "got -1"),
    ("eval-stride-0", E + ["{ws}/llama", "--mode", "sliding", "--stride", "0"], "got 0"),
    ("eval-length-1", ["eval", "--model", "{ws}/llama", "--lengths", "1"], "got 1"),
    ("eval-nothing-to-measure", ["eval", "--model", "{ws}/llama"], "Nothing to measure"),
    ("eval-lengths-not-int", ["eval", "--model", "{ws}/llama", "--lengths", "abc"], "invalid int value: 'abc'"),
    ("eval-text-missing", E + ["{ws}/llama", "--text", "{ws}/nope.txt"], "--text '{ws}/nope.txt': cannot read"),
    ("eval-text-binary", E + ["{ws}/llama", "--text", "{ws}/binary.bin"], "'{ws}/binary.bin' is not UTF-8 text"),
    ("eval-text-empty", E + ["{ws}/llama", "--text", "{ws}/empty.txt"], "'{ws}/empty.txt' is empty"),
    ("eval-text-directory", E + ["{ws}/llama", "--text", "{ws}/empty_dir"], "'{ws}/empty_dir' is a directory"),
    ("eval-output-parent-missing", E + ["{ws}/llama", "--output", "{ws}/nodir/r.json"], "{ws}/nodir' does not exist"),
    ("eval-output-is-a-directory", E + ["{ws}/llama", "--output", "{ws}/empty_dir"], "'{ws}/empty_dir' is a directory"),
    ("swap-missing-model", ["swap", "--model", "{ws}/nope", "--scheme", "alibi", "--output", "{ws}/o"], "'{ws}/nope'"),
    ("swap-unknown-scheme", ["swap", "--model", "{ws}/llama", "--scheme", "alibj", "--output", "{ws}/o"], "'alibj'"),
    ("swap-bad-option", ["swap", "--model", "{ws}/llama", "--scheme", "t5", "--option", "num_buckets=-3",
                         "--output", "{ws}/o"], "got -3"),
    ("swap-unknown-option", ["swap", "--model", "{ws}/llama", "--scheme", "t5", "--option", "bogus=1",
                             "--output", "{ws}/o"], "'bogus'"),
    ("swap-output-is-a-file", ["swap", "--model", "{ws}/llama", "--scheme", "alibi", "--output", "{ws}/notes.txt"],
     "'{ws}/notes.txt' is an existing file"),
    ("swap-output-parent-missing", ["swap", "--model", "{ws}/llama", "--scheme", "alibi", "--output", "{ws}/a/b"],
     "{ws}/a' does not exist"),
    ("swap-output-not-empty", ["swap", "--model", "{ws}/llama", "--scheme", "alibi", "--output", "{ws}/full_dir"],
     "'{ws}/full_dir' is not empty"),
    ("extend-missing-model", ["extend", "--model", "{ws}/nope", "--to", "128", "--output", "{ws}/o"], "'{ws}/nope'"),
    ("extend-to-0", ["extend", "--model", "{ws}/llama", "--to", "0", "--output", "{ws}/o"], "--to 0"),
    ("extend-unknown-method", ["extend", "--model", "{ws}/llama", "--to", "128", "--method", "yorn", "--output",
                               "{ws}/o"], "'yorn'"),
    ("extend-in-place-without-overwrite", ["extend", "--model", "{ws}/llama", "--to", "128", "--output", "{ws}/llama"],
     "'{ws}/llama' is not empty"),
    ("export-missing-checkpoint", ["export", "{ws}/nope", "{ws}/o"], "'{ws}/nope': no such directory"),
    ("export-unswapped", ["export", "{ws}/llama", "{ws}/o"], "'{ws}/llama' carries no hf_posswap swap"),
    ("export-output-not-empty", ["export", "{ws}/swapped", "{ws}/full_dir"], "'{ws}/full_dir' is not empty"),
    ("inspect-missing-model", ["inspect", "--model", "{ws}/nope"], "'{ws}/nope': no such directory"),
    ("inspect-length-1", ["inspect", "--model", "{ws}/gpt2", "--length", "1"], "--length 1"),
    ("inspect-length-huge", ["inspect", "--model", "{ws}/llama", "--length", "1000000"],
     "--length 1000000: the pictures draw at most 4096 positions"),
    ("inspect-unknown-scheme", ["inspect", "--model", "{ws}/gpt2", "--scheme", "rop"], "'rop'"),
    ("inspect-output-is-a-file", ["inspect", "--model", "{ws}/gpt2", "--output", "{ws}/notes.txt"],
     "'{ws}/notes.txt' is a file"),
    ("plot-missing-results", ["plot", "{ws}/nope.json", "--output", "{ws}/p.png"], "'{ws}/nope.json' does not exist"),
    ("plot-corrupt-results", ["plot", "{ws}/corrupt.json", "--output", "{ws}/p.png"],
     "corrupt.json' is not valid JSON"),
    ("plot-not-results", ["plot", "{ws}/swapped/config.json", "--output", "{ws}/p.png"], "not an hf-posswap eval"),
    ("plot-non-numeric-results", ["plot", "{ws}/strings.json", "--output", "{ws}/p.png"], "not an hf-posswap eval"),
    ("plot-wrong-mode", ["plot", "{ws}/results.json", "--mode", "tail", "--output", "{ws}/p.png"],
     "no perplexity rows of mode 'tail'"),
    ("plot-no-passkey", ["plot", "{ws}/results.json", "--output", "{ws}/p.png", "--passkey-output", "{ws}/k.png"],
     "no passkey results"),
    ("plot-bad-suffix", ["plot", "{ws}/results.json", "--output", "{ws}/p.txt"], "'{ws}/p.txt'"),
    ("plot-passkey-accuracy-out-of-range", ["plot", "{ws}/badpk.json", "--output", "{ws}/p.png",
                                            "--passkey-output", "{ws}/k.png"],
     "'{ws}/badpk.json': passkey row {'length': 100, 'depth': 0.5, 'accuracy': 7} needs"),
    ("plot-output-that-takes-no-file", ["plot", "{ws}/results.json", "--output", "/proc/x.png"],
     "--output '/proc/x.png': "),
    ("plot-passkey-only-without-heatmap", ["plot", "{ws}/pkonly.json", "--output", "{ws}/p.png"],
     "no perplexity rows to draw (eval ran without --lengths); draw the passkey results with --passkey-output"),
    ("eval-stride-without-sliding", E + ["{ws}/llama", "--stride", "8"],
     "--stride 8 (stride) applies to the sliding mode only, and the modes are windows; add --mode sliding"),
    ("eval-tail-from-without-tail", E + ["{ws}/llama", "--tail-from", "8"],
     "--tail-from 8 (tail_from) applies to the tail mode only"),
    ("eval-repeated-lengths", ["eval", "--model", "{ws}/llama", "--lengths", "32", "64", "32"],
     "Perplexity lengths (--lengths) repeat 32; give each value once"),
    ("eval-repeated-passkey-lengths", E + ["{ws}/llama", "--passkey-lengths", "200", "200"],
     "Passkey lengths (--passkey-lengths) repeat 200"),
    ("eval-repeated-depths", E + ["{ws}/llama", "--passkey-lengths", "200", "--depths", "0", "1", "0"],
     "Passkey depths (--depths) repeat 0.0"),
    ("finetune-missing-model", ["finetune", "--model", "{ws}/nope", "--data", "{ws}/notes.txt", "--output",
                                "{ws}/run"], "'{ws}/nope': no such directory"),
    ("demo-missing-checkpoint", ["demo", "--checkpoint", "{ws}/nope"], "'{ws}/nope': no such directory"),
    ("demo-unknown-scheme", ["demo", "--schemes", "alibj"], "'alibj'"),
    ("demo-encoder-checkpoint", ["demo", "--checkpoint", "{ws}/bert"], "'{ws}/bert'"),
]


def _run(argv: list[str], ws: Path, capsys) -> tuple[int, str, str]:
    code = main([a.replace("{ws}", str(ws)) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


OUT = ["--output", "{ws}/o"]
BEFORE_LOADING += [  # known from the command line, config.json or the tokenizer: refused before the model loads
    ("eval-output-name-too-long-for-its-temporary-name",
     E + ["{ws}/llama", "--output", "{ws}/" + "y" * 245 + ".json"],
     "the name is 250 bytes long, and the temporary name it is written under adds 14, past this file system's limit"),
    ("swap-output-name-too-long-for-its-staging-name", ["swap", "--model", "{ws}/llama", "--scheme", "alibi",
                                                        "--output", "{ws}/" + "y" * 245],
     "the name is 245 bytes long, and the temporary name it is written under adds 18"),
    ("swap-output-name-past-the-limit", ["swap", "--model", "{ws}/llama", "--scheme", "alibi", "--output",
                                         "{ws}/" + "y" * 300], "--output '{ws}/yyy"),
    ("eval-output-empty", E + ["{ws}/llama", "--output", ""], "--output is empty (''); give a file name"),
    ("swap-output-empty", ["swap", "--model", "{ws}/llama", "--scheme", "alibi", "--output", ""],
     "--output is empty (''); give a directory name"),
    ("eval-length-past-learned-table", ["eval", "--model", "{ws}/gpt2", "--lengths", "100", "--corpus", "pydoc"],
     "--lengths 100 exceeds the model's learned position table (64 positions, from its config.json)"),
    ("eval-text-shorter-than-a-length", E + ["{ws}/llama", "--text", "{ws}/notes.txt"],
     "--lengths 32: a window needs 32 tokens of text, and the --text files hold 5; give a longer text"),
    ("extend-rope-scaling-without-rope", ["extend", "--model", "{ws}/gpt2", "--to", "512", "--method", "yarn", *OUT],
     "--method yarn scales RoPE, and --model '{ws}/gpt2' carries a learned position table"),
    ("extend-bad-method-option", ["extend", "--model", "{ws}/llama", "--to", "512", "--option", "beta_fast=-1", *OUT],
     "--method yarn: --option beta_fast must be a positive finite number, got -1"),
    ("extend-unknown-method-option", ["extend", "--model", "{ws}/llama", "--to", "512", "--option", "bogus=1", *OUT],
     "has no option 'bogus'"),
    ("extend-self-extend-group-0", ["extend", "--model", "{ws}/llama", "--to", "512", "--method", "self_extend",
                                    "--option", "group_size=0", *OUT], "--option group_size must be an integer >= 1"),
    ("extend-to-the-current-length", ["extend", "--model", "{ws}/gpt2", "--to", "64", *OUT],
     "--to 64: --model '{ws}/gpt2' already has 64 positions; nothing to extend"),
    ("inspect-scheme-none", ["inspect", "--model", "{ws}/llama", "--scheme", "none", "--output", "{ws}/pics"],
     "--scheme 'none' (NoPE): it carries no position signal, so there is nothing to draw"),
    ("inspect-layer-mix", ["inspect", "--model", "{ws}/llama", "--scheme", "layer_mix", "--output", "{ws}/pics"],
     "inspect draws one scheme at a time, and a mix gives each layer its own; with its default options every layer "
     "has RoPE, so draw it with --scheme rope"),
    ("eval-repeated-single-valued-option", ["eval", "--model", "{ws}/llama", "--lengths", "32", "--lengths", "64"],
     "argument --lengths: given twice (--lengths 32, then --lengths 64)"),
    ("swap-repeated-scheme", ["swap", "--model", "{ws}/llama", "--scheme", "alibi", "--scheme", "rope", *OUT],
     "argument --scheme: given twice (--scheme alibi, then --scheme rope)"),
    ("extend-train-full-with-lora-rank", ["extend", "--model", "{ws}/llama", "--to", "256", "--train", "--data",
                                          "{ws}/notes.txt", "--full", "--lora-r", "4", *OUT],
     "--full and --lora-r exclude each other"),
    ("plot-results-is-a-directory", ["plot", "{ws}/empty_dir", "--output", "{ws}/p.png"],
     "Results file '{ws}/empty_dir' is a directory; pass the results file in it"),
    ("plot-empty-label", ["plot", "={ws}/results.json", "--output", "{ws}/p.png"], "has an empty label"),
    ("plot-output-is-a-directory", ["plot", "{ws}/results.json", "--output", "{ws}/empty_dir/"],
     "is a directory; give a picture file name (e.g. {ws}/empty_dir/perplexity.png)"),
    ("plot-corrupt-results-fix", ["plot", "{ws}/corrupt.json", "--output", "{ws}/p.png"],
     "restore the file or run hf-posswap eval again"),
]


BEFORE_LOADING.append(  # the position weights would be dropped silently by a plain-type load
    ("eval-position-weights-under-a-plain-model-type", E + ["{ws}/disguised"],
     "holds hf_posswap position weights ['model.posswap_positions.tables.0.weight']"))


@pytest.mark.parametrize(("argv", "needle"), [c[1:] for c in BEFORE_LOADING], ids=[c[0] for c in BEFORE_LOADING])
def test_bad_input_is_one_line_before_loading(ws, capsys, monkeypatch, argv, needle) -> None:
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(hf_posswap.persistence.loading, "load_model", no_loading)
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", no_loading)
    code, out, err = _run(argv, ws, capsys)
    assert code != 0 and "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hf-posswap {argv[0]}: "), err
    assert needle.replace("{ws}", str(ws)) in lines[0]


AFTER_LOADING = [  # refused once the model is known, still before any forward pass or write
    ("eval-passkey-shorter-than-needle", E + ["{ws}/llama", "--passkey-lengths", "20"], "Passkey length 20"),
    ("inspect-length-past-learned-table", ["inspect", "--model", "{ws}/gpt2", "--length", "100", "--output",
                                           "{ws}/pictures"], "Length 100 exceeds"),
    ("extend-shorter", ["extend", "--model", "{ws}/llama", "--to", "16", "--output", "{ws}/short"], "16"),
    ("swap-ntk-base-overflows", ["swap", "--model", "{ws}/llama", "--scheme", "rope", "--option",
                                 'scaling={"method": "ntk", "factor": 1e300}', "--output", "{ws}/short"],
     "rope_theta must be above 1 and at most 3.4e+38, got inf"),
    ("eval-config-not-matching-weights", E + ["{ws}/other_config"],
     "'{ws}/other_config': its weights do not match its config.json"),
]


@pytest.mark.parametrize(("argv", "needle"), [c[1:] for c in AFTER_LOADING], ids=[c[0] for c in AFTER_LOADING])
@pytest.mark.slow
def test_bad_input_after_loading_is_one_line(ws, capsys, argv, needle) -> None:
    code, out, err = _run(argv, ws, capsys)
    assert code != 0 and "Traceback" not in out + err
    messages = [line for line in err.splitlines() if line.startswith("hf-posswap")]  # past loading progress bars
    assert len(messages) == 1 and needle.replace("{ws}", str(ws)) in messages[0], err
    assert not (ws / "short").exists() and not (ws / "pictures").exists()


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 4000000000000 bytes."),
    MemoryError(),
], ids=["torch-cpu-allocator", "python"])
def test_running_out_of_memory_is_one_line(ws, capsys, monkeypatch, error) -> None:
    """A failed allocation (an option value that asks for terabytes: FIRE's mlp_width=10**12) is the user's to fix,
    not a traceback; other RuntimeErrors are bugs and keep theirs."""
    def allocate(*args, **kwargs):
        raise error

    monkeypatch.setattr(CLI_MODULE, "_load", allocate)
    code, out, err = _run(["swap", "--model", "{ws}/llama", "--scheme", "fire", "--output", "{ws}/oom"], ws, capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("hf-posswap swap: ran out of memory"), err
    assert "Nothing was written" in lines[0] and not (ws / "oom").exists()


def test_other_runtime_errors_keep_their_traceback(ws, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(CLI_MODULE, "_load", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["swap", "--model", str(ws / "llama"), "--scheme", "fire", "--output", str(ws / "oom")])


@pytest.mark.slow  # two interpreter start-ups (~8 s each on 2 cores)
@pytest.mark.parametrize("argv", [["eval", "--model", "{ws}/nope", "--lengths", "32"],
                                  ["finetune", "--model", "{ws}/nope", "--data", "{ws}/notes.txt", "--output",
                                   "{ws}/r"]],
                         ids=["eval", "finetune"])
def test_missing_model_in_a_real_process(ws, argv) -> None:
    command = [sys.executable, "-m", "hf_posswap", *[a.replace("{ws}", str(ws)) for a in argv]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr[-2000:]
    assert f"'{ws}/nope': no such directory" in result.stderr


# ---- an adapter directory is evaluated as the swapped, adapted model -------------------------------------

@pytest.mark.slow
def test_eval_of_an_adapter_directory_measures_the_adapted_model(ws, tmp_path, capsys) -> None:
    from transformers import AutoModelForCausalLM

    from hf_posswap.evaluation import byte_tokenizer, evaluate

    base = AutoModelForCausalLM.from_pretrained(ws / "llama")
    ps.swap(base, "t5", num_buckets=16, max_distance=32)
    adapted = ps.load_adapter(base, ws / "adapter")
    expected = evaluate(adapted, byte_tokenizer(), [48], corpus="pydoc", max_windows=2, progress=False)
    native = evaluate(AutoModelForCausalLM.from_pretrained(ws / "llama"), byte_tokenizer(), [48], corpus="pydoc",
                      max_windows=2, progress=False)
    code, _, err = _run(["eval", "--model", "{ws}/adapter", "--lengths", "48", "--corpus", "pydoc", "--max-windows",
                         "2", "--output", str(tmp_path / "r.json")], ws, capsys)
    assert code == 0, err
    measured = json.loads((tmp_path / "r.json").read_text())["perplexity"][0]["perplexity"]
    assert measured == pytest.approx(expected["perplexity"][0]["perplexity"], rel=1e-5)
    assert measured != pytest.approx(native["perplexity"][0]["perplexity"], rel=1e-3)


def test_swap_of_an_adapter_directory_merges_it_and_keeps_the_tokenizer(ws, tmp_path, capsys) -> None:
    code, _, err = _run(["swap", "--model", "{ws}/adapter", "--scheme", "alibi", "--output", str(tmp_path / "o")],
                        ws, capsys)
    assert code == 0, err
    assert (tmp_path / "o" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "o" / "config.json").read_text())["posswap"]["scheme"] == "alibi"
    assert "lora" not in (tmp_path / "o" / "model.safetensors").read_bytes()[:20000].decode("latin-1")


# ---- atomic writes ---------------------------------------------------------------------------------------

def test_extend_in_place_on_a_full_disk_leaves_the_old_checkpoint(ws, tmp_path, capsys, monkeypatch) -> None:
    shutil.copytree(ws / "swapped", tmp_path / "m")
    (tmp_path / "m" / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    from transformers import PreTrainedModel

    real_save = PreTrainedModel.save_pretrained

    def full_disk(self, directory, *args, **kwargs):
        real_save(self, directory, *args, **kwargs)
        (Path(directory) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    code, out, err = _run(["extend", "--model", str(tmp_path / "m"), "--to", "256", "--output", str(tmp_path / "m"),
                           "--overwrite"], ws, capsys)
    assert code == 1 and "Traceback" not in out + err and "No space left on device" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    monkeypatch.undo()
    code, _, err = _run(["extend", "--model", str(tmp_path / "m"), "--to", "256", "--output", str(tmp_path / "m"),
                         "--overwrite"], ws, capsys)
    assert code == 0, err
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["max_position_embeddings"] == 256 and (tmp_path / "m" / "notes.txt").read_text() == "mine"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "m")


def test_swap_onto_an_existing_file_is_an_error_and_writes_nothing(ws, tmp_path, capsys) -> None:
    (tmp_path / "out").write_text("precious")
    code, _, err = _run(["swap", "--model", "{ws}/llama", "--scheme", "alibi", "--output", str(tmp_path / "out")],
                        ws, capsys)
    assert code == 1 and "is an existing file" in err
    assert (tmp_path / "out").read_text() == "precious" and len(list(tmp_path.iterdir())) == 1


def test_export_cli_overwrite_keeps_the_users_files(ws, tmp_path, capsys) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    code, _, err = _run(["export", "{ws}/swapped", str(tmp_path / "out"), "--overwrite"], ws, capsys)
    assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "notes.txt" in names and "modeling_posswap.py" in names and "tokenizer.json" in names


@pytest.mark.slow
def test_eval_of_a_corpus_file_list_works_after_the_checks(ws, tmp_path, capsys) -> None:
    paths = [str(p) for p in write_corpus(tmp_path, documents=2)]
    for path in paths:
        Path(path).write_text(Path(path).read_text()[:150])
    code, out, err = _run(["eval", "--model", "{ws}/llama", "--lengths", "32", "--text", *paths, "--max-windows", "0",
                           "--passkey-lengths", "120", "--depths", "0.5", "--trials", "1"], ws, capsys)
    assert code == 0, err
    assert "perplexity  length     32  windows" in out and "passkey     length    120" in out


def test_ctrl_c_during_a_save_leaves_nothing_half_written(ws, tmp_path, capsys, monkeypatch) -> None:
    from transformers import PreTrainedModel

    real_save = PreTrainedModel.save_pretrained

    def interrupted(self, directory, *args, **kwargs):
        real_save(self, directory, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", interrupted)
    code, out, err = _run(["swap", "--model", "{ws}/llama", "--scheme", "alibi", "--output", str(tmp_path / "o")],
                          ws, capsys)
    assert code == 130 and "Traceback" not in out + err and "interrupted" in err
    assert list(tmp_path.iterdir()) == []  # neither the output nor a staging directory


@pytest.mark.slow
def test_adapter_with_a_base_path_relative_to_the_adapter(ws, tmp_path, capsys) -> None:
    shutil.copytree(ws / "llama", tmp_path / "base")
    shutil.copytree(ws / "adapter", tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config,
                                                                          "base_model_name_or_path": "../base"}))
    code, out, err = _run(["eval", "--model", str(tmp_path / "adapter"), "--lengths", "32", "--corpus", "pydoc",
                           "--max-windows", "1"], ws, capsys)
    assert code == 0, err
