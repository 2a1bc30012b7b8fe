"""Metrics against hand-computed values on tiny fixed models."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import byte_tokenizer, make_model, save_tiny_checkpoint, tiny_config
from torch import nn

import hf_posswap as ps
from hf_posswap.evaluation import evaluate, passkey_accuracy, passkey_prompt, perplexity
from hf_posswap.evaluation.plots import load_runs
from hf_posswap.persistence.saving import OutputError


class Output:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class UniformModel(nn.Module):
    """Zero logits: every token has probability 1 / vocab."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor) -> Output:
        return Output(torch.zeros(*input_ids.shape, self.vocab))


class CopyModel(nn.Module):
    """Predicts the token that followed the last earlier occurrence of the current 12-gram (an ideal induction head);
    token 0 when the 12-gram is new."""

    def __init__(self, vocab: int, n: int = 12) -> None:
        super().__init__()
        self.vocab, self.n = vocab, n
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor) -> Output:
        ids = input_ids[0].tolist()
        logits = torch.zeros(1, len(ids), self.vocab)
        for t in range(len(ids)):
            gram = ids[max(0, t - self.n + 1): t + 1]
            prediction = 0
            for start in range(t - len(gram), -1, -1):
                if ids[start: start + len(gram)] == gram and start + len(gram) < len(ids):
                    prediction = ids[start + len(gram)]
                    break
            logits[0, t, prediction] = 10.0
        return Output(logits)


class BigramModel(nn.Module):
    """p(next | current) from a fixed table: perplexity can be computed by hand."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table)

    def forward(self, input_ids: torch.Tensor) -> Output:
        return Output(self.table[input_ids])


TOKENS = torch.randint(0, 7, (200,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("mode", ["windows", "sliding", "tail"])
def test_uniform_model_perplexity_is_the_vocabulary_size(mode: str) -> None:
    result = perplexity(UniformModel(7), TOKENS, 50, mode, stride=20, tail_from=30)
    assert result.perplexity == pytest.approx(7.0, rel=1e-6)


def test_bigram_perplexity_by_hand() -> None:
    table = torch.randn(7, 7, generator=torch.Generator().manual_seed(1))
    model = BigramModel(table)
    log_probs = table.log_softmax(-1)
    windows = perplexity(model, TOKENS, 50, "windows")
    expected = [-log_probs[TOKENS[s + i], TOKENS[s + i + 1]] for s in range(0, 200, 50) for i in range(49)]
    assert windows.tokens == 4 * 49 and windows.windows == 4
    assert windows.perplexity == pytest.approx(math.exp(float(torch.stack(expected).mean())), rel=1e-5)
    tail = perplexity(model, TOKENS, 50, "tail", tail_from=40)  # targets 40..49 of each window
    expected = [-log_probs[TOKENS[s + i - 1], TOKENS[s + i]] for s in range(0, 200, 50) for i in range(40, 50)]
    assert tail.tokens == 40 and tail.perplexity == pytest.approx(math.exp(float(torch.stack(expected).mean())),
                                                                  rel=1e-5)
    sliding = perplexity(model, TOKENS, 50, "sliding", stride=25)  # every target from 1 to 199 exactly once
    expected = [-log_probs[TOKENS[i - 1], TOKENS[i]] for i in range(1, 200)]
    assert sliding.tokens == 199
    assert sliding.perplexity == pytest.approx(math.exp(float(torch.stack(expected).mean())), rel=1e-5)


def test_copy_model_retrieves_every_passkey() -> None:
    tokenizer = byte_tokenizer()
    model = CopyModel(len(tokenizer))
    for depth in (0.0, 0.5, 1.0):
        assert passkey_accuracy(model, tokenizer, 300, depth, trials=3).accuracy == 1.0
    assert passkey_accuracy(UniformModel(len(tokenizer)), tokenizer, 300, 0.5, trials=3).accuracy == 0.0


def test_one_pass_passkey_check_agrees_with_greedy_decoding() -> None:
    """The one-forward check decides each trial as plain greedy decoding does: copying models that look back 1-12
    tokens (right, wrong, or drifting mid-key) and a random LLaMA."""
    from hf_posswap.evaluation.passkey import _greedy, _greedy_finds_key

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    models = [CopyModel(len(tokenizer), n) for n in (1, 2, 3, 12)]
    models.append(_random_byte_llama())
    outcomes = []
    for trial, depth in enumerate((0.0, 0.3, 1.0)):
        key = f"{13_579 + 7_919 * trial}"
        prompt = passkey_prompt(tokenizer, 150, depth, key)
        # answers without the leading space: right only after decoding greedily
        unspaced = ScriptedModel(len(tokenizer), prompt.numel(), tokenizer(key)["input_ids"])
        for model in [*models, unspaced]:
            greedy = tokenizer.decode(_greedy(model, prompt, 7)).strip().startswith(key)
            assert _greedy_finds_key(model, tokenizer, prompt, key) == greedy
            outcomes.append(greedy)
        assert greedy  # the unspaced answer counts
    assert any(outcomes) and not all(outcomes)


class ScriptedModel(nn.Module):
    """Predicts ``script[k]`` at position prompt_length - 1 + k, whatever the input."""

    def __init__(self, vocab: int, prompt_length: int, script: list[int]) -> None:
        super().__init__()
        self.vocab, self.start, self.script = vocab, prompt_length - 1, script
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor) -> Output:
        logits = torch.zeros(1, input_ids.shape[1], self.vocab)
        for k, token in enumerate(self.script):
            if self.start + k < input_ids.shape[1]:
                logits[0, self.start + k, token] = 10.0
        return Output(logits)


def _random_byte_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(config).eval()


def test_passkey_prompt_length_and_depth() -> None:
    tokenizer = byte_tokenizer()
    for depth in (0.0, 0.25, 1.0):
        ids = passkey_prompt(tokenizer, 400, depth, "12345")
        text = tokenizer.decode(ids)
        assert abs(len(ids) - 400) <= 2 and text.count("12345") == 2 and text.endswith("The pass key is")
        position = text.index("The pass key is 12345") / len(text)
        assert abs(position - depth * (1 - 90 / 400)) < 0.1


def test_errors() -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"Unknown perplexity mode 'window'. Modes: windows, sliding"):
        perplexity(UniformModel(7), TOKENS, 50, "window")
    with pytest.raises(ps.InvalidConfigError,
                       match=r"Length 500 needs at least 500 tokens of text, and the text has 200; give a longer text"):
        perplexity(UniformModel(7), TOKENS, 500)
    with pytest.raises(ps.InvalidConfigError, match=r"Tail NLL needs 0 < tail_from < length=50"):
        perplexity(UniformModel(7), TOKENS, 50, "tail", tail_from=60)


@pytest.mark.slow
def test_evaluate_writes_json_and_the_cli_prints_it(tmp_path) -> None:
    save_tiny_checkpoint("llama", tmp_path / "model")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    ps.swap(model, "alibi")
    results = evaluate(model, byte_tokenizer(), [32, 128], corpus="pydoc", modes=["windows", "tail"], tail_from=16,
                       max_windows=2, passkey_lengths=[100], depths=[0.5], trials=2, output=tmp_path / "r.json",
                       progress=False)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved == json.loads(json.dumps(results))
    assert [(r["length"], r["mode"]) for r in saved["perplexity"]] == [(32, "windows"), (32, "tail"),
                                                                      (128, "windows"), (128, "tail")]
    assert saved["passkey"][0]["trials"] == 2 and saved["text"]["source"] == "corpus:pydoc"
    result = subprocess.run([sys.executable, "-m", "hf_posswap", "eval", "--model", str(tmp_path / "model"),
                             "--lengths", "64", "--corpus", "pydoc", "--max-windows", "1",
                             "--output", str(tmp_path / "cli.json")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "perplexity  length     64  windows" in result.stdout
    assert json.loads((tmp_path / "cli.json").read_text())["perplexity"][0]["windows"] == 1


PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("family", "scheme", "picture"), [("gpt2", None, "absolute_cosine.png"),
                                                           ("llama", "alibi", "bias_per_head.png"),
                                                           ("bert", "t5", "bias_per_head.png"),
                                                           ("llama", None, "rope_qk_vs_distance.png"),
                                                           ("gpt2", "rope", "rope_qk_vs_distance.png")])
@pytest.mark.slow
def test_inspect_cli_draws_the_scheme(tmp_path, family, scheme, picture) -> None:
    save_tiny_checkpoint(family, tmp_path / "model")
    command = [sys.executable, "-m", "hf_posswap", "inspect", "--model", str(tmp_path / "model"), "--length", "48",
               "--output", str(tmp_path / "pictures")] + (["--scheme", scheme] if scheme else [])
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "pictures" / picture).read_bytes().startswith(PNG)


@pytest.mark.slow
def test_plot_cli(tmp_path) -> None:
    results = {"perplexity": [{"length": n, "mode": "windows", "perplexity": p} for n, p in ((64, 9.0), (128, 20.0))],
               "passkey": [{"length": n, "depth": d, "accuracy": a} for n in (64, 128) for d, a in ((0.0, 1.0),
                                                                                                   (1.0, 0.5))]}
    (tmp_path / "a.json").write_text(json.dumps(results))
    result = subprocess.run([sys.executable, "-m", "hf_posswap", "plot", f"alibi={tmp_path / 'a.json'}",
                             str(tmp_path / "a.json"), "--trained-length", "64", "--output", str(tmp_path / "p.png"),
                             "--passkey-output", str(tmp_path / "k.png")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "p.png").read_bytes().startswith(PNG) and (tmp_path / "k.png").read_bytes().startswith(PNG)


class CountingModel(UniformModel):
    """A uniform model that counts its forward passes."""

    calls = 0

    def forward(self, input_ids: torch.Tensor):
        CountingModel.calls += 1
        return super().forward(input_ids)


def test_max_windows_zero_means_all_windows_not_zero_tokens() -> None:
    every = perplexity(UniformModel(7), TOKENS, 50, max_windows=None)
    zero = perplexity(UniformModel(7), TOKENS, 50, max_windows=0)
    assert zero.windows == every.windows == 4 and zero.tokens == every.tokens > 0
    assert math.isclose(zero.perplexity, 7.0, rel_tol=1e-5)
    with pytest.raises(ps.InvalidConfigError, match=r"max_windows must be an integer >= 0 .*got -1"):
        perplexity(UniformModel(7), TOKENS, 50, max_windows=-1)


def test_evaluate_refuses_an_encoder() -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"BertForMaskedLM is not a causal language model"):
        evaluate(make_model("bert"), byte_tokenizer(), [32], corpus="pydoc", progress=False)


@pytest.mark.parametrize(("length", "depth", "trials", "message"), [
    (0, 0.5, 1, r"passkey length must be a positive number of tokens, got 0"),
    (-5, 0.5, 1, r"passkey length must be a positive number of tokens, got -5"),
    (200, 1.5, 1, r"passkey depth must be in \[0, 1\] \(0 = start, 1 = end\), got 1.5"),
    (200, -0.1, 1, r"passkey depth must be in \[0, 1\].*got -0.1"),
    (200, 0.5, 0, r"Passkey trials must be an integer >= 1, got 0"),
])
def test_passkey_refuses_impossible_settings(length, depth, trials, message) -> None:
    with pytest.raises(ps.InvalidConfigError, match=message):
        passkey_accuracy(UniformModel(259), byte_tokenizer(), length, depth, trials)


@pytest.mark.parametrize(("settings", "message"), [
    ({"passkey_lengths": [0]}, r"Passkey lengths \(--passkey-lengths\) must be integers >= 1, got 0"),
    ({"passkey_lengths": [300], "depths": [2.0]}, r"depths \(--depths\) must be in \[0, 1\].*got 2.0"),
    ({"passkey_lengths": [300], "depths": [float("nan")]}, r"must be in \[0, 1\].*got nan"),
    ({"passkey_lengths": [300], "trials": 0}, r"Passkey trials \(--trials\) must be integers >= 1, got 0"),
    ({"passkey_lengths": [20]}, r"Passkey length 20 is shorter than the needle and the question alone"),
    ({"lengths": [32, 64], "modes": ["windows", "tail"], "tail_from": 48},
     r"every length must exceed it; length 32 does not"),
    ({"lengths": [32, 64], "modes": ["sliding"], "stride": 40}, r"The sliding stride 40 exceeds length 32"),
    ({"lengths": [1]}, r"must be integers >= 2, got 1"),
    ({"lengths": []}, r"Nothing to measure"),
    ({"lengths": [32, 10**7]}, r"Length 10000000 needs at least 10000000 tokens of text"),
])
def test_evaluate_checks_every_setting_before_the_first_forward(settings, message) -> None:
    CountingModel.calls = 0
    with pytest.raises(ps.InvalidConfigError, match=message):
        evaluate(CountingModel(259), byte_tokenizer(), **{"lengths": [32], "corpus": "pydoc", "progress": False,
                                                           **settings})
    assert CountingModel.calls == 0, "a bad setting was found only after measuring"


def test_lengths_past_a_learned_table_are_refused_before_running() -> None:
    model = make_model("gpt2")  # learned table of 64 positions
    with pytest.raises(ps.InvalidConfigError, match=r"Length 100 exceeds the model's learned position table "
                       r"\(transformer.wpe: 64 positions\).*hf-posswap extend --to 100"):
        evaluate(model, byte_tokenizer(), [100], corpus="pydoc", progress=False)


def test_a_perplexity_past_the_float_range_is_inf_not_an_overflow_error() -> None:
    """A mean NLL above ~709.8 nats (a model sure of the wrong token) overflows math.exp; the perplexity is inf."""
    table = torch.full((7, 7), -1000.0)
    table[:, 0] = 1000.0  # every next token predicted to be 0 with a margin of 2,000 nats
    result = perplexity(BigramModel(table), torch.ones(100, dtype=torch.long), 50)
    assert result.nll > 1000 and result.perplexity == math.inf


def test_a_passkey_prompt_past_a_learned_table_says_what_fits() -> None:
    """The prompt plus the answer's tokens must fit the table: the error names the passkey length the user gave and
    one that fits, not the internal prompt length."""
    from transformers import GPT2LMHeadModel

    config = tiny_config("gpt2")
    config.n_positions, config.vocab_size = 200, 259  # room for the shortest passkey prompt (96 byte tokens)
    model = GPT2LMHeadModel(config)
    with pytest.raises(ps.InvalidConfigError) as refused:
        evaluate(model, byte_tokenizer(), passkey_lengths=[200], progress=False)
    message = str(refused.value)
    assert message.startswith("Passkey length 200 needs ") and "(transformer.wpe: 200 positions)" in message
    fitting = int(message.split("use passkey lengths <= ")[1].split(",")[0])
    evaluate(model, byte_tokenizer(), passkey_lengths=[fitting], depths=[0.5], trials=1, progress=False)


def test_evaluate_refuses_empty_text() -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"The evaluation text is empty"):
        evaluate(UniformModel(259), byte_tokenizer(), [8], text="  \n", progress=False)


def test_passkey_prompt_refuses_a_bad_depth() -> None:
    with pytest.raises(ps.InvalidConfigError, match=r"got 3"):
        passkey_prompt(byte_tokenizer(), 200, 3, "12345")


@pytest.mark.slow
def test_evaluate_output_is_checked_first_and_written_atomically(tmp_path) -> None:
    CountingModel.calls = 0
    with pytest.raises(OutputError, match=r"the directory .*no-such-dir.* does not exist; create it first"):
        evaluate(CountingModel(259), byte_tokenizer(), [32], corpus="pydoc", output=tmp_path / "no-such-dir" / "r.json",
                 progress=False)
    assert CountingModel.calls == 0
    evaluate(CountingModel(259), byte_tokenizer(), [32], corpus="pydoc", max_windows=1, output=tmp_path / "r.json",
             progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left beside it


@pytest.mark.parametrize(("content", "message"), [
    (None, r"Results file .*missing.json' does not exist"),
    ("{not json", r"is not valid JSON \(Expecting property name"),
    ('{"passkey": []}', r"is not an hf-posswap eval results file"),
    ('{"perplexity": [{"length": 8, "mode": "sliding", "perplexity": 3.0}]}',
     r"has no perplexity rows of mode 'windows' \(it has: sliding\)"),
])
def test_load_runs_names_the_bad_file(tmp_path, content, message) -> None:
    path = tmp_path / "missing.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ps.PosSwapError, match=message):
        load_runs([f"run={path}"], mode="windows")
