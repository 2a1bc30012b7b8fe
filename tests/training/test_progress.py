"""Long work reports progress on stderr: a tqdm bar on a terminal, plain lines with elapsed time and ETA in a log,
nothing with ``progress=False``; the demo reports every step and saves a checkpoint the next command can use."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch
from conftest import byte_tokenizer, save_tiny_checkpoint
from torch import nn

from hf_posswap import progress as progress_module
from hf_posswap.evaluation import evaluate, passkey_accuracy, perplexity
from hf_posswap.progress import Progress, duration, repeated_layers
from hf_posswap.training import FinetuneConfig
from hf_posswap.training.config import build_parser, config_from_args
from hf_posswap.training.loop import _losses_note, _progress
from hf_posswap.training.resume import setting_changes


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    """A stand-in for time.perf_counter that the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", fake)
    return fake


def test_plain_lines_carry_elapsed_time_and_a_weighted_eta(clock) -> None:
    stream = io.StringIO()
    with Progress("work", 3, unit="window", weights=[1, 1, 2], stream=stream) as bar:
        clock.now += 10
        bar.step("first")
        clock.now += 10
        bar.step()
        clock.now += 20
        bar.step()
    lines = stream.getvalue().splitlines()
    assert lines == ["work: window 1/3 done (first); 10 s elapsed, ETA 30 s",  # 1 of 4 weight units in 10 s
                     "work: window 2/3 done; 20 s elapsed, ETA 20 s",
                     "work: window 3/3 done; finished in 40 s"]
    assert "\r" not in stream.getvalue()


def test_fast_steps_are_folded_but_first_and_last_are_shown(clock) -> None:
    stream = io.StringIO()
    with Progress("work", 5, stream=stream) as bar:
        for _ in range(5):
            clock.now += 0.1
            bar.step()
    assert [line.split(";")[0] for line in stream.getvalue().splitlines()] == ["work: step 1/5 done",
                                                                               "work: step 5/5 done"]


def test_a_terminal_gets_a_tqdm_bar() -> None:
    stream = Terminal()
    with Progress("work", 2, unit="window", stream=stream) as bar:
        bar.step()
        bar.step()
    text = stream.getvalue()
    assert "\r" in text and "work (window 2/2):  50%|" in text and "<" in text  # [elapsed<remaining]


def test_progress_can_be_turned_off(monkeypatch) -> None:
    stream = Terminal()
    with Progress("work", 2, stream=stream, enabled=False) as bar:
        bar.step()
        bar.advance_within(0.5)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    with Progress("work", 2, stream=stream) as bar:
        bar.step()
    plain = io.StringIO()
    with Progress("work", 2, stream=plain) as bar:
        bar.step()
    assert stream.getvalue() == "" and plain.getvalue() == ""


class Stack(nn.Module):
    """Four blocks in a ModuleList (as model.layers), after a list of as many small tables (as T5's per layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(2, 1) for _ in range(4))
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_watching_the_layers_reports_inside_a_long_step(clock) -> None:
    model, stream = Stack(), io.StringIO()
    assert repeated_layers(model) == list(model.layers)
    with Progress("long pass", 2, unit="forward pass", stream=stream, interval=10) as bar, bar.watch(model):
        for _ in range(2):
            for layer in model.layers:  # the forward pass, one block at a time, each taking 5 s
                clock.now += 5
                layer(torch.zeros(4))
            bar.step()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "long pass: forward pass 1/2, 50% of it, layer 2/4; 10 s elapsed, ETA 30 s"
    assert lines[-1] == "long pass: forward pass 2/2 done; finished in 40 s"
    assert len(lines) == 6 and all(not layer._forward_hooks for layer in model.layers)


def test_the_hooks_go_away_after_an_error() -> None:
    model = Stack()
    with pytest.raises(RuntimeError), Progress("x", 1, stream=io.StringIO()) as bar, bar.watch(model):
        assert all(layer._forward_hooks for layer in model.layers)
        raise RuntimeError("stop")
    assert all(not layer._forward_hooks for layer in model.layers)


def test_repeated_layers_of_a_real_model_are_its_decoder_layers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    import hf_posswap as ps

    model = AutoModelForCausalLM.from_pretrained(save_tiny_checkpoint("llama", tmp_path / "m"))
    ps.swap(model, "t5", shared_across_layers=False)  # a ModuleList of tables as long as the layer list
    assert repeated_layers(model) == list(model.model.layers)


def test_duration_is_readable() -> None:
    assert [duration(s) for s in (0.4, 42, 185, 3725)] == ["0 s", "42 s", "3 min 05 s", "1 h 02 min"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(save_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "m"))


def test_evaluate_reports_windows_and_passkey_trials_on_stderr(tiny, capsys) -> None:
    evaluate(tiny, byte_tokenizer(), [32], corpus="pydoc", max_windows=2, passkey_lengths=[120], depths=[0.0, 1.0],
             trials=2)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert "perplexity at 32 tokens (windows): window 1/2 done; " in captured.err
    assert any(line.startswith("perplexity at 32 tokens (windows): window 2/2 done; finished in") for line in lines)
    assert "passkey at 120 tokens: trial 1/4 done (depth 0%); " in captured.err
    assert any(line.startswith("passkey at 120 tokens: trial 4/4 done (depth 100%); finished in") for line in lines)
    assert "ETA" in captured.err and "\r" not in captured.err and captured.out == ""


def test_progress_false_is_silent(tiny, capsys) -> None:
    evaluate(tiny, byte_tokenizer(), [32], corpus="pydoc", max_windows=2, passkey_lengths=[120], depths=[0.5],
             trials=1, progress=False)
    token_ids = torch.tensor(byte_tokenizer()("some text to score, long enough")["input_ids"])
    perplexity(tiny, token_ids, 16)
    passkey_accuracy(tiny, byte_tokenizer(), 120, 0.5, trials=1)
    assert capsys.readouterr().err == ""


def test_passkey_accuracy_alone_can_report(tiny, capsys) -> None:
    passkey_accuracy(tiny, byte_tokenizer(), 120, 0.5, trials=2, progress=True)
    err = capsys.readouterr().err
    assert "passkey at 120 tokens, depth 50%: trial 1/2 done" in err and "trial 2/2 done" in err


def test_demo_reports_every_step_and_saves_a_complete_checkpoint(tmp_path, capsys) -> None:
    """The demo on a tiny checkpoint (trained length 64): progress lines for every phase on stderr; the extended
    checkpoint carries the tokenizer, so `hf-posswap eval --model` can load it."""
    from hf_posswap.cli.demo import main
    from hf_posswap.persistence.loading import inspect_model_path, load_tokenizer

    save_tiny_checkpoint("llama", tmp_path / "m")
    assert main(["--checkpoint", str(tmp_path / "m"), "--schemes", "alibi", "--length", "32",
                 "--extension-lengths", "32", "128", "--output", str(tmp_path / "demo")]) == 0
    captured = capsys.readouterr()
    for line in ("swaps: scheme 2/2 done (alibi); finished in",
                 "context extension: forward pass 4/4 done (yarn to 32768, 128 tokens); finished in",
                 "save and reload: step 2/2 done (reloaded); finished in"):
        assert line in captured.err
    assert "|      128 | past 64     |" in captured.out and "identical logits: True" in captured.out
    saved = tmp_path / "demo" / "m-yarn-32k"  # named after the checkpoint extended
    tokenizer = load_tokenizer(inspect_model_path(str(saved)), required=True)
    assert tokenizer("abc")["input_ids"] == byte_tokenizer()("abc")["input_ids"]
    assert main(["--checkpoint", str(tmp_path / "m"), "--schemes", "alibi", "--length", "32",
                 "--extension-lengths", "32", "--output", str(tmp_path / "quiet"), "--no-progress"]) == 0
    assert capsys.readouterr().err.count("done") == 0


def test_a_resumed_progress_counts_from_its_start_and_times_only_this_process(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: now[0])
    stream = io.StringIO()
    with Progress("finetune", 4, start=2, stream=stream, min_gap=0) as bar:
        now[0] += 10
        bar.step("loss 5.522")
        now[0] += 10
        bar.step()
    assert stream.getvalue().splitlines() == ["finetune: step 3/4 done (loss 5.522); 10 s elapsed, ETA 10 s",
                                              "finetune: step 4/4 done; finished in 20 s"]


def test_the_note_is_shown_beside_a_terminal_bar() -> None:
    stream = Terminal()
    with Progress("finetune", 3, stream=stream) as bar:
        bar.step("loss 5.522, eval loss 5.61")
        assert "loss 5.522, eval loss 5.61" in str(bar._bar)


def test_only_the_local_main_process_reports_and_progress_false_is_silent(tmp_path) -> None:
    config = FinetuneConfig(model="m", data=["d"], output=str(tmp_path), steps=5)
    main_process, other = SimpleNamespace(is_local_main_process=True), SimpleNamespace(is_local_main_process=False)
    assert _progress(config, 0, main_process).enabled
    assert not _progress(config, 0, other).enabled
    assert not _progress(FinetuneConfig(model="m", data=["d"], output="o", progress=False), 0, main_process).enabled
    assert _losses_note(5.52234, None) == "loss 5.522"
    assert _losses_note(5.52234, 5.6123) == "loss 5.522, eval loss 5.612"


def test_no_progress_flag_and_resume_ignore_it() -> None:
    base = ["--model", "m", "--data", "d", "--output", "o"]
    assert config_from_args(build_parser().parse_args(base)).progress is True
    quiet = config_from_args(build_parser().parse_args([*base, "--no-progress", "--no-progress"]))
    assert quiet.progress is False
    recorded = {**vars(config_from_args(build_parser().parse_args(base)))}
    assert setting_changes(recorded, quiet) == {}  # a resume may turn the progress off or on
