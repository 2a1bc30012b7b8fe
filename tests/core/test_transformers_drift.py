"""When transformers' internals move, hf_posswap raises instead of computing wrong numbers.

Each test simulates one kind of drift the way a release would bring it (the KV cache passed under a keyword the
library does not know, as 5.24 renamed ``past_key_values`` to ``cache``; a cache the position wrapper cannot see at
all; keyword arguments no longer forwarded to attention; a changed function signature; a release outside the tested
window) and checks that the user gets an error naming the release and the tested window, not wrong logits. One test
shows what the guards prevent: with them switched off, the same blind hook decodes wrong without a word.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import hf_posswap.transformers_internals as internals
from hf_posswap.core import attention as attention_module
from hf_posswap.core import context as context_module
from hf_posswap.core.forward_check import ForwardCheck
from hf_posswap.transformers_internals import TransformersDriftError, UntestedTransformersWarning

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import swapped  # noqa: E402

#: one scheme of each way the hook places positions: in-attention bias, in-attention rotary, absolute vectors
CASES = [
    pytest.param("llama", "alibi", id="llama-alibi"),
    pytest.param("gpt2", "t5", id="gpt2-t5"),
    pytest.param("gpt2", "rope", id="gpt2-rope"),
    pytest.param("llama", "sinusoidal", id="llama-sinusoidal"),
]
WINDOW = re.escape(f"tested with transformers {internals.OLDEST_TESTED} to {internals.NEWEST_TESTED}")


def prompt() -> torch.Tensor:
    return torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(0))


def step_scores(model, use_cache: bool) -> torch.Tensor:
    """Greedy decoding's scores [steps, 1, vocab]."""
    with torch.no_grad():
        out = model.generate(input_ids=prompt(), max_new_tokens=4, do_sample=False, use_cache=use_cache,
                             pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    return torch.stack(out.scores)


def blind_hook(monkeypatch) -> None:
    """The position wrapper finds no KV cache at all (as when a release moves it where no keyword shows it)."""
    monkeypatch.setattr(context_module, "find_cache", lambda kwargs, where="": None)


@pytest.mark.parametrize(("family", "scheme"), CASES)
def test_a_cache_under_an_unknown_keyword_raises(monkeypatch, family, scheme) -> None:
    model = swapped(family, scheme)
    running = internals.CACHE_KWARG  # forgotten, as by a table written before the release renamed it
    monkeypatch.setattr(internals, "KNOWN_CACHE_KWARGS", tuple(n for n in internals.KNOWN_CACHE_KWARGS if n != running))
    with pytest.raises(TransformersDriftError, match=f"as '{running}'.*{WINDOW}"):
        step_scores(model, use_cache=True)


@pytest.mark.parametrize(("family", "scheme"), CASES)
def test_a_cache_the_hook_cannot_see_raises(monkeypatch, family, scheme) -> None:
    model = swapped(family, scheme)
    step_scores(model, use_cache=False)  # no cache: nothing to see, nothing raised
    blind_hook(monkeypatch)
    with pytest.raises(TransformersDriftError, match=f"KV cache.*did not.*{WINDOW}"):
        step_scores(model, use_cache=True)


def continued_logits(model) -> torch.Tensor:
    """The last token's logits [1, vocab] after a prompt in the KV cache, as a hand-written decoding loop computes
    them (no position ids: the model places the token after the cache)."""
    from transformers import DynamicCache

    tokens = prompt()
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=tokens[:, :-1], **{internals.CACHE_KWARG: cache})
        return model(input_ids=tokens[:, -1:], **{internals.CACHE_KWARG: cache}).logits[:, -1]


def sharpened(family: str, scheme: str):
    """A swapped tiny model whose queries and keys are scaled up, so attention (and with it every position) matters
    to the logits: at initialisation attention is nearly uniform and a rotation changes logits by ~1e-4 only."""
    model = swapped(family, scheme)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("c_attn.weight", "q_proj.weight", "k_proj.weight")):
                parameter.mul_(4.0)
    return model


@pytest.mark.parametrize(("family", "scheme"), CASES)
def test_without_the_guards_a_blind_hook_decodes_wrong(monkeypatch, family, scheme) -> None:
    """What the guards are for: the same drift, guards off, gives wrong logits and no error."""
    model = sharpened(family, scheme)
    with torch.no_grad():
        expected = model(input_ids=prompt()).logits[:, -1]
    torch.testing.assert_close(continued_logits(model), expected, rtol=0, atol=1e-5)
    blind_hook(monkeypatch)
    monkeypatch.setattr(ForwardCheck, "verify", lambda self, outputs: None)
    monkeypatch.setattr(attention_module, "_refuse_unseen_cache", lambda *args: None)
    assert (continued_logits(model) - expected).abs().max() > 1e-3


def test_a_context_that_never_reaches_attention_raises(monkeypatch) -> None:
    """The hook hands the position context to attention through transformers' keyword forwarding; if that
    forwarding stops, the scheme is silently skipped, so the forward raises."""
    model = swapped("llama", "alibi")
    monkeypatch.setattr(context_module, "CONTEXT_KWARG", "posswap_context_elsewhere")
    with pytest.raises(TransformersDriftError, match=f"never received.*{WINDOW}"):
        model(input_ids=prompt())


def test_a_changed_signature_raises_naming_the_function(monkeypatch) -> None:
    from transformers.integrations import sdpa_attention

    def renamed(module, query, key, value, attention_mask, dropout=0.0, scale=None, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", renamed)
    with pytest.raises(TransformersDriftError, match=f"sdpa_attention_forward no longer takes scaling.*{WINDOW}"):
        internals.check_interfaces.__wrapped__()
    monkeypatch.undo()
    monkeypatch.delattr(sdpa_attention, "repeat_kv")
    with pytest.raises(TransformersDriftError, match="has no repeat_kv"):
        internals.check_interfaces.__wrapped__()
    monkeypatch.undo()
    internals.check_interfaces.__wrapped__()  # the real release passes


@pytest.mark.parametrize("running", ["99.0.0", "4.57.0"], ids=["newer", "older"])
def test_a_release_outside_the_window_warns_once(monkeypatch, running) -> None:
    monkeypatch.setattr(internals, "RUNNING", Version(running))
    internals.warn_if_untested.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        internals.warn_if_untested()
        internals.warn_if_untested()
    internals.warn_if_untested.cache_clear()
    messages = [str(w.message) for w in caught if issubclass(w.category, UntestedTransformersWarning)]
    assert len(messages) == 1
    assert f"{internals.OLDEST_TESTED} to {internals.NEWEST_TESTED}" in messages[0] and "doctor" in messages[0]


def test_a_release_inside_the_window_does_not_warn(monkeypatch) -> None:
    monkeypatch.setattr(internals, "RUNNING", Version(internals.NEWEST_TESTED))
    internals.warn_if_untested.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        internals.warn_if_untested()
    internals.warn_if_untested.cache_clear()


def test_the_declared_floor_is_the_oldest_tested_release() -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    floor = re.search(r'"transformers>=([\d.]+),', pyproject).group(1)
    assert Version(floor) == Version(internals.OLDEST_TESTED)


def test_the_cache_keyword_is_the_one_the_running_release_takes() -> None:
    """The keyword hf_posswap passes caches under is a parameter of the models' forward in this release."""
    import inspect

    from transformers import LlamaModel

    assert internals.CACHE_KWARG in inspect.signature(LlamaModel.forward).parameters
