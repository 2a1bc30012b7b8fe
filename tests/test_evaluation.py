"""Metrics against hand-computed values on tiny fixed models."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import byte_tokenizer, save_tiny_checkpoint
from torch import nn

import hf_posswap as ps
from hf_posswap.evaluation import evaluate, passkey_accuracy, passkey_prompt, perplexity


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
    with pytest.raises(ps.InvalidConfigError, match=r"Length 500 needs at least 500 tokens of text \(got 200\)"):
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
