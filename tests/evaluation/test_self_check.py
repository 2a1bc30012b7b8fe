"""``hf_posswap.self_check()`` and ``hf-posswap doctor``: pass on a sound installation, fail loudly on a broken one.

The broken builds are simulated the way a transformers release breaks a plugin: the position wrapper no longer finds
the KV cache (with the library's own drift guards on, the checks fail with their error; with them off, they fail on
the numbers alone), so the self-check catches what the guards catch and what they would miss.
"""

from __future__ import annotations

import pytest

import hf_posswap as ps
from hf_posswap.cli.main import main
from hf_posswap.core import attention as attention_module
from hf_posswap.core import context as context_module
from hf_posswap.core.forward_check import ForwardCheck
from hf_posswap.evaluation import self_check as self_check_module
from hf_posswap.evaluation.self_check import CHECKS, FAMILIES, self_check


def blind_hook(monkeypatch) -> None:
    monkeypatch.setattr(context_module, "find_cache", lambda kwargs, where="": None)


def test_self_check_is_exported_and_passes_for_one_family() -> None:
    report = ps.self_check(families=("llama",))
    assert report.ok, report.table()
    kinds = {result.kind for result in report.results}
    assert kinds == {"absolute", "rotary", "bias (alibi)", "bias (t5)", "two-pass", "mix"}
    assert {result.check for result in report.results} == set(CHECKS)
    assert all(result.ok for result in report.results)  # a decoder: every check applies


@pytest.mark.slow
def test_self_check_passes_for_every_family() -> None:
    report = self_check()
    assert report.ok, report.table()
    assert {result.family for result in report.results} == set(FAMILIES)


def test_encoders_have_no_cached_generation_or_two_pass() -> None:
    report = self_check(families=("bert",))
    assert report.ok, report.table()
    not_applicable = {(r.kind, r.check) for r in report.results if r.ok is None}
    assert ("two-pass", "padding") in not_applicable and ("rotary", "cached = uncached") in not_applicable
    assert ("rotary", "padding") not in not_applicable


def test_a_blind_hook_fails_the_cached_checks_with_the_drift_error(monkeypatch) -> None:
    blind_hook(monkeypatch)
    report = self_check(families=("gpt2",))
    assert not report.ok
    failed = {(r.kind, r.check) for r in report.failures}
    assert ("bias (t5)", "cached = uncached") in failed and ("rotary", "cached = uncached") in failed
    assert all(r.check == "cached = uncached" for r in report.failures)
    assert "TransformersDriftError" in report.table() and "FAIL gpt2 / bias (t5) / cached = uncached" in report.table()


def test_a_blind_hook_without_the_guards_fails_on_the_numbers(monkeypatch) -> None:
    blind_hook(monkeypatch)
    monkeypatch.setattr(ForwardCheck, "verify", lambda self, outputs: None)
    monkeypatch.setattr(attention_module, "_refuse_unseen_cache", lambda *args: None)
    report = self_check(families=("llama",))
    failed = {(r.kind, r.check) for r in report.failures}
    assert {("bias (alibi)", "cached = uncached"), ("bias (t5)", "cached = uncached")} <= failed
    assert all("max |difference|" in r.detail for r in report.failures)


def test_doctor_prints_the_versions_and_exits_1_on_a_failure(monkeypatch, capsys) -> None:
    monkeypatch.setattr(self_check_module, "FAMILIES", ("llama",))
    monkeypatch.setattr(self_check_module.self_check, "__defaults__", (("llama",),))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "transformers " in out and "torch " in out and "peft " in out and "accelerate " in out
    assert "all checks passed" in out and "\nhub kernels: " in out
    blind_hook(monkeypatch)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL llama / bias (t5) / cached = uncached" in out and "FAILED" in out


@pytest.mark.parametrize("families", [("mistral",), (), ["gpt2", "t5"]], ids=["unknown", "none", "one-unknown"])
def test_unknown_or_no_families_are_refused(families) -> None:
    with pytest.raises(ps.InvalidConfigError, match="choose one or more of gpt2, bert"):
        self_check(families=families)


def test_one_family_may_be_named_alone() -> None:
    assert {r.family for r in self_check(families="gpt2").results} == {"gpt2"}


def test_the_report_says_what_from_pretrained_does_with_hub_kernels(monkeypatch) -> None:
    """transformers 5.25 kernelizes by default where ``kernels`` is installed and raises without it unless
    ``USE_HUB_KERNELS`` turns them off: a doctor report from such an environment names the cause of its failures."""
    import importlib.metadata

    from packaging.version import Version

    from hf_posswap import transformers_internals as internals

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(internals, "RUNNING", Version("5.24.0"))
    assert internals.hub_kernels_state() == "off unless asked for (use_kernels=True)"
    monkeypatch.setattr(internals, "RUNNING", Version("5.25.0"))
    monkeypatch.setenv("USE_HUB_KERNELS", "NO")
    assert internals.hub_kernels_state() == "off (USE_HUB_KERNELS=NO)"
    monkeypatch.delenv("USE_HUB_KERNELS")
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert internals.hub_kernels_state().startswith("kernels is not installed: from_pretrained raises")
